"""The decode server's half of PD disaggregation, hooked into the scheduler.

Incoming requests skip the waiting queue. A FIFO *pre-allocation queue* reserves, for the request
at its head, a row of the ``decode_prealloc`` pool and KV pages for its whole prompt, as long as
free KV minus ``decode_reserved_tokens_per_request`` per running request covers it (so in-flight
transfers cannot starve running decodes); the destination pages are then posted to the prefill
server's bootstrap service. A *transfer queue* polls the backend; a request whose KV arrived joins
the running batch with the prefill server's first token, without any prefill here, as soon as the
pool's running cap lets its row ``activate``. A failed transfer frees the reservation (its pages
hold no valid KV, so they never reach the prefix cache) and the client gets the error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx

from framework.disaggregation.addressing import pages_of_slots
from framework.disaggregation.base import TransferState, TransferTask
from framework.disaggregation.bootstrap import BootstrapClient
from framework.disaggregation.common import build_backend, decode_first_token, room_of
from framework.errors import ConfigError
from framework.scheduler.finish import check_finished
from framework.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002


@dataclass
class _Incoming:
    req: Req
    room: int
    task: TransferTask
    aborted: str | None = None


class DecodeSide:
    """Pre-allocation queue, transfer queue and the receiver backend."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.cfg = scheduler.settings.disaggregation
        self.pool = scheduler.runner.req_pool
        if not hasattr(self.pool, "activate"):
            raise ConfigError(
                "disaggregation.mode=decode needs a pre-allocating request pool "
                f"(memory_pool.name=decode_prealloc), not {scheduler.settings.memory_pool.name!r}"
            )
        self.backend = build_backend(scheduler.settings, "decode", scheduler.runner.kv_cache)
        self.clients: dict[tuple[str, int], BootstrapClient] = {}
        self.connected_to: tuple[str, int] | None = None
        self.prealloc: deque[_Incoming] = deque()
        self.transferring: dict[int, _Incoming] = {}

    # -- scheduler hooks -------------------------------------------------------------------

    def admit(self, req: Req) -> bool:
        """Take the request into the pre-allocation queue (it never enters the waiting queue)."""
        room = room_of(req)
        if req.bootstrap_host is None or req.bootstrap_port is None:
            raise ValueError("a request to a decode server needs bootstrap_host and bootstrap_port")
        self.prealloc.append(_Incoming(req, room, TransferTask(room)))
        return True

    def step(self) -> None:
        progressed = self._connect()
        progressed |= self._preallocate()
        progressed |= self._poll()
        s = self.sched
        if not progressed and self.has_work() and not (s.waiting or s.running):
            time.sleep(IDLE_POLL_S)

    def _connect(self) -> bool:
        """Join the prefill server of the oldest queued request (one peer per backend)."""
        if self.connected_to is not None or not self.prealloc:
            return False
        req = self.prealloc[0].req
        addr = (str(req.bootstrap_host), int(req.bootstrap_port))
        client = self.clients.setdefault(addr, BootstrapClient(*addr, timeout_s=2.0))
        try:
            peer = client.endpoints("prefill").get(0)
            if peer is None:
                return False
            client.register("decode", 0, self.backend.endpoint())
        except httpx.HTTPError as exc:
            logger.debug("bootstrap %s:%d not reachable yet: %s", *addr, exc)
            return False
        self.backend.connect(peer)
        self.connected_to = addr
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
            kv.admit(req, kv.cache.match_prefix([]))
            req.extend_len = len(req.input_ids)
            slots = kv.alloc_extend([req])
            req.extend_len = 0
            if slots is None:  # cannot happen after the budget check; give the row back
                kv.release(req)
                break
            req.kv_len = len(req.input_ids)
            self.prealloc.popleft()
            dst_pages = pages_of_slots(slots.tolist(), kv.page_size)
            self.backend.expect(inc.room, dst_pages)
            try:
                self.clients[self.connected_to].post_room(inc.room, dst_pages)
            except httpx.HTTPError as exc:
                self._fail(inc, f"posting the destination to the bootstrap service failed: {exc}")
                continue
            inc.task = self.backend.poll(inc.room)
            self.transferring[inc.room] = inc
            progressed = True
        return progressed

    def _poll(self) -> bool:
        progressed = False
        for room, inc in list(self.transferring.items()):
            task = self.backend.poll(room)
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
        s, r = self.sched, inc.req
        meta = decode_first_token(self.backend.metadata(inc.room) or b"")
        self.backend.release(inc.room)
        r.output_ids.append(meta.token_id)
        r.first_token_time = time.monotonic()
        if r.return_logprob and meta.logprob is not None:
            r.output_logprobs.append(meta.logprob)
            if meta.top_logprobs is not None:
                r.output_top_logprobs.append(meta.top_logprobs)
            if meta.input_logprobs:
                r.input_logprobs = list(meta.input_logprobs)
                r.input_top_logprobs = list(meta.input_top_logprobs or [])
        reason = check_finished(r, s.context_len, s.tokenizer)
        if reason is not None:
            r.finished_reason = reason
            s._finish(r)
        else:
            s.running.append(r)
            s._pending.append(s._delta(r))

    def _fail(self, inc: _Incoming, message: str | None) -> None:
        """Free the reservation without caching it (its pages hold no valid KV) and report."""
        r, kv = inc.req, self.sched.kv
        self.backend.release(inc.room)
        if r.req_pool_idx is not None:
            kv.allocator.free(r.kv_indices(kv.req_to_token))
            kv.cache.dec_lock_ref(r.last_node)
            self.pool.free(r.req_pool_idx)
            r.req_pool_idx, r.last_node, r.kv_len = None, None, 0
        r.finished_reason = FinishReason("abort", message=message or "the KV transfer failed")
        logger.warning("request %s: %s", r.rid, r.finished_reason.message)
        self.sched._finish(r, error=r.finished_reason.message)

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
        return bool(self.prealloc or self.transferring)

    def holders(self) -> list[Req]:
        return [inc.req for inc in self.transferring.values()]

    def close(self) -> None:
        self.backend.close()
        for c in self.clients.values():
            c.close()
