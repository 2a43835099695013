"""The prefill server's half of PD disaggregation, hooked into the scheduler.

The scheduler prefills requests as usual; instead of sampling them into the running batch it hands
them here (``on_prefilled``). Each request then waits for its decode server to post the
destination pages of its room to this server's bootstrap service, is sent (KV pages plus the
first token as metadata), and is finished here only once the transfer succeeded or failed: until
then its KV stays allocated, and the leak report counts it as held. A failed request whose pages
the backend may still be reading (a send that timed out but has not stopped) keeps its KV until
the backend is quiescent for its room, so no other request's KV goes out under its name.

Tensor parallelism: every rank runs this side. Rank 0 hosts the bootstrap service and registers
every rank (TP rank, size, KV heads, model identity, its links' endpoints). Each rank sends its
own heads to the decode ranks that need them (``framework.disaggregation.links``); the ranks agree
each step on what happened (``framework.disaggregation.agreement``), so a room finishes, fails or
is sent on every rank in the same step.

Decode servers come and go: each decode server registers with a fresh ``pd_session`` id. When a
new session registers (all its ranks), or a link breaks, this side fails the rooms in flight on
the old links, builds fresh links for the new peer and advertises, with its endpoints, the session
it accepts (``pd_peer_session``); a decode server connects only once it sees its own session there.
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
from framework.disaggregation.agreement import RankAgreement, merge_rooms
from framework.disaggregation.base import TransferState, TransferTask
from framework.disaggregation.bootstrap import BootstrapService
from framework.disaggregation.common import (
    FirstToken,
    build_backend,
    encode_first_token,
    rank_kv,
    registration,
    room_of,
)
from framework.disaggregation.heads import ModelIdentity, RankShard, all_shards
from framework.disaggregation.links import RankLinks
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
    """The room's agreed state (the same on every rank)."""
    sent: bool = False
    aborted: str | None = None
    links: RankLinks | None = None
    """The links the room was sent on (they may since have been replaced)."""
    released: bool = False
    """Released on its links after it went final; it completes once they are quiescent."""


class PrefillSide:
    """Bootstrap service (rank 0) + this rank's links + the requests whose KV is on its way out."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.layout, self.shard = rank_kv(scheduler)
        self.agree = RankAgreement()
        self.service = (BootstrapService(self.cfg.bootstrap_host, self.cfg.bootstrap_port).start()
                        if self.agree.leader else None)
        self.session = uuid.uuid4().hex
        """This server's identity in its endpoints (rank 0's): a decode server notices a restart."""
        self.peer_session: str | None = None
        """The decode session this side's links belong to (None: not linked)."""
        self.links: RankLinks | None = None
        self.outgoing: dict[int, _Outgoing] = {}
        self._advertised = False
        self._link_failure: str | None = None
        self._dead_sessions: set[str] = set()
        """Decode sessions whose link broke: their registration may linger, never relink to it."""
        self._retired: list[threading.Thread] = []
        self._advertise()

    @property
    def identity(self) -> ModelIdentity:
        assert self.layout.identity is not None
        return self.layout.identity

    def _advertise(self, links: list[dict[str, Any]] | None = None) -> None:
        """Rank 0: register every rank (with its links' endpoints once they exist)."""
        if self.service is None:
            return
        for shard in all_shards(self.identity.num_kv_heads, self.shard.tp_size):
            eps = links[shard.tp_rank] if links else {}
            self.service.register("prefill", shard.tp_rank,
                                  registration(shard, self.identity, self.session, self.peer_session, eps))

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
            if r.mm_inputs is not None:
                meta.mrope_position_delta = r.mm_inputs.mrope_position_delta
            if r.return_logprob and logprobs is not None:
                meta.logprob = logprobs[i]
                meta.top_logprobs = out.top_logprobs[i] if out.top_logprobs is not None else None
                meta.input_logprobs = list(r.input_logprobs) or None
                meta.input_top_logprobs = list(r.input_top_logprobs) if r.top_logprobs_num else None
            r.first_token_time = time.monotonic()
            room = room_of(r)
            state = TransferState.waiting_for_input if self.links is not None else TransferState.bootstrapping
            self.outgoing[room] = _Outgoing(r, room, encode_first_token(meta), TransferTask(room, state))
            r.output_ids.append(ids[i])  # reported to the client of this server when finished
            if meta.logprob is not None:
                r.output_logprobs.append(meta.logprob)
        return True

    # -- one step: report, agree, apply ------------------------------------------------------

    def step(self) -> None:
        """Agree with the other ranks on what happened, then link, send and finish alike."""
        decision = self.agree.exchange(self._report(), self._decide)
        progressed = self._apply(decision)
        if not progressed and self.outgoing and not (self.sched.waiting or self.sched.running):
            time.sleep(IDLE_POLL_S)

    def _report(self) -> dict[str, Any]:
        rooms = {}
        for o in self.outgoing.values():
            if o.sent and o.links is not None:
                state, error = o.links.status(o.room) if not o.released else (TransferState.failed, None)
                rooms[o.room] = [state.value, error, o.links.quiescent(o.room)]
        error = self._link_failure or (self.links.link_error() if self.links is not None else None)
        links = self.links.endpoints() if self.links is not None and not self._advertised else None
        return {"rooms": rooms, "link_error": error, "links": links}

    def _decide(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: fold the ranks' reports, the bootstrap service and its clock into one decision."""
        assert self.service is not None
        d: dict[str, Any] = {"rooms": merge_rooms(reports), "fail": {}, "send": {}}
        errors = [r["link_error"] for r in reports if r["link_error"]]
        if errors:
            d["reset"] = f"the KV transfer link to the decode server broke: {errors[0]}"
        elif self.links is not None and not self._advertised and all(r["links"] is not None for r in reports):
            self._advertise([r["links"] for r in reports])
            d["advertised"] = True
        if "reset" not in d:
            link = self._new_decode_session()
            if link is not None:
                d["link"] = link
        linked = self.links is not None and "reset" not in d and "link" not in d
        for o in self.outgoing.values():
            if not o.sent and o.aborted is None:
                error = self.service.take_error(o.room)  # e.g. a decode server of another model
                posted = self.service.take_room(o.room) if linked else None
                if error is not None:
                    d["fail"][o.room] = f"the decode server gave up room {o.room}: {error}"
                elif posted is not None:
                    d["send"][o.room] = posted[0]
            overdue = o.task.overdue(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s)
            if overdue is not None:
                d["fail"][o.room] = overdue
        return d

    def _new_decode_session(self) -> dict[str, Any] | None:
        """A decode server whose every rank registered under a session not linked yet."""
        assert self.service is not None
        eps = self.service.endpoints("decode")
        first = eps.get(0)
        if first is None or "shard" not in first:
            return None
        session, size = first.get("pd_session"), int(first["shard"]["tp_size"])
        if session == self.peer_session or session in self._dead_sessions:
            return None
        if any(eps.get(r, {}).get("pd_session") != session for r in range(size)):
            return None  # its other ranks are still registering
        return {"session": session, "peers": [{"shard": eps[r]["shard"], "links": eps[r]["links"]}
                                              for r in range(size)]}

    def _apply(self, d: dict[str, Any]) -> bool:
        progressed = False
        if "reset" in d:
            self._reset(d["reset"])
            progressed = True
        if "link" in d:
            self._link(d["link"])
            progressed = True
        self._advertised |= bool(d.get("advertised"))
        for room, (state, error, quiescent) in d["rooms"].items():
            o = self.outgoing.get(room)
            if o is not None:
                o.task.follow(TransferState(state), error)
                if o.released and quiescent:
                    self._complete(o)
                    progressed = True
        for room, error in d["fail"].items():
            if room in self.outgoing:
                self.outgoing[room].task.fail(error)
        for room, dst_pages in d["send"].items():
            if room in self.outgoing:
                self._send(self.outgoing[room], dst_pages)
                progressed = True
        for o in list(self.outgoing.values()):
            if not o.sent and (o.task.state.final or o.aborted is not None):
                self._complete(o)
                progressed = True
            elif o.sent and o.task.state.final and not o.released and o.links is not None:
                o.links.release(o.room)  # queued work for it is skipped; it completes once quiescent
                o.released = True
                if self.agree.size == 1 and o.links.quiescent(o.room):
                    self._complete(o)  # one rank: its own links are the whole truth
        return progressed

    def _link(self, link: dict[str, Any]) -> None:
        """Build this rank's links to the decode ranks that need its heads, and connect them."""
        if self.links is not None:  # a decode server (re)started: the old links are dead
            self._reset("a decode server registered anew: the previous decode peer is gone")
        self.peer_session, self._advertised = link["session"], False
        peers = [RankShard.from_json(p["shard"]) for p in link["peers"]]
        me = str(self.shard.tp_rank)
        logger.info("linking to decode session %s (%d ranks)", link["session"], len(peers))
        try:
            self.links = RankLinks("prefill", self.layout, self.shard, peers, self._make)
            self.links.connect({p.tp_rank: link["peers"][p.tp_rank]["links"][me]
                                for p in peers if me in link["peers"][p.tp_rank]["links"]})
        except Exception as exc:  # every rank must hear of it: reported, then reset on all ranks
            logger.error("linking to the decode server failed: %s", exc)
            self._link_failure = f"linking failed on prefill rank {self.shard.tp_rank}: {exc}"
            return
        for o in self.outgoing.values():
            if o.task.state is TransferState.bootstrapping:
                o.task.advance(TransferState.waiting_for_input)

    def _make(self, layout: Any) -> Any:
        return build_backend(self.sched.settings, "prefill", self.sched.runner.kv_cache, layout)

    def _reset(self, reason: str) -> None:
        """Fail the rooms in flight on the current links and drop them (a new peer relinks)."""
        old = self.links
        logger.warning("%s; dropping the %s links", reason, self.cfg.transfer_backend)
        for o in self.outgoing.values():
            if o.sent and o.links is old:
                o.task.fail(reason)
        if self.service is not None:
            self.service.clear_rooms()  # destinations posted by the old peer are no one's now
        if self.peer_session is not None:  # a live decode server re-registers under a new session
            self._dead_sessions.add(self.peer_session)
        self.links, self.peer_session, self._advertised, self._link_failure = None, None, False, None
        self._advertise()
        if old is not None:  # close() may wait for a worker blocked on the dead peer
            t = threading.Thread(target=old.close, name="pd-retire-links", daemon=True)
            t.start()
            self._retired = [*(r for r in self._retired if r.is_alive()), t]

    def _send(self, o: _Outgoing, dst_pages: list[int]) -> None:
        src_pages = pages_of_slots(o.req.kv_indices(self.sched.kv.req_to_token).tolist(), self.sched.kv.page_size)
        if len(dst_pages) != len(src_pages):
            o.task.fail(f"room {o.room}: the decode side reserved {len(dst_pages)} pages, the prompt has "
                        f"{len(src_pages)}")
            return
        assert self.links is not None
        self.links.send(o.room, src_pages, list(dst_pages), o.meta)
        o.sent, o.links = True, self.links
        o.task.follow(TransferState.transferring)

    def _complete(self, o: _Outgoing) -> None:
        del self.outgoing[o.room]
        r, task = o.req, o.task
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
            self._complete(o)
        return True

    # -- introspection ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.outgoing)

    def holders(self) -> list[Req]:
        return [o.req for o in self.outgoing.values()]

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        if self.service is not None:
            self.service.close()
        for t in self._retired:
            t.join(timeout=5)

