"""The scheduler requests of one HTTP request, as the HTTP process tracks them.

A :class:`SubRequest` is one scheduler request (n == 1); a :class:`RequestGroup` holds all of an
HTTP request's (a batch, ``n`` choices), the data-parallel replica they run on, and the one queue
their :class:`Event` s arrive on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.engine.request_state import RequestState
from framework.sampling.params import SamplingParams
from framework.server import ipc
from framework.server.errors import APIError


@dataclass
class SubRequest:
    """One scheduler request (n == 1) of an HTTP request."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int | None = None
    token_ids_logprob: list[int] | None = None
    """SGLang's ``token_ids_logprob``: report these ids' logprobs at every output position."""
    mm_inputs: dict[str, Any] | None = None
    """A multimodal prompt's images and positions, ready for the wire (shared by ``n`` choices)."""

    def to_ipc(self) -> ipc.GenerateReq:
        return ipc.GenerateReq(
            rid=self.rid, input_ids=self.input_ids, sampling_params=self.params.to_dict(),
            return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
            logprob_start_len=self.logprob_start_len, bootstrap_host=self.bootstrap_host,
            bootstrap_port=self.bootstrap_port, bootstrap_room=self.bootstrap_room,
            priority=self.priority, token_ids_logprob=self.token_ids_logprob, mm_inputs=self.mm_inputs,
        )


@dataclass
class Event:
    """Request ``index`` of a group advanced: ``delta`` is its new text."""

    index: int
    delta: str
    finished: bool


class RequestGroup:
    """The scheduler requests of one HTTP request; their events arrive on one queue."""

    def __init__(self, rid: str, subs: list[SubRequest], states: list[RequestState], dp_rank: int = 0) -> None:
        self.rid = rid
        self.dp_rank = dp_rank
        """The data-parallel replica that runs every request of the group."""
        self.rids = [s.rid for s in subs]
        self.states = states
        self.queue: asyncio.Queue[Event | APIError] = asyncio.Queue()
        self.error: APIError | None = None
        self.closed = False
        self._on_drained: list[Callable[[], None]] = []

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.states)

    def fail(self, error: APIError) -> None:
        if self.error is None:
            self.error = error
            self.queue.put_nowait(error)
        self.end_waits()

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the response has consumed every event queued so far and asks
        for the next one (a stream asks only after it wrote the previous chunks to the client),
        or when the group ends (:meth:`end_waits`), whichever is first."""
        if self.closed or self.error is not None:
            callback()
        else:
            self._on_drained.append(callback)

    def end_waits(self) -> None:
        """Run the :meth:`when_drained` callbacks now: the group ended, nothing more will be sent."""
        callbacks, self._on_drained = self._on_drained, []
        for callback in callbacks:
            callback()

    async def next(self) -> Event:
        """The next event; raises the group's :class:`APIError` if it failed."""
        if self._on_drained and self.queue.empty():
            self.end_waits()
        item = await self.queue.get()
        if isinstance(item, APIError):
            self.queue.put_nowait(item)  # every later call fails the same way
            raise item
        return item

    async def wait(self) -> None:
        """Until every request finished (raises on failure)."""
        while not self.finished:
            await self.next()
        if self.error is not None:
            raise self.error
