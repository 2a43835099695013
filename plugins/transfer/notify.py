"""Completion notices for backends that write straight into the peer's memory (mooncake).

The receiver binds a pyzmq PULL socket (advertised in its endpoint); after writing a room's pages
the sender pushes ``{"room", "ok", "metadata"}`` as msgpack (never pickle). One thread owns each
socket: zmq sockets are not thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq


class Notice(msgspec.Struct):
    room: int
    ok: bool
    metadata: bytes = b""
    error: str | None = None


class NoticeReceiver:
    """A PULL socket on ``host`` (a free port) read by a daemon thread that calls ``on_notice``."""

    def __init__(self, host: str, on_notice: Callable[[Notice], None]) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-notices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                notice = msgspec.msgpack.decode(self._sock.recv(zmq.NOBLOCK), type=Notice)
            except (zmq.Again, msgspec.DecodeError):
                continue
            self._on_notice(notice)
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class NoticeSender:
    """A PUSH socket to the receiver's address (used from one thread only)."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, notice: Notice) -> None:
        self._sock.send(msgspec.msgpack.encode(notice))

    def close(self) -> None:
        self._sock.close()
