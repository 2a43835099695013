"""Overlap mode: decode step N+1 is built and launched before step N's results are processed.

A single worker thread runs forward + sampling; the scheduler thread meanwhile turns the previous
step's tokens into outputs (stop checks, detokenization on the client side, hooks). Step N+1's
input ids are step N's sampled ids, gathered on the worker, so the scheduler never waits for them.
A request that finished at step N is still in step N+1 (nobody knew yet): its extra token is
dropped and its KV release is deferred until no in-flight batch uses it. Outputs are identical to
the normal loop. Prefill batches, retraction and penalties (which need every previous token) fall
back to the synchronous path after draining the in-flight step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from framework.executor.forward_batch import ForwardBatch
from framework.scheduler.batch_builder import build_decode
from framework.scheduler.loops import StepLoop
from framework.scheduler.request import Req
from framework.scheduler.stats import BatchStats

if TYPE_CHECKING:
    from framework.sampling.sampler import SampleOutput
    from framework.scheduler.scheduler import SamplingInputs, Scheduler


@dataclass
class InflightDecode:
    """A decode step launched on the worker and not yet collected."""

    reqs: list[Req]
    rids: set[str]
    future: Future
    stats: BatchStats
    start: float


def _needs_all_tokens(req: Req) -> bool:
    sp = req.sampling_params
    # Constrained requests too: the next step's bitmask needs the matcher advanced by this step's token;
    # and a logit processor, which is handed every previous output token.
    return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or req.grammar is not None or sp.custom_logit_processor is not None)


class OverlapLoop(StepLoop):
    """The overlap loop (``scheduler.overlap``): owns the forward worker, the in-flight step and
    the deferred KV releases; drives the scheduler through its public API only."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.inflight: InflightDecode | None = None
        self.deferred: list[Req] = []
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="plugserve-forward")

    def step(self) -> None:
        s = self.sched
        if s.waiting or s.chunked:
            self.drain()
            plan = s.plan_prefill()
            if plan.reqs and s.run_prefill(plan.reqs, plan.chunked):
                return
        reqs = [r for r in s.running if not r.finished]
        if not reqs:
            self.drain()
            return
        fits = s.kv.available_tokens() >= s.kv.decode_tokens_needed(reqs)
        if not fits or any(_needs_all_tokens(r) for r in reqs):
            self.drain()
            if s.running:
                s.run_decode()
            return
        self._launch_decode(reqs)
        if not s.running and not s.waiting:
            # Everything finished at the step just collected: nothing will collect the launched
            # step later, so finish it now and release the KV it still used.
            self.drain()

    def _launch_decode(self, reqs: list[Req]) -> None:
        s, prev = self.sched, self.inflight
        slots = s.kv.alloc_decode(reqs)
        if slots is None:
            raise RuntimeError("KV allocation failed although the budget was checked")
        prev_row = {r.rid: i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        # A request of the in-flight step has one token that is not in output_ids yet.
        pending = [r.rid in prev_row and not r.finished for r in reqs]
        inputs = s.sampling_inputs(reqs, pending_one=pending)
        batch = build_decode(reqs, slots, s.runner, pending_input=pending)
        prev_index = torch.tensor(
            [prev_row[r.rid] if p else -1 for r, p in zip(reqs, pending, strict=True)],
            dtype=torch.int64, device=s.runner.device,
        )
        for r in reqs:
            r.kv_len += 1
        stats = s.batch_stats("decode", reqs, len(reqs))
        s.hook.on_batch_scheduled(batch=stats)
        future = self.executor.submit(
            self._forward_on_worker, batch, prev.future if prev is not None else None, prev_index, inputs
        )
        self.inflight = InflightDecode(reqs, {r.rid for r in reqs}, future, stats, time.perf_counter())
        if prev is not None:
            self._collect(prev)

    def _forward_on_worker(
        self, batch: ForwardBatch, prev: Future | None, prev_index: torch.Tensor, inputs: SamplingInputs
    ) -> SampleOutput:
        if prev is not None:
            # The worker runs steps in order, so the previous step is already done here.
            prev_ids = prev.result().next_token_ids
            mask = prev_index >= 0
            batch.input_ids = torch.where(mask, prev_ids[prev_index.clamp(min=0)], batch.input_ids)
        logits = self.sched.runner.forward(batch)
        return self.sched.sample_tensors(logits, inputs)

    def _collect(self, done: InflightDecode) -> None:
        s = self.sched
        s.apply_samples(done.reqs, done.future.result())
        s.running = [r for r in s.running if not r.finished]
        s.decay_new_token_ratio()
        s.hook.on_batch_finished(batch=done.stats, elapsed_s=time.perf_counter() - done.start)
        self._release_deferred()

    def drain(self) -> None:
        """Collect the in-flight step, if any, so the scheduler state is exact."""
        if self.inflight is not None:
            done, self.inflight = self.inflight, None
            self._collect(done)
        self._release_deferred()

    def release(self, req: Req) -> None:
        if self.inflight is not None and req.rid in self.inflight.rids:
            self.deferred.append(req)  # the in-flight forward still reads its KV
        else:
            self.sched.kv.release(req)

    def _release_deferred(self) -> None:
        keep = []
        for req in self.deferred:
            if self.inflight is not None and req.rid in self.inflight.rids:
                keep.append(req)
            else:
                self.sched.kv.release(req)
        self.deferred = keep

    def holders(self) -> list[Req]:
        return list(self.deferred)

    def has_work(self) -> bool:
        return self.inflight is not None

    def close(self) -> None:
        """Finish the in-flight step and stop the worker thread."""
        self.drain()
        self.executor.shutdown(wait=True)
