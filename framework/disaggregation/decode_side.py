"""The decode server's half of PD disaggregation, hooked into the scheduler.

Incoming requests skip the waiting queue. A FIFO *pre-allocation queue* reserves, for the request
at its head, a row of the ``decode_prealloc`` pool and KV pages for its whole prompt, as long as
free KV minus ``decode_reserved_tokens_per_request`` per running request covers it (so in-flight
transfers cannot starve running decodes); the destination pages are then posted to the prefill
server's bootstrap service. A *transfer queue* polls the backend; a request whose KV arrived joins
the running batch with the prefill server's first token, without any prefill here, as soon as the
pool's running cap lets its row ``activate``. A failed transfer frees the reservation (its pages
hold no valid KV, so they never reach the prefix cache) and the client gets the error at once;
pages the backend may still be writing (a late sender) stay *quarantined* until the backend is
quiescent for the room, so they cannot be handed to another request and overwritten.

Prefill servers come and go: this side registers its backend with a fresh ``pd_session`` id and
connects only once the prefill endpoint names that session as accepted (``pd_peer_session``). When
the link breaks, or the prefill endpoint's own ``pd_session`` changes (it restarted), transfers in
flight fail, a fresh backend is built and the next queued request reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx

from framework.disaggregation.addressing import pages_of_slots
from framework.disaggregation.base import TransferBackend, TransferState, TransferTask
from framework.disaggregation.bootstrap import BootstrapClient
from framework.disaggregation.common import build_backend, decode_first_token, room_of
from framework.errors import ConfigError
from framework.memory.request_pool import PreallocatingRequestPool
from framework.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002
CONNECT_RETRY_S = 0.05
"""How often a queued request retries reaching the bootstrap service (an HTTP call each)."""
PEER_CHECK_S = 1.0
LOOKUP_TIMEOUT_S = 0.25
"""Timeout of an endpoint lookup from the scheduler loop: a hung (e.g. stopped) prefill server must
not stall the running decodes for the client's full timeout."""
UNREACHABLE_RETRY_S = 0.5
"""Back-off after a failed lookup."""
"""How often, while requests queue, the prefill endpoint is re-read to notice a restarted peer
whose death the backend did not report."""


@dataclass
class _Incoming:
    req: Req
    room: int
    task: TransferTask
    aborted: str | None = None
    backend: TransferBackend | None = None
    """The backend that expects the room (set once its destination is posted)."""


@dataclass(eq=False)
class _Quarantined:
    """A failed room's reservation, kept until its backend stops writing it. Duck-types the
    fields of ``Req`` that ``KVManager.held_by`` reads, so the leak report counts it as held."""

    backend: TransferBackend
    room: int
    req_pool_idx: int
    kv_len: int
    indices: Any
    last_node: Any
    prefix_len: int = 0


class DecodeSide:
    """Pre-allocation queue, transfer queue and the receiver backend."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.pool = scheduler.runner.req_pool
        if not isinstance(self.pool, PreallocatingRequestPool):  # the config check refuses this first
            raise ConfigError(
                "disaggregation.mode=decode needs a pre-allocating request pool (registered with "
                f"Capabilities(preallocation=True)), not {scheduler.settings.memory_pool.name!r}"
            )
        self.backend = build_backend(scheduler.settings, "decode", scheduler.runner.kv_cache)
        self.session = uuid.uuid4().hex
        self.clients: dict[tuple[str, int], BootstrapClient] = {}
        self.connected_to: tuple[str, int] | None = None
        self.peer_session: str | None = None
        """The prefill endpoint's ``pd_session`` this side's link belongs to."""
        self.prealloc: deque[_Incoming] = deque()
        self.transferring: dict[int, _Incoming] = {}
        self.quarantine: list[_Quarantined] = []
        self._retired: list[threading.Thread] = []
        self._next_try = 0.0
        self._next_check = 0.0

    # -- the PDSide protocol (framework.scheduler.pd) ---------------------------------------

    def admit(self, req: Req) -> bool:
        """Take the request into the pre-allocation queue (it never enters the waiting queue)."""
        room = room_of(req)
        if req.bootstrap_host is None or req.bootstrap_port is None:
            raise ValueError("a request to a decode server needs bootstrap_host and bootstrap_port")
        self.prealloc.append(_Incoming(req, room, TransferTask(room)))
        return True

    def step(self) -> None:
        progressed = self._check_link()
        progressed |= self._connect()
        progressed |= self._preallocate()
        progressed |= self._release_quarantine()
        progressed |= self._poll()
        s = self.sched
        if not progressed and self.has_work() and not (s.waiting or s.running):
            time.sleep(IDLE_POLL_S)

    def _check_link(self) -> bool:
        """Drop a link whose prefill peer died, closed it or restarted (then reconnect lazily)."""
        if self.connected_to is None:
            return False
        err = self.backend.link_error()
        if err is None:
            now = time.monotonic()
            if not self.prealloc or now < self._next_check:
                return False
            self._next_check = now + PEER_CHECK_S
            try:
                peer = self.clients[self.connected_to].endpoints("prefill", LOOKUP_TIMEOUT_S).get(0)
            except httpx.HTTPError:
                return False  # down or busy: the backend or the timeouts will tell
            if peer is None or (peer.get("pd_session"), peer.get("pd_peer_session")) == (self.peer_session,
                                                                                          self.session):
                return False
            restarted = peer.get("pd_session") != self.peer_session
            err = "the prefill server restarted" if restarted else "the prefill server dropped this link"
        self._reset(f"the KV transfer link to the prefill server broke: {err}")
        return True

    def _reset(self, reason: str) -> None:
        """Fail the transfers on the current link and start a fresh backend with a new session."""
        old = self.backend
        logger.warning("%s; building a fresh %s link", reason, self.cfg.transfer_backend)
        for room, inc in self.transferring.items():
            if inc.backend is old:
                old.poll(room).fail(reason)
        self.backend = build_backend(self.sched.settings, "decode", self.sched.runner.kv_cache)
        self.session = uuid.uuid4().hex
        self.connected_to, self.peer_session = None, None
        # close() may wait for a worker blocked on the dead peer: not on the scheduler thread
        t = threading.Thread(target=old.close, name="pd-retire-backend", daemon=True)
        t.start()
        self._retired = [*(r for r in self._retired if r.is_alive()), t]

    def _connect(self) -> bool:
        """Join the prefill server of the oldest queued request (one peer per backend): register
        this session, then connect once the prefill side has built a link for it."""
        now = time.monotonic()
        if self.connected_to is not None or not self.prealloc or now < self._next_try:
            return False
        self._next_try = now + CONNECT_RETRY_S
        req = self.prealloc[0].req
        addr = (str(req.bootstrap_host), int(req.bootstrap_port))
        client = self.clients.setdefault(addr, BootstrapClient(*addr, timeout_s=2.0))
        try:
            peer = client.endpoints("prefill", LOOKUP_TIMEOUT_S).get(0)
            if peer is None:
                return False
            if peer.get("pd_peer_session") != self.session:
                client.register("decode", 0, {**self.backend.endpoint(), "pd_session": self.session})
                return False
        except httpx.HTTPError as exc:
            logger.debug("bootstrap %s:%d not reachable yet: %s", *addr, exc)
            self._next_try = now + UNREACHABLE_RETRY_S
            return False
        logger.info("linking to prefill session %s at %s:%d", peer.get("pd_session"), *addr)
        self.backend.connect(peer)
        self.connected_to, self.peer_session = addr, peer.get("pd_session")
        self._next_check = now + PEER_CHECK_S
        return True

    def _budget(self) -> int:
        reserve = self.cfg.decode_reserved_tokens_per_request * len(self.sched.running)
        return self.sched.kv.available_tokens() - reserve

    def _preallocate(self) -> bool:
        progressed = False
        kv = self.sched.kv
        while self.prealloc:
            inc = self.prealloc[0]
            if inc.task.check_timeout(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s) or inc.aborted:
                self.prealloc.popleft()
                self._fail(inc, inc.aborted or inc.task.error)
                progressed = True
                continue
            if self.connected_to is None:
                break
            req = inc.req
            if (str(req.bootstrap_host), int(req.bootstrap_port)) != self.connected_to:
                self.prealloc.popleft()
                self._fail(inc, "this decode server's transfer backend is linked to the prefill bootstrap at "
                                f"{self.connected_to[0]}:{self.connected_to[1]}, not {req.bootstrap_host}:"
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
            self.backend.expect(inc.room, dst_pages)
            inc.backend = self.backend
            try:
                self.clients[self.connected_to].post_room(inc.room, dst_pages)
            except httpx.HTTPError as exc:
                self._fail(inc, f"posting the destination to the bootstrap service failed: {exc}")
                continue
            inc.task = inc.backend.poll(inc.room)
            self.transferring[inc.room] = inc
            progressed = True
        return progressed

    def _poll(self) -> bool:
        progressed = False
        for room, inc in list(self.transferring.items()):
            task = inc.backend.poll(room) if inc.backend is not None else inc.task
            task.check_timeout(self.cfg.bootstrap_timeout_s, self.cfg.transfer_timeout_s)
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
        """The KV arrived: append the prefill server's first token and start decoding."""
        r = inc.req
        backend = inc.backend or self.backend
        meta = decode_first_token(backend.metadata(inc.room) or b"")
        backend.release(inc.room)
        r.output_ids.append(meta.token_id)
        r.first_token_time = time.monotonic()
        if r.return_logprob and meta.logprob is not None:
            r.output_logprobs.append(meta.logprob)
            if meta.top_logprobs is not None:
                r.output_top_logprobs.append(meta.top_logprobs)
            if meta.input_logprobs:
                r.input_logprobs = list(meta.input_logprobs)
                r.input_top_logprobs = list(meta.input_top_logprobs or [])
        self.sched.start_decoding(r)

    def _fail(self, inc: _Incoming, message: str | None) -> None:
        """Free the reservation without caching it (its pages hold no valid KV) and report; pages
        the backend may still write are quarantined instead of freed."""
        r, kv = inc.req, self.sched.kv
        if inc.backend is not None:
            inc.backend.release(inc.room)
        if r.req_pool_idx is not None:
            indices = r.kv_indices(kv.req_to_token).clone()
            if inc.backend is not None and not inc.backend.quiescent(inc.room):
                self.quarantine.append(
                    _Quarantined(inc.backend, inc.room, r.req_pool_idx, r.kv_len, indices, r.last_node))
            else:
                self._free(r.req_pool_idx, indices, r.last_node)
            r.req_pool_idx, r.last_node, r.kv_len = None, None, 0
        r.finished_reason = FinishReason("abort", message=message or "the KV transfer failed")
        logger.warning("request %s: %s", r.rid, r.finished_reason.message)
        self.sched.finish(r, error=r.finished_reason.message)

    def _free(self, row: int, indices: Any, last_node: Any) -> None:
        self.sched.kv.discard(row, indices, last_node)

    def _release_quarantine(self) -> bool:
        keep = [q for q in self.quarantine if not q.backend.quiescent(q.room)]
        if len(keep) == len(self.quarantine):
            return False
        for q in self.quarantine:
            if q not in keep:
                self._free(q.req_pool_idx, q.indices, q.last_node)
        self.quarantine = keep
        return True

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
        self.backend.close()
        for c in self.clients.values():
            c.close()
        for t in self._retired:
            t.join(timeout=5)
