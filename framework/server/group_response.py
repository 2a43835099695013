"""Turning a :class:`RequestGroup` into an HTTP response: a JSON body, or a stream of SSE events.

Both paths abort the group's unfinished requests (freeing their KV) when the client goes away,
and both surface an admission failure (400, 503) as a real status code: a stream waits for its
first event before it sends headers, so a refused request never becomes a 200 with an error
inside.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from framework.server.errors import APIError
from framework.server.http_utils import SSE_DONE, SSEResponse, sse, until_disconnect
from framework.server.tokenizer_manager import Event, RequestGroup, TokenizerManager

R = TypeVar("R")
Render = Callable[[Event], list[str]]
"""Turns one event into zero or more SSE strings."""
Tail = Callable[[], list[str]]
"""SSE strings sent after the last event, before ``[DONE]`` (a usage chunk)."""


async def wait_all(request: Request, manager: TokenizerManager, group: RequestGroup) -> None:
    """Until every request of the group finished; aborts the group if the client disconnects."""
    try:
        await until_disconnect(request, group.wait(), lambda: manager.close_group(group))
    finally:
        await manager.close_group(group)


async def released_on_error(manager: TokenizerManager, group: RequestGroup, respond: Awaitable[R]) -> R:
    """``await respond``; if building the response fails, the group is closed (its requests
    aborted, their KV freed, their ids released) before the error propagates."""
    try:
        return await respond
    except BaseException:
        await manager.close_group(group)
        raise


def request_errors(group: RequestGroup) -> None:
    """A request that the scheduler failed (KV exhausted, an internal error) fails the response.

    Requests aborted through /abort_request carry no error: they end with finish reason abort.
    """
    for state in group.states:
        if state.error is not None:
            raise APIError(503, f"the request failed: {state.error}", type="server_error", code="request_failed")


def stream_events(manager: TokenizerManager, group: RequestGroup, render: Render, tail: Tail) -> SSEResponse:
    """An SSE response of the group's events, ending with ``data: [DONE]``. It waits for the first
    event itself (:class:`SSEResponse`): a refused request still gets its status code."""

    async def body(first: Event) -> AsyncIterator[str]:
        event = first
        try:
            while True:
                for chunk in render(event):
                    yield chunk
                # Other requests of the group may have finished with events still queued.
                if group.finished and group.queue.empty():
                    break
                event = await group.next()
            request_errors(group)
            for chunk in tail():
                yield chunk
        except APIError as err:  # headers are gone: the error travels as an event, as in vLLM
            yield sse(err.body())
        yield SSE_DONE

    return SSEResponse(group.next, body, on_close=lambda: manager.close_group(group))
