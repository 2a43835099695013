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

from framework.engine.forward_batch import ForwardBatch
from framework.scheduler.batch_builder import build_decode
from framework.scheduler.request import Req
from framework.scheduler.stats import BatchStats

if TYPE_CHECKING:
    from framework.sampling.sampler import SampleOutput
    from framework.scheduler.scheduler import SamplingInputs


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
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


class OverlapDecodeMixin:
    """Scheduler methods of the overlap loop (mixed into ``Scheduler``)."""

    _inflight: InflightDecode | None
    _deferred_release: list[Req]
    _executor: ThreadPoolExecutor | None

    def _init_overlap(self, enabled: bool) -> None:
        self._inflight = None
        self._deferred_release = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="plugserve-forward") if enabled else None

    def _step_overlap(self) -> None:
        if self.waiting or self.chunked:
            self._drain()
            plan = self.planner.plan(self.waiting, self.running, self.chunked, self.new_token_ratio)
            if plan.reqs and self._run_prefill(plan.reqs, plan.chunked):
                return
        reqs = [r for r in self.running if not r.finished]
        if not reqs:
            self._drain()
            return
        fits = self.kv.available_tokens() >= self.kv.decode_tokens_needed(reqs)
        if not fits or any(_needs_all_tokens(r) for r in reqs):
            self._drain()
            if self.running:
                self._run_decode()
            return
        self._launch_decode(reqs)
        if not self.running and not self.waiting:
            # Everything finished at the step just collected: nothing will collect the launched
            # step later, so finish it now and release the KV it still used.
            self._drain()

    def _launch_decode(self, reqs: list[Req]) -> None:
        prev = self._inflight
        slots = self.kv.alloc_decode(reqs)
        if slots is None:
            raise RuntimeError("KV allocation failed although the budget was checked")
        prev_row = {r.rid: i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        # A request of the in-flight step has one token that is not in output_ids yet.
        pending = [r.rid in prev_row and not r.finished for r in reqs]
        inputs = self._sampling_inputs(reqs, pending_one=pending)
        batch = build_decode(reqs, slots, self.runner, pending_input=pending)
        prev_index = torch.tensor(
            [prev_row[r.rid] if p else -1 for r, p in zip(reqs, pending, strict=True)],
            dtype=torch.int64, device=self.runner.device,
        )
        for r in reqs:
            r.kv_len += 1
        stats = self._stats("decode", reqs, len(reqs))
        self.hook.on_batch_scheduled(batch=stats)
        assert self._executor is not None
        future = self._executor.submit(
            self._forward_on_worker, batch, prev.future if prev is not None else None, prev_index, inputs
        )
        self._inflight = InflightDecode(reqs, {r.rid for r in reqs}, future, stats, time.perf_counter())
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
        logits = self.runner.forward(batch)
        return self._sample_tensors(logits, inputs)

    def _collect(self, done: InflightDecode) -> None:
        out = done.future.result()
        self._apply_samples(done.reqs, out)
        self.running = [r for r in self.running if not r.finished]
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_step)
        self.hook.on_batch_finished(batch=done.stats, elapsed_s=time.perf_counter() - done.start)
        self._release_deferred()

    def _drain(self) -> None:
        """Collect the in-flight step, if any, so the scheduler state is exact."""
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._collect(done)
        self._release_deferred()

    def _release_or_defer(self, req: Req) -> None:
        if self._inflight is not None and req.rid in self._inflight.rids:
            self._deferred_release.append(req)
        else:
            self.kv.release(req)

    def _release_deferred(self) -> None:
        keep = []
        for req in self._deferred_release:
            if self._inflight is not None and req.rid in self._inflight.rids:
                keep.append(req)
            else:
                self.kv.release(req)
        self._deferred_release = keep

    def shutdown(self) -> None:
        """Finish the in-flight step and stop the worker thread."""
        self._drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
