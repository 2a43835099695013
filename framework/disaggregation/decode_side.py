"""The decode server's half of PD disaggregation, hooked into the scheduler.

Incoming requests skip the waiting queue. A FIFO *pre-allocation queue* reserves, for the request
at its head, a row of the ``decode_prealloc`` pool and KV pages for its whole prompt, as long as
free KV minus ``decode_reserved_tokens_per_request`` per running request covers it (so in-flight
transfers cannot starve running decodes); the destination pages are then posted to the prefill
server's bootstrap service. A *transfer queue* polls the links; a request whose KV arrived joins
the running batch with the prefill server's first token, without any prefill here, as soon as the
pool's running cap lets its row ``activate``. A failed transfer frees the reservation (its pages
hold no valid KV, so they never reach the prefix cache) and the client gets the error at once;
pages a link may still be writing (a late sender) stay *quarantined* until every link is
quiescent for the room, so they cannot be handed to another request and overwritten.

Tensor parallelism: every rank runs this side and holds its own links, one per prefill rank whose
KV heads overlap its own (``framework.disaggregation.links``); the page numbers are the same on
every rank (the same scheduler), only the heads differ. Rank 0 talks to the bootstrap service;
the ranks agree each step on what happened (``framework.disaggregation.agreement``).

Prefill servers come and go: this side registers its ranks with a fresh ``pd_session`` id and
connects only once every prefill rank names that session as accepted (``pd_peer_session``). Linking
takes three agreed steps: *prepare* (the prefill side's TP size and heads are known: build the
links), *register* (rank 0 registers every rank's link endpoints), *connect*. When a link breaks,
or the prefill endpoint's ``pd_session`` changes (it restarted), transfers in flight fail, the
links are dropped and the next queued request links again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from framework.disaggregation.addressing import pages_of_slots
from framework.disaggregation.agreement import RankAgreement, merge_rooms
from framework.disaggregation.base import TransferState, TransferTask
from framework.disaggregation.common import build_backend, decode_first_token, rank_kv, room_of
from framework.disaggregation.decode_peer import PrefillPeer
from framework.disaggregation.heads import RankShard
from framework.disaggregation.links import RankLinks
from framework.errors import ConfigError
from framework.memory.request_pool import PreallocatingRequestPool
from framework.multimodal.inputs import MultimodalInputs
from framework.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002


@dataclass
class _Incoming:
    req: Req
    room: int
    task: TransferTask
    """The room's agreed state (the same on every rank)."""
    aborted: str | None = None
    links: RankLinks | None = None
    """The links that expect the room (set once its destination is posted)."""


@dataclass(eq=False)
class _Quarantined:
    """A failed room's reservation, kept until its links stop writing it. Duck-types the fields
    of ``Req`` that ``KVManager.held_by`` reads, so the leak report counts it as held."""

    links: RankLinks
    room: int
    req_pool_idx: int
    kv_len: int
    indices: Any
    last_node: Any
    prefix_len: int = 0


class DecodeSide:
    """Pre-allocation queue, transfer queue and this rank's receiving links."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.pool = scheduler.runner.req_pool
        if not isinstance(self.pool, PreallocatingRequestPool):  # the config check refuses this first
            raise ConfigError(
                "disaggregation.mode=decode needs a pre-allocating request pool (registered with "
                f"Capabilities(preallocation=True)), not {scheduler.settings.memory_pool.name!r}"
            )
        self.layout, self.shard = rank_kv(scheduler)
        self.agree = RankAgreement()
        self.peer = PrefillPeer(self.layout.identity, self.shard) if self.agree.leader else None
        """Rank 0's view of the prefill bootstrap service (the only rank that talks to it)."""
        self.links: RankLinks | None = None
        self.linked_to: tuple[str, int] | None = None
        """The prefill bootstrap the links were built for (prepared, maybe not yet connected)."""
        self.connected = False
        self._advertised = False
        self._link_failure: str | None = None
        self.prealloc: deque[_Incoming] = deque()
        self.transferring: dict[int, _Incoming] = {}
        self.quarantine: list[_Quarantined] = []
        self._retired: list[threading.Thread] = []

    # -- the PDSide protocol (framework.scheduler.pd) ---------------------------------------

    def admit(self, req: Req) -> bool:
        """Take the request into the pre-allocation queue (it never enters the waiting queue)."""
        room = room_of(req)
        if req.bootstrap_host is None or req.bootstrap_port is None:
            raise ValueError("a request to a decode server needs bootstrap_host and bootstrap_port")
        self.prealloc.append(_Incoming(req, room, TransferTask(room)))
        return True

    def step(self) -> None:
        decision = self.agree.exchange(self._report(), self._decide)
        progressed = self._apply(decision)
        progressed |= self._preallocate()
        progressed |= self._poll()
        s = self.sched
        if not progressed and self.has_work() and not (s.waiting or s.running):
            time.sleep(IDLE_POLL_S)

    # -- report, decide (rank 0), apply ------------------------------------------------------

    def _report(self) -> dict[str, Any]:
        rooms = {}
        for inc in self.transferring.values():
            if inc.links is not None:
                state, error = inc.links.status(inc.room)
                rooms[inc.room] = [state.value, error, inc.links.quiescent(inc.room)]
        quarantine = {q.room: [TransferState.failed.value, None, q.links.quiescent(q.room)] for q in self.quarantine}
        error = self._link_failure or (self.links.link_error() if self.links is not None else None)
        links = self.links.endpoints() if self.links is not None and not self._advertised else None
        return {"rooms": rooms, "quarantine": {"rooms": quarantine}, "link_error": error, "links": links}

    def _decide(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.peer is not None
        d: dict[str, Any] = {"rooms": merge_rooms(reports), "fail": self.peer.take_post_errors(),
                             "quiescent": [room for room, (_s, _e, q) in
                                           merge_rooms([r["quarantine"] for r in reports]).items() if q]}
        errors = [r["link_error"] for r in reports if r["link_error"]]
        head = self.prealloc[0].req if self.prealloc else None
        head_addr = None if head is None else (str(head.bootstrap_host), int(head.bootstrap_port))
        if errors:
            d["reset"] = f"the KV transfer link to the prefill server broke: {errors[0]}"
        elif self.connected:
            why = self.peer.check_alive(bool(self.prealloc))
            if why is not None:
                d["reset"] = f"the KV transfer link to the prefill server broke: {why}"
        elif head_addr is not None:
            endpoints = [r["links"] for r in reports]
            rooms = [inc.room for inc in self.prealloc
                     if (str(inc.req.bootstrap_host), int(inc.req.bootstrap_port)) == head_addr]
            d.update(self.peer.link_step(head_addr, self.linked_to, self._advertised, endpoints, rooms))
        for inc in [*self.prealloc, *self.transferring.values()]:
            overdue = inc.task.overdue(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s)
            if overdue is not None:
                d["fail"][inc.room] = overdue
        return d

    def _apply(self, d: dict[str, Any]) -> bool:
        progressed = bool(d["fail"] or d["quiescent"])
        if "reset" in d:
            self._reset(d["reset"])
            progressed = True
        if "refuse" in d:
            self._refuse(d["refuse"]["addr"], d["refuse"]["error"])
            progressed = True
        if "prepare" in d:
            self._prepare(tuple(d["prepare"]["addr"]), d["prepare"]["peers"])
            progressed = True
        self._advertised |= bool(d.get("advertised"))
        if "connect" in d and self.links is not None:
            self._connect(d["connect"])
            progressed = True
        for room, (state, error, _q) in d["rooms"].items():
            inc = self.transferring.get(room)
            if inc is not None:
                inc.task.follow(TransferState(state), error)
        for inc in [*self.prealloc, *self.transferring.values()]:
            if inc.room in d["fail"]:
                inc.task.fail(d["fail"][inc.room])
        self._release_quarantine(set(d["quiescent"]))
        return progressed

    def _prepare(self, addr: tuple[str, int], peers: list[dict[str, Any]]) -> None:
        """Build this rank's links for the prefill side's ranks (connected once they accept)."""
        if self.links is not None:
            self._reset("linking to another prefill server")
        self.linked_to, self._advertised, self.connected = addr, False, False
        shards = [RankShard.from_json(p) for p in peers]
        try:
            self.links = RankLinks("decode", self.layout, self.shard, shards, self._make)
        except Exception as exc:  # every rank must hear of it: reported, then reset on all ranks
            logger.error("building the links to the prefill server failed: %s", exc)
            self._link_failure = f"linking failed on decode rank {self.shard.tp_rank}: {exc}"

    def _make(self, layout: Any) -> Any:
        return build_backend(self.sched.settings, "decode", self.sched.runner.kv_cache, layout)

    def _connect(self, peers: dict[Any, dict[str, Any]]) -> None:
        assert self.links is not None
        me = str(self.shard.tp_rank)
        try:
            self.links.connect({int(p): links[me] for p, links in peers.items() if me in links})
        except Exception as exc:
            logger.error("connecting to the prefill server failed: %s", exc)
            self._link_failure = f"connecting failed on decode rank {self.shard.tp_rank}: {exc}"
            return
        self.connected = True
        logger.info("linked to the prefill bootstrap at %s:%d", *(self.linked_to or ("?", 0)))

    def _reset(self, reason: str) -> None:
        """Fail the transfers on the current links and drop them (the next request relinks)."""
        old = self.links
        logger.warning("%s; dropping the %s links", reason, self.cfg.transfer_backend)
        for inc in self.transferring.values():
            if inc.links is old:
                inc.task.fail(reason)
        self.links, self.linked_to, self.connected, self._advertised = None, None, False, False
        self._link_failure = None
        if self.peer is not None:
            self.peer.new_session()
        if old is not None:  # close() may wait for a worker blocked on the dead peer
            t = threading.Thread(target=old.close, name="pd-retire-links", daemon=True)
            t.start()
            self._retired = [*(r for r in self._retired if r.is_alive()), t]

    def _refuse(self, addr: list[Any], error: str) -> None:
        """Fail every queued request for the prefill bootstrap at ``addr`` (it cannot serve them)."""
        for inc in list(self.prealloc):
            if [str(inc.req.bootstrap_host), int(inc.req.bootstrap_port)] == list(addr):
                self.prealloc.remove(inc)
                self._fail(inc, error)

    # -- queues ----------------------------------------------------------------------------

    def _budget(self) -> int:
        reserve = self.cfg.decode_reserved_tokens_per_request * len(self.sched.running)
        return self.sched.kv.available_tokens() - reserve

    def _preallocate(self) -> bool:
        progressed = False
        kv = self.sched.kv
        while self.prealloc:
            inc = self.prealloc[0]
            if inc.task.state.final or inc.aborted:
                self.prealloc.popleft()
                self._fail(inc, inc.aborted or inc.task.error)
                progressed = True
                continue
            if not self.connected or self.linked_to is None:
                break
            req = inc.req
            if (str(req.bootstrap_host), int(req.bootstrap_port)) != self.linked_to:
                self.prealloc.popleft()
                self._fail(inc, "this decode server's transfer backend is linked to the prefill bootstrap at "
                                f"{self.linked_to[0]}:{self.linked_to[1]}, not {req.bootstrap_host}:"
                                f"{req.bootstrap_port}")
                progressed = True
                continue
            need = -(-len(req.input_ids) // kv.page_size) * kv.page_size
            if need > self._budget() or self.pool.available_size() == 0:
                break  # FIFO: later requests wait behind the head
            slots = kv.reserve(req)
            if slots is None:  # cannot happen after the budget check
                break
            self.prealloc.popleft()
            dst_pages = pages_of_slots(slots.tolist(), kv.page_size)
            assert self.links is not None
            self.links.expect(inc.room, dst_pages)
            inc.links = self.links
            if self.peer is not None:  # a failed post fails the room on every rank at the next step
                self.peer.post_room(self.linked_to, inc.room, dst_pages)
            inc.task.follow(TransferState.waiting_for_input)
            self.transferring[inc.room] = inc
            progressed = True
        return progressed

    def _poll(self) -> bool:
        progressed = False
        for room, inc in list(self.transferring.items()):
            task = inc.task
            if inc.aborted is not None and task.state is not TransferState.transferring:
                del self.transferring[room]
                self._fail(inc, inc.aborted)
            elif task.state is TransferState.failed:
                del self.transferring[room]
                self._fail(inc, task.error)
            elif task.state is TransferState.success and self.pool.activate(inc.req.req_pool_idx):
                del self.transferring[room]
                self._join(inc)
            else:
                continue
            progressed = True
        return progressed

    def _join(self, inc: _Incoming) -> None:
        """The KV arrived on every rank: append the prefill server's first token and decode."""
        r = inc.req
        assert inc.links is not None
        meta = decode_first_token(inc.links.metadata(inc.room) or b"")
        inc.links.release(inc.room)
        r.output_ids.append(meta.token_id)
        r.first_token_time = time.monotonic()
        if meta.mrope_position_delta is not None:  # the prefill side's, with the KV its encoder made
            r.mm_inputs = replace(r.mm_inputs or MultimodalInputs(), mrope_position_delta=meta.mrope_position_delta)
        if r.return_logprob and meta.logprob is not None:
            r.output_logprobs.append(meta.logprob)
            if meta.top_logprobs is not None:
                r.output_top_logprobs.append(meta.top_logprobs)
            if meta.input_logprobs:
                r.input_logprobs = list(meta.input_logprobs)
                r.input_top_logprobs = list(meta.input_top_logprobs or [])
        self.sched.start_decoding(r)

    def _fail(self, inc: _Incoming, message: str | None) -> None:
        """Release the room and report; its reservation (its pages hold no valid KV, so they never
        reach the prefix cache) is quarantined until the ranks agree every link is quiescent."""
        r, kv = inc.req, self.sched.kv
        if inc.links is not None:
            inc.links.release(inc.room)
        if r.req_pool_idx is not None:
            indices = r.kv_indices(kv.req_to_token).clone()
            if inc.links is not None and (self.agree.size > 1 or not inc.links.quiescent(inc.room)):
                # several ranks: only an agreed "quiescent" may free it (each rank sees its own links)
                self.quarantine.append(
                    _Quarantined(inc.links, inc.room, r.req_pool_idx, r.kv_len, indices, r.last_node))
            else:
                kv.discard(r.req_pool_idx, indices, r.last_node)
            r.req_pool_idx, r.last_node, r.kv_len = None, None, 0
        r.finished_reason = FinishReason("abort", message=message or "the KV transfer failed")
        logger.warning("request %s: %s", r.rid, r.finished_reason.message)
        self.sched.finish(r, error=r.finished_reason.message)

    def _release_quarantine(self, quiescent: set[int]) -> None:
        """Free the quarantined reservations every rank reported quiescent."""
        keep = []
        for q in self.quarantine:
            if q.room in quiescent:
                self.sched.kv.discard(q.req_pool_idx, q.indices, q.last_node)
            else:
                keep.append(q)
        self.quarantine = keep

    def abort(self, req: Req, message: str) -> bool:
        for inc in [*self.prealloc, *self.transferring.values()]:
            if inc.req is req:
                inc.aborted = message
                if inc in self.prealloc:
                    self.prealloc.remove(inc)
                    self._fail(inc, message)
                return True
        return False

    # -- introspection ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.quarantine)

    def holders(self) -> list[Any]:
        return [*(inc.req for inc in self.transferring.values()), *self.quarantine]

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        if self.peer is not None:
            self.peer.close()
        for t in self._retired:
            t.join(timeout=5)

