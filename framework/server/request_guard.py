"""The outermost ASGI layer: what every request goes through before and after its route.

- A connection past ``server.max_connections`` (marked by the connection protocol) gets a 503.
- While the server drains (SIGTERM), a new request gets a 503 at once.
- The body is read here, whole, for every route: over ``server.max_body_bytes`` it is a 413
  (also on routes that ignore their body), slower than ``server.body_read_timeout_s`` a 408, and
  an upload still arriving when the server starts draining a 503; the route then reads the
  buffered body as usual.
- A route that raises or is cancelled (the last resort of a shutdown) still ends with a
  well-formed answer: a JSON error in OpenAI's shape before the response started, or an error
  event and ``[DONE]`` if an event stream had started.

Every refusal here closes the connection (``Connection: close``): the rest of its body may still
be on the way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from framework.server.errors import APIError
from framework.server.http_utils import SSE_DONE, sse

logger = logging.getLogger("plugserve.server")

OVER_CAPACITY = "plugserve.over_capacity"
"""Key the connection protocol sets in the ASGI scope's ``state`` of a connection past the cap."""
RETRY_AFTER_S = 1


@dataclass
class GuardLimits:
    """The limits this layer enforces (from ``server.*``)."""

    max_body_bytes: int
    body_read_timeout_s: float
    large_bodies: dict[str, tuple[int, str]] = field(default_factory=dict)
    """path -> (limit, config key) for routes whose bodies are legitimately big (weight updates);
    they apply only to requests that :attr:`large_body_allowed` accepts (the admin's)."""
    large_body_allowed: Callable[[Scope], bool] = field(default=lambda scope: False)


    def large_body_paths_get(self, scope: Scope) -> tuple[int, str] | None:
        """The big-body limit of this request's path, if it has one and the request may use it."""
        large = self.large_bodies.get(scope.get("path", ""))
        return large if large is not None and self.large_body_allowed(scope) else None


class Lifecycle:
    """Whether the server is draining; the graceful server sets it, every request checks it."""

    def __init__(self) -> None:
        self.draining = False
        self._event: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
            if self.draining:
                self._event.set()
        return self._event

    def begin_drain(self) -> None:
        self.draining = True
        self.event().set()


class _ClientGone(Exception):
    """The client disconnected while sending its body: there is nobody to answer."""


class RequestGuard:
    """ASGI middleware around the whole app (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: GuardLimits, lifecycle: Lifecycle) -> None:
        self.app = app
        self.limits = limits
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (scope.get("state") or {}).get(OVER_CAPACITY):
            await _refuse(send, APIError(503, "the server has too many open connections; retry later",
                                         code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        if self.lifecycle.draining:
            await _refuse(send, _shutting_down())
            return
        try:
            body = await self._read_body(scope, receive)
        except APIError as err:
            await _refuse(send, err)
            return
        except _ClientGone:
            return
        response = _ResponseTracker(send)
        try:
            await self.app(scope, _replay(body, receive), response.send)
        except asyncio.CancelledError:
            # The last resort of a shutdown: uvicorn cancels what is still running.
            await response.end_with(_shutting_down())
            raise
        except Exception as exc:
            if not response.started:
                logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await response.end_with(APIError(500, f"internal server error ({type(exc).__name__})",
                                             type="server_error"))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit, key = self.limits.max_body_bytes, "server.max_body_bytes"
        large = self.limits.large_body_paths_get(scope)
        if large is not None:
            limit, key = large
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit, key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_read_timeout_s
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await self._receive_in_time(receive, deadline - loop.time())
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, key)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _receive_in_time(self, receive: Receive, timeout: float) -> Message:
        """The next message, unless the body timeout passes (408) or the server starts draining
        (503) first: a slow upload must not hold a shutdown for its whole grace period."""
        incoming = asyncio.ensure_future(receive())
        draining = asyncio.ensure_future(self.lifecycle.event().wait())
        try:
            await asyncio.wait({incoming, draining}, timeout=max(timeout, 0.0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if incoming.done():
            return incoming.result()
        incoming.cancel()
        if self.lifecycle.draining:
            raise _shutting_down()
        raise APIError(408, f"the request body did not arrive within {self.limits.body_read_timeout_s:g}s "
                            "(server.body_read_timeout_s)", code="request_timeout")


class _ResponseTracker:
    """Passes messages on and remembers how far the response got."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def end_with(self, error: APIError) -> None:
        """Finish the response with ``error`` as well as its state allows."""
        try:
            if not self.started:
                await _refuse(self._send, error)
            elif self.event_stream and not self.complete:
                payload = (sse(error.body()) + SSE_DONE).encode()
                await self._send({"type": "http.response.body", "body": payload, "more_body": False})
        except Exception:  # the connection is gone: nothing more can be said
            pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then the connection's own messages (so the
    routes still see the client's disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, error: APIError) -> None:
    """``error`` as a complete JSON response that closes the connection."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def bearer_matches(key: str | None) -> Callable[[Scope], bool]:
    """A check that a request carries ``Authorization: Bearer <key>`` (always true without a key)."""
    def check(scope: Scope) -> bool:
        if key is None:
            return True
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    return check


def _too_large(limit: int, key: str) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         f"({key})", code="request_too_large")


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def shutting_down_error() -> APIError:
    """The error every request still open when the shutdown grace period ends receives."""
    return APIError(503, "the server is shutting down: the request did not finish within the grace "
                         "period (server.shutdown_timeout_s)", code="server_shutting_down")

