"""The HTTP/1.1 connection protocols: uvicorn's httptools and h11 protocols with the limits they lack.

uvicorn closes an idle keep-alive connection only after a response, so a connection that never
sends a request, sends its headers a line at a time, or is one of thousands stays open forever.
:class:`ConnectionGuard` adds, per connection, to whichever of uvicorn's protocols serves it:

- a header deadline (``server.header_read_timeout_s``) from the moment the connection opens or
  the next request's first byte arrives until that request's headers are complete: an idle
  connection is closed, one that sent part of a request gets a 408 first;
- the connection cap (``server.max_connections``): a connection past it is marked, and
  :class:`~framework.server.request_guard.RequestGuard` answers its request with a 503;
- malformed HTTP (a bad Content-Length or chunk size, a control character in the target) gets a
  400 in the API's JSON error shape instead of uvicorn's plain text.

``server.http_parser`` picks the protocol: httptools (llhttp, in C; what ``uvicorn[standard]``
runs and vLLM and SGLang serve with) or h11 (pure Python). ``auto`` takes httptools when it is
installed. On the 2-core test host, h11 on asyncio's loop cost the HTTP process 12-29% more CPU
over one-stream runs than httptools on uvloop, CPU the model's threads lose (docs/benchmarks.md).

The body deadline lives in the request guard, which reads every body.
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from framework.server.errors import APIError
from framework.server.request_guard import OVER_CAPACITY


@dataclass(frozen=True)
class ConnectionLimits:
    """``server.max_connections`` and ``server.header_read_timeout_s``."""

    max_connections: int
    header_read_timeout_s: float


class ConnectionGuard(asyncio.Protocol):
    """The limits, for a uvicorn protocol class that comes after it in the bases.

    A subclass says whether the connection waits for a request's headers
    (:meth:`_awaiting_headers`) and whether a response is being written (:meth:`_responding`);
    the rest is common.
    """

    limits = ConnectionLimits(max_connections=1024, header_read_timeout_s=20.0)
    """Replaced per server by :func:`protocol_class`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial_request = False

    # what the protocol knows (each subclass asks its parser)

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def _responding(self) -> bool:
        raise NotImplementedError

    # asyncio.Protocol, wrapped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:  # type: ignore[attr-defined]
            # Answered (503) once its request arrives: refusing before reading it would reset the
            # connection under a client that is still sending.
            self.app_state = {**self.app_state, OVER_CAPACITY: True}  # type: ignore[has-type]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._partial_request = True
            if self._header_timer is None:  # the first bytes of a keep-alive connection's next request
                self._arm_header_timer()
        super().data_received(data)  # type: ignore[misc]
        if not self._awaiting_headers():
            self._disarm_header_timer()
            self._partial_request = False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._partial_request = False
        super().on_response_complete()  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP: the API's error shape (uvicorn answers in plain text)."""
        self._disarm_header_timer()
        self._write_error(APIError(400, "the request is not valid HTTP/1.1 (malformed request line, headers, "
                                        "Content-Length or chunked encoding)", code="invalid_http"))

    # -- the header deadline --------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(  # type: ignore[attr-defined]
            self.limits.header_read_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() or not self._awaiting_headers():
            return
        if self._partial_request and not self._responding():
            self._write_error(APIError(
                408, f"the request headers did not arrive within {self.limits.header_read_timeout_s:g}s "
                     "(server.header_read_timeout_s)", code="request_timeout"))
        else:
            transport.close()

    def _write_error(self, error: APIError) -> None:
        """A complete JSON error response written straight to the socket, then close: there is no
        request to answer (none arrived, or it could not be parsed)."""
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        body = json.dumps(error.body()).encode()
        phrase = http.HTTPStatus(error.status).phrase
        head = (f"HTTP/1.1 {error.status} {phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
        if not transport.is_closing():
            transport.write(head + body)
            transport.close()


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap and JSON errors."""

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _responding(self) -> bool:
        return self.conn.our_state is not h11.IDLE


def guarded_httptools_protocol() -> type[ConnectionGuard]:
    """uvicorn's httptools protocol with the same limits (imported here: httptools is optional)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
        """The connection waits for headers while no request cycle is open: before the first
        request, and after each response until the next request's headers are parsed (uvicorn
        replaces ``cycle`` when they are)."""

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _responding(self) -> bool:
            return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    return GuardedHttpToolsProtocol


def protocol_class(limits: ConnectionLimits, parser: str = "h11") -> type[ConnectionGuard]:
    """The guarded protocol of ``parser`` (``httptools`` or ``h11``, as
    :func:`framework.server.http_stack.resolve_http_parser` gives it) bound to ``limits`` (uvicorn
    builds the protocol from a class, one instance per connection)."""
    base = guarded_httptools_protocol() if parser == "httptools" else GuardedH11Protocol
    return type(f"Plugserve{base.__name__}", (base,), {"limits": limits})
