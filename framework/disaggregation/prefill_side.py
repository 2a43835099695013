"""The prefill server's half of PD disaggregation, hooked into the scheduler.

The scheduler prefills requests as usual; instead of sampling them into the running batch it hands
them here (``on_prefilled``). Each request then waits for its decode server to post the
destination pages of its room to this server's bootstrap service, is sent (KV pages plus the
first token as metadata), and is finished here only once the transfer succeeded or failed: until
then its KV stays allocated, and the leak report counts it as held.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework.disaggregation.addressing import pages_of_slots
from framework.disaggregation.base import TransferState, TransferTask
from framework.disaggregation.bootstrap import BootstrapService
from framework.disaggregation.common import FirstToken, build_backend, encode_first_token, room_of
from framework.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002
"""Sleep of a step that only waits on transfers, so the scheduler loop does not spin a core."""


@dataclass
class _Outgoing:
    req: Req
    room: int
    meta: bytes
    task: TransferTask
    sent: bool = False
    aborted: str | None = None


class PrefillSide:
    """Bootstrap service + sender backend + the requests whose KV is on its way out."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.backend = build_backend(scheduler.settings, "prefill", scheduler.runner.kv_cache)
        self.service = BootstrapService(self.cfg.bootstrap_host, self.cfg.bootstrap_port).start()
        self.service.register("prefill", 0, self.backend.endpoint())
        self.connected = False
        self.outgoing: dict[int, _Outgoing] = {}

    # -- scheduler hooks -------------------------------------------------------------------

    def admit(self, req: Req) -> bool:
        """Check the request has a room; it then queues for prefill like any other (False)."""
        room_of(req)
        return False

    def on_prefilled(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample each request's first token; keep its KV until the transfer is final."""
        s = self.sched
        out = s._sample_tensors(logits, s._sampling_inputs(reqs))
        ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        for i, r in enumerate(reqs):
            meta = FirstToken(token_id=ids[i])
            if r.return_logprob and logprobs is not None:
                meta.logprob = logprobs[i]
                meta.top_logprobs = out.top_logprobs[i] if out.top_logprobs is not None else None
                meta.input_logprobs = list(r.input_logprobs) or None
                meta.input_top_logprobs = list(r.input_top_logprobs) if r.top_logprobs_num else None
            r.first_token_time = time.monotonic()
            room = room_of(r)
            state = TransferState.waiting_for_input if self.connected else TransferState.bootstrapping
            task = TransferTask(room, state)
            self.outgoing[room] = _Outgoing(r, room, encode_first_token(meta), task)
            r.output_ids.append(ids[i])  # reported to the client of this server when finished
            if meta.logprob is not None:
                r.output_logprobs.append(meta.logprob)

    def step(self) -> None:
        """Connect to the decode side, send rooms whose destination arrived, finish final ones."""
        if not self.connected:
            peer = self.service.endpoints("decode").get(0)
            if peer is not None:
                self.backend.connect(peer)
                self.connected = True
                for o in self.outgoing.values():
                    if o.task.state is TransferState.bootstrapping:
                        o.task.advance(TransferState.waiting_for_input)
        progressed = False
        for o in list(self.outgoing.values()):
            if not o.sent and o.aborted is None:
                progressed |= self._try_send(o)
            task = self.backend.poll(o.room) if o.sent else o.task
            task.check_timeout(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s)
            if task.state.final or (o.aborted is not None and not o.sent):
                self._complete(o, task)
                progressed = True
        if not progressed and self.outgoing and not (self.sched.waiting or self.sched.running):
            time.sleep(IDLE_POLL_S)

    def _try_send(self, o: _Outgoing) -> bool:
        if not self.connected:
            return False
        posted = self.service.take_room(o.room)
        if posted is None:
            return False
        dst_pages, _rank = posted
        src_pages = pages_of_slots(o.req.kv_indices(self.sched.kv.req_to_token).tolist(), self.sched.kv.page_size)
        if len(dst_pages) != len(src_pages):
            o.task.fail(f"room {o.room}: the decode side reserved {len(dst_pages)} pages, the prompt has "
                        f"{len(src_pages)}")
            return True
        self.backend.send(o.room, src_pages, dst_pages, o.meta)
        o.sent = True
        return True

    def _complete(self, o: _Outgoing, task: TransferTask) -> None:
        del self.outgoing[o.room]
        if o.sent:
            self.backend.release(o.room)
        r = o.req
        if o.aborted is not None:
            r.finished_reason = FinishReason("abort", message=o.aborted)
        elif task.state is TransferState.success:
            r.finished_reason = FinishReason("length")
        else:
            r.finished_reason = FinishReason("abort", message=task.error)
            logger.warning("request %s: %s", r.rid, task.error)
        self.sched._finish(r, error=r.finished_reason.message)

    def abort(self, req: Req, message: str) -> bool:
        """Abort a request waiting here; one whose pages are being read finishes once final."""
        room = getattr(req, "bootstrap_room", None)
        o = self.outgoing.get(room) if room is not None else None
        if o is None or o.req is not req:
            return False
        o.aborted = message
        if not o.sent:
            self._complete(o, o.task)
        return True

    # -- introspection ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.outgoing)

    def holders(self) -> list[Req]:
        return [o.req for o in self.outgoing.values()]

    def close(self) -> None:
        self.backend.close()
        self.service.close()
