"""Request plumbing shared by the routes: body limit, JSON parsing, auth, SSE, disconnects."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from framework.server.errors import APIError, bad_request, from_validation_error
from framework.server.json_body import parse_json_body

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

LOGPROB_FLOOR = -9999.0
"""JSON has no -Infinity: a logprob of -inf (a token with zero probability) is sent as this,
the value vLLM uses for the same purpose."""


# -- bodies --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BodyLimits:
    """Size and nesting limits of a JSON body (``server.max_body_bytes``, ``server.max_json_depth``)."""

    max_bytes: int
    max_depth: int


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes before reading it all.

    Behind :class:`~framework.server.request_guard.RequestGuard` the body is already buffered and
    within the server's limit; a route may still ask for a lower one."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``*/*+json``). A request
    with no Content-Type is read as JSON, as FastAPI (vLLM's server) reads it."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return
    raise APIError(415, f"Content-Type must be application/json, got {declared!r}",
                   code="unsupported_media_type")


async def parse_model(request: Request, model: type[M], limits: BodyLimits) -> M:
    """Read, parse and validate a JSON body into ``model`` (400 with the offending field)."""
    check_json_content_type(request)
    body = await read_body(request, limits.max_bytes)
    data = parse_json_body(body, limits.max_depth)
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# -- auth ----------------------------------------------------------------------------------------


def require_bearer(request: Request, key: str | None) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (no-op when key is None)."""
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # compare_digest: the time taken must not reveal how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


# -- JSON helpers --------------------------------------------------------------------------------


def finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else LOGPROB_FLOOR


_SSE_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
"""One encoder for every event: ``json.dumps`` with non-default options builds a new one per call."""


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {_SSE_JSON.encode(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# -- streaming and disconnects -------------------------------------------------------------------


class SSEResponse(StreamingResponse):
    """A text/event-stream response that starts once its first event is there, and always runs
    ``on_close`` when it ends.

    The handler returns it right after submitting the request, so the ASGI app's return path
    (routing, middleware, this object's tasks) runs while the model computes, not between the
    first token's arrival and its chunk: the response itself waits for ``first_event()``. If that
    raises :class:`APIError` (the scheduler refused the request) the client gets that error's
    status code and JSON body instead of a stream: nothing was sent yet. The body runs next to a
    task that listens for the client's disconnect, whatever ASGI spec version the server speaks,
    so a client that goes away, before or during the stream, cancels it at once; ``on_close``
    (which aborts unfinished requests and frees their KV) runs on every path out.
    """

    def __init__(self, first_event: Callable[[], Awaitable[Any]], body: Callable[[Any], AsyncIterator[str]],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(_no_body(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.first_event = first_event
        self.body_from = body
        """The stream's chunks from its first event on (not ``body``: Starlette's bytes attribute)."""
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def respond() -> None:
                    try:
                        first = await self.first_event()
                    except APIError as err:  # refused before anything was sent: a real status code
                        await err.response()(scope, receive, send)
                        tg.cancel_scope.cancel()
                        return
                    self.body_iterator = self.body_from(first)
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection broke while sending
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(respond)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


async def _no_body() -> AsyncIterator[str]:
    """The placeholder body of an :class:`SSEResponse` until its first event is there."""
    return
    yield  # an async generator that yields nothing


async def until_disconnect(request: Request, work: Awaitable[T], on_disconnect: Callable[[], Awaitable[None]]) -> T:
    """Await ``work``; if the client disconnects first, cancel it, run ``on_disconnect`` and
    raise :class:`APIError` (the response goes nowhere, but the handler must end)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server shutdown)
        task.cancel()
        await on_disconnect()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await on_disconnect()
    raise APIError(499, "the client closed the connection", type="invalid_request_error")
