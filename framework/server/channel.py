"""The link between the HTTP process and a scheduler process: length-prefixed messages over one
Unix stream socket.

The HTTP process listens on a path inside its private run directory before it spawns the
scheduler (:func:`listen`); the scheduler connects (:meth:`SocketChannel.connect`) and both sides
then write frames (a 4-byte little-endian length, then the bytes) in either direction. The
scheduler's end blocks (:class:`SocketChannel`: it has nothing else to do while idle); the HTTP
process's end is an asyncio protocol (:class:`AsyncChannel`) whose received frames go straight to
a callback from the event loop.

Why not ZMQ (which this replaced, 2026-12-08): a ZMQ message between two processes passes four
threads, the sender, the sender's I/O thread, the receiver's I/O thread and the receiver, each
woken in turn. On a 2-vCPU host whose two cores run the model's OpenMP threads, every wake-up is
a preemption of the forward, and a message a step is the cost of every token. A socket written
from the sending thread and read by the receiving one wakes one thread. Both ends are this
project's own code, so ZMQ's routing, reconnection and queueing were not needed: the message
boundaries are the only thing a stream lacks, and the length prefix gives them.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import cast

HEADER = struct.Struct("<I")
"""A frame's header: the length of its body in bytes."""

MAX_FRAME = (1 << 32) - 1
"""The largest body a header can describe (4 GiB - 1)."""

READ_SIZE = 1 << 18
"""Bytes read per receive call on the scheduler's end (a step's outputs fit many times over)."""

SOCKET_BUFFER = 1 << 22
"""Kernel buffer size asked for on both ends, so a step's outputs at high concurrency (or a burst
of requests) never blocks the sender while the other side is busy for a moment."""

MAX_PATH = 107
"""The longest Unix socket path Linux takes (``sun_path`` is 108 bytes with its terminating NUL)."""

_SMALL = 1 << 16
"""Below this :func:`frame` copies a body behind its header; above, it is written after it."""


class ChannelClosed(ConnectionError):
    """The other end of the channel is gone (its process exited or closed it)."""


def header(size: int) -> bytes:
    """The header of a frame whose body is ``size`` bytes (ValueError above :data:`MAX_FRAME`)."""
    if size > MAX_FRAME:
        raise ValueError(f"a message of {size} bytes is over the channel's limit of {MAX_FRAME}")
    return HEADER.pack(size)


def frame(data: bytes) -> list[bytes]:
    """``data`` as the pieces of one frame to write in order: a small body copied behind its
    header (one write), a large one after it uncopied (two)."""
    return [header(len(data)) + data] if len(data) < _SMALL else [header(len(data)), data]


class FrameReader:
    """Cuts a byte stream back into the frames written into it.

    :meth:`feed` takes whatever a receive returned and gives the frames it completed, as
    memoryviews into the received bytes (no copy for the usual case: whole frames in one read).
    A partial frame waits until the bytes it needs have arrived, so a large one is joined once,
    not once per read.
    """

    def __init__(self) -> None:
        self._partial = bytearray()
        self._needed = 0
        """Bytes ``_partial`` must hold before another frame can complete."""

    def feed(self, data: bytes) -> list[memoryview]:
        if self._partial:
            self._partial += data
            if len(self._partial) < self._needed:
                return []
            data, self._partial = bytes(self._partial), bytearray()
        view = memoryview(data)
        frames: list[memoryview] = []
        pos, end = 0, len(data)
        while end - pos >= HEADER.size:
            stop = pos + HEADER.size + HEADER.unpack_from(data, pos)[0]
            if stop > end:
                break
            frames.append(view[pos + HEADER.size:stop])
            pos = stop
        if pos < end:
            self._partial = bytearray(view[pos:])
            have = end - pos
            self._needed = HEADER.size + HEADER.unpack_from(data, pos)[0] if have >= HEADER.size else HEADER.size
        return frames


def listen(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (non-blocking, for :meth:`AsyncChannel.accept`).

    Bound before the peer process starts, so that its connect never races the bind: the kernel
    queues the connection until the event loop accepts it."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise ValueError(f"the channel path {path!r} is longer than a Unix socket allows ({MAX_PATH} bytes): "
                         f"point TMPDIR at a shorter directory")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _enlarge_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:  # capped by the kernel's limits: the default size still works
            pass


class SocketChannel:
    """The scheduler's (blocking) end: :meth:`send` a message, :meth:`poll` for one, :meth:`recv`
    what has arrived. Raises :class:`ChannelClosed` once the HTTP process is gone."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        _enlarge_buffers(sock)
        self.sock = sock
        self._reader = FrameReader()
        self._frames: deque[memoryview] = deque()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    @classmethod
    def connect(cls, path: str) -> SocketChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def send(self, data: bytes) -> None:
        """Send one message (blocks only while the kernel's buffer towards the peer is full)."""
        try:
            for piece in frame(data):
                self.sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed(f"the peer closed the channel: {exc}") from exc

    def poll(self, timeout_ms: float) -> bool:
        """Whether a whole message is waiting; waits up to ``timeout_ms`` for one (0: not at all)."""
        if self._frames:
            return True
        deadline = time.monotonic() + timeout_ms / 1e3
        while True:
            remaining_ms = max(0.0, (deadline - time.monotonic()) * 1e3)
            # select.poll rounds its timeout down to whole milliseconds: round up instead, so that
            # a wait of 0.4 ms is not a busy loop of zero-timeout polls.
            if not self._poller.poll(int(remaining_ms) + (remaining_ms % 1 > 0)):
                return False
            self._read()
            if self._frames:
                return True
            if remaining_ms == 0:
                return False

    def recv(self) -> memoryview | None:
        """The next message, or None if none has arrived whole (never blocks). Reads as long as
        the socket has bytes, so that a large message (a weight update) is taken in one call
        between two steps rather than one read per step."""
        while not self._frames and self._poller.poll(0):
            self._read()
        return self._frames.popleft() if self._frames else None

    def _read(self) -> None:
        try:
            data = self.sock.recv(READ_SIZE)
        except ConnectionResetError as exc:
            raise ChannelClosed(f"the peer closed the channel: {exc}") from exc
        if not data:
            raise ChannelClosed("the peer closed the channel")
        self._frames.extend(self._reader.feed(data))

    def close(self) -> None:
        self.sock.close()


class AsyncChannel(asyncio.Protocol):
    """The HTTP process's end of one scheduler's channel, on its event loop.

    :meth:`accept` takes the scheduler's connection on the listening socket; until a handler is
    set (:meth:`deliver_to`) received messages queue and :meth:`receive` hands them out one by
    one (the start-up handshake); after it, each message goes to the handler as soon as it is
    read. :meth:`send` never blocks: what the kernel does not take at once, the transport keeps.
    """

    def __init__(self, listener: socket.socket) -> None:
        self._listener: socket.socket | None = listener
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._queued: deque[memoryview] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._handler: Callable[[memoryview], None] | None = None
        self.lost: BaseException | None = None
        """Set when the connection ended (a :class:`ChannelClosed`, with the cause if any)."""

    @property
    def connected(self) -> bool:
        return self._transport is not None and self.lost is None

    async def accept(self) -> None:
        """Wait for the peer's connection (then stop listening: one peer per channel)."""
        if self._listener is None:
            raise ChannelClosed("the channel is closed")
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self._listener)
        self._close_listener()
        _enlarge_buffers(conn)
        await loop.connect_accepted_socket(lambda: self, conn)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass of it

    def data_received(self, data: bytes) -> None:
        frames = self._reader.feed(data)
        if self._handler is not None:
            for frame in frames:
                self._handler(frame)
            return
        self._queued.extend(frames)
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        cause = f": {exc}" if exc is not None else ""
        self.lost = ChannelClosed(f"the scheduler's channel closed{cause}")
        self._wake()

    # -- receiving and sending ---------------------------------------------------------------

    async def receive(self) -> memoryview:
        """The next message (before :meth:`deliver_to`); ChannelClosed if the peer is gone."""
        while not self._queued:
            if self.lost is not None:
                raise self.lost
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queued.popleft()

    def deliver_to(self, handler: Callable[[memoryview], None]) -> None:
        """Hand every message to ``handler`` from now on, those already queued first."""
        while self._queued:
            handler(self._queued.popleft())
        self._handler = handler

    def send(self, data: bytes) -> None:
        """Queue one message for the peer (ChannelClosed if it is gone or never connected)."""
        if self._transport is None or self.lost is not None or self._transport.is_closing():
            raise self.lost or ChannelClosed("the scheduler's channel is not connected")
        self._transport.writelines(frame(data))

    def close(self) -> None:
        self._close_listener()
        if self._transport is not None:
            self._transport.close()  # what is still buffered (a Shutdown) goes out first

    def _close_listener(self) -> None:
        if self._listener is not None:
            path = self._listener.getsockname()
            self._listener.close()
            self._listener = None
            if isinstance(path, str) and path:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
