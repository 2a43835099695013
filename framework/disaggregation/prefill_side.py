"""The prefill server's half of PD disaggregation, hooked into the scheduler.

The scheduler prefills requests as usual; instead of sampling them into the running batch it hands
them here (``on_prefilled``). Each request then waits for its decode server to post the
destination pages of its room to this server's bootstrap service, is sent (KV pages plus the
first token as metadata), and is finished here only once the transfer succeeded or failed: until
then its KV stays allocated, and the leak report counts it as held. A failed request whose pages
the backend may still be reading (a send that timed out but has not stopped) keeps its KV until
the backend is quiescent for its room, so no other request's KV goes out under its name.

Decode servers come and go: each decode backend registers with a fresh ``pd_session`` id. When a
new session registers, or the link breaks, this side fails the rooms in flight on the old link,
builds a fresh backend (a new link) and advertises, with its endpoint, the session it accepts
(``pd_peer_session``); a decode server connects only once it sees its own session there.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from framework.disaggregation.addressing import pages_of_slots
from framework.disaggregation.base import TransferBackend, TransferState, TransferTask
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
    backend: TransferBackend | None = None
    """The backend the room was sent on (it may since have been replaced by a fresh link)."""


class PrefillSide:
    """Bootstrap service + sender backend + the requests whose KV is on its way out."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.backend = build_backend(scheduler.settings, "prefill", scheduler.runner.kv_cache)
        self.service = BootstrapService(self.cfg.bootstrap_host, self.cfg.bootstrap_port).start()
        self.session = uuid.uuid4().hex
        """This server's identity in its endpoint: a decode server notices a restarted prefill."""
        self.peer_session: str | None = None
        """The decode backend session this side's link belongs to (None: never connected)."""
        self.connected = False
        self.outgoing: dict[int, _Outgoing] = {}
        self._dead_sessions: set[str] = set()
        """Decode sessions whose link broke: their registration may linger, never reconnect to it."""
        self._retired: list[threading.Thread] = []
        self._advertise()

    def _advertise(self) -> None:
        endpoint = {**self.backend.endpoint(), "pd_session": self.session, "pd_peer_session": self.peer_session}
        self.service.register("prefill", 0, endpoint)

    # -- the PDSide protocol (framework.scheduler.pd) ---------------------------------------

    def admit(self, req: Req) -> bool:
        """Check the request has a room; it then queues for prefill like any other (False)."""
        room_of(req)
        return False

    def on_prefilled(self, reqs: list[Req], logits: torch.Tensor) -> bool:
        """Sample each request's first token; keep its KV until the transfer is final (taken)."""
        out = self.sched.sample(reqs, logits)
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
        return True

    def _follow_decode(self) -> bool:
        """Drop a broken link; connect to a newly registered decode session."""
        err = self.backend.link_error() if self.connected else None
        if err is not None:
            self._reset(f"the KV transfer link to the decode server broke: {err}")
        peer = self.service.endpoints("decode").get(0)
        session = None if peer is None else peer.get("pd_session")
        if peer is None or session == self.peer_session or session in self._dead_sessions:
            return err is not None
        if self.connected:  # a decode server (re)started: the old link is dead
            self._reset("a decode server registered anew: the previous decode peer is gone")
        self.peer_session = session
        self._advertise()
        logger.info("linking to decode session %s", session)
        self.backend.connect(peer)
        self.connected = True
        for o in self.outgoing.values():
            if o.task.state is TransferState.bootstrapping:
                o.task.advance(TransferState.waiting_for_input)
        return True

    def _reset(self, reason: str) -> None:
        """Fail the rooms in flight on the current link and start a fresh backend."""
        old = self.backend
        logger.warning("%s; building a fresh %s link", reason, self.cfg.transfer_backend)
        for o in self.outgoing.values():
            if o.sent and o.backend is old:
                old.poll(o.room).fail(reason)
        self.service.clear_rooms()  # destinations posted by the old peer are no one's now
        self.backend = build_backend(self.sched.settings, "prefill", self.sched.runner.kv_cache)
        self.connected = False
        if self.peer_session is not None:  # a live decode re-registers under a new session
            self._dead_sessions.add(self.peer_session)
        self.peer_session = None
        self._advertise()
        # close() may wait for a worker blocked on the dead peer: not on the scheduler thread
        t = threading.Thread(target=old.close, name="pd-retire-backend", daemon=True)
        t.start()
        self._retired = [*(r for r in self._retired if r.is_alive()), t]

    def step(self) -> None:
        """Follow the decode side, send rooms whose destination arrived, finish final ones."""
        progressed = self._follow_decode()
        for o in list(self.outgoing.values()):
            if not o.sent and o.aborted is None:
                progressed |= self._try_send(o)
            task = o.backend.poll(o.room) if o.sent and o.backend is not None else o.task
            task.check_timeout(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s)
            if o.sent and o.backend is not None and task.state.final and not o.backend.quiescent(o.room):
                continue  # the sender still reads these pages: they stay this request's until it stops
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
        o.sent, o.backend = True, self.backend
        return True

    def _complete(self, o: _Outgoing, task: TransferTask) -> None:
        del self.outgoing[o.room]
        if o.backend is not None:
            o.backend.release(o.room)
        r = o.req
        if o.aborted is not None:
            r.finished_reason = FinishReason("abort", message=o.aborted)
        elif task.state is TransferState.success:
            r.finished_reason = FinishReason("length")
        else:
            r.finished_reason = FinishReason("abort", message=task.error)
            logger.warning("request %s: %s", r.rid, task.error)
        self.sched.finish(r, error=r.finished_reason.message)

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
        for t in self._retired:
            t.join(timeout=5)
