"""The continuous-batching scheduler: one ``step()`` runs one prefill or one decode batch.

Each step: plan a prefill batch (policy order, KV and token budgets, chunked prefill); if there is
none, decode the running requests, retracting the newest ones when KV runs out (they re-queue and
later re-prefill, reusing their cached KV). After the forward, the sampler picks the next tokens,
finished requests hand their KV to the prefix cache, and per-request output deltas are returned.
The scheduler is single-threaded: the engine or the scheduler process calls
``add_request``/``abort``/``step`` from one thread.

Public API, for the loops (``framework.scheduler.loops``, ``overlap``) and the PD sides
(``framework.scheduler.pd``), which touch nothing else:

- state: ``waiting``, ``running``, ``chunked``, ``requests``, ``kv`` (the :class:`KVManager`),
  ``runner``, ``settings``, ``cfg``, ``context_len``, ``tokenizer``, ``hook``, ``pd``;
- batches: ``plan_prefill``, ``run_prefill``, ``run_decode``, ``batch_stats``,
  ``decay_new_token_ratio``, ``finish_scoring_only`` (retraction: ``framework.scheduler.retraction``;
  grammar admission and jump-forward: ``framework.scheduler.grammar_steps``);
- sampling: ``sampling_inputs``, ``sample_tensors``, ``sample``, ``apply_samples``;
- request life: ``add_request`` (admit), ``start_decoding``, ``emit``, ``finish``, ``abort``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework.config.auto import cpu_max_prefill_tokens
from framework.config.schema import PlugserveConfig
from framework.errors import ConfigError
from framework.executor.model_runner import ModelRunner
from framework.kernels.small_gemm import amx_available
from framework.plugins import get_plugins
from framework.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo
from framework.scheduler.admission import AdmissionError, check_admission
from framework.scheduler.batch_builder import LogitsPlan, build_decode, build_extend, record_prompt_logprobs
from framework.scheduler.finish import check_finished
from framework.scheduler.grammar_queue import GrammarAdmissionError, GrammarQueue
from framework.scheduler.grammar_steps import admit_compiled, jump_forward
from framework.scheduler.kv_manager import KVManager
from framework.scheduler.loops import StepLoop, SyncLoop
from framework.scheduler.outputs import RequestOutput, delta_of
from framework.scheduler.overlap import OverlapLoop
from framework.scheduler.pd import PDSideFactory
from framework.scheduler.prefill_planner import PrefillPlan, PrefillPlanner
from framework.scheduler.request import FinishReason, Req
from framework.scheduler.retraction import fail_unrecomputable, make_room_for_decode
from framework.scheduler.rollout import RolloutControl
from framework.scheduler.sampling_reuse import SamplingInfoReuse
from framework.scheduler.stats import BatchStats, RequestStats

logger = logging.getLogger(__name__)


@dataclass
class SamplingInputs:
    """Per-batch sampling state prepared before the forward."""

    info: SamplingBatchInfo
    top_nums: list[int] | None
    want_logprobs: bool
    token_ids: list[list[int]] | None = None
    """Per row the ids of ``token_ids_logprob`` (None when no row asks)."""


class Scheduler:
    """Owns the waiting queue, the running batch and the model runner (public API: see the
    module docstring). ``pd_side`` builds the PD half for ``disaggregation.mode`` (the
    ``Engine`` and the server pass ``framework.disaggregation.make_pd_side``)."""

    def __init__(self, settings: PlugserveConfig, runner: ModelRunner | None = None, tokenizer: Any = None,
                 pd_side: PDSideFactory | None = None):
        self.settings = settings
        self.cfg = settings.scheduler
        self.runner = runner or ModelRunner(settings)
        self.tokenizer = tokenizer
        self.plugins = get_plugins()
        self.hook = self.plugins.hook
        plan = self.runner.plan
        self.max_running = min(plan.max_running_requests, self.runner.req_pool.size)
        self.context_len = plan.context_len
        self.kv = KVManager(self.runner.req_pool, self.runner.allocator, settings.radix_cache.enabled)
        policy_comp = self.plugins.registry.get("schedule_policy", self.cfg.policy, key="scheduler.policy")
        self.policy = policy_comp.factory(policy_comp.make_options(self.cfg.policy_options))
        if self.cfg.max_prefill_tokens is None:  # CPU auto: by the served dtype (framework.config.auto)
            self.cfg.max_prefill_tokens = cpu_max_prefill_tokens(getattr(self.runner, "dtype", None), amx_available())
        self.planner = PrefillPlanner(self.cfg, self.kv, self.policy, self.max_running)
        # After the budgets are final: a step has at most this many rows (a prefill, a mixed step,
        # or a decode step one row per running request) and samples at most one row per request.
        warm = getattr(self.runner, "warm_cpu_gemms", None)  # test doubles of the runner lack it
        if warm is not None:
            warm(max(self.cfg.max_prefill_tokens, self.cfg.mixed_chunk_max_tokens or 0, self.max_running + 1),
                 self.max_running)
        self.sampler = Sampler()
        self.grammar = GrammarQueue(settings, tokenizer, self.runner.vocab_size)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.requests: dict[str, Req] = {}
        self.new_token_ratio = self.cfg.init_new_token_ratio
        self._ratio_step = (self.cfg.init_new_token_ratio - self.cfg.min_new_token_ratio) / max(
            self.cfg.new_token_ratio_decay_steps, 1
        )
        self.stalled_steps = 0
        """Prefill-only steps in a row that ran while requests were decoding (see ``mixed_step_now``)."""
        self.num_retractions = 0
        self.cache_hit_tokens = 0
        self.prompt_tokens_seen = 0
        self._pending: list[RequestOutput] = []
        self._sampling_reuse = SamplingInfoReuse()  # the next decode step of the same batch reuses its info
        self.holds: set[str] = set()
        """Why no batch may run now (``paused``, ``released``: see ``framework.scheduler.rollout``)."""
        self.hold_admission = False
        """Start no new prefill (an exclusive rollout call waits for the running requests)."""
        self.loop: StepLoop = OverlapLoop(self) if self.cfg.overlap else SyncLoop(self)
        self.rollout = RolloutControl(self)
        self.pd = pd_side(self) if pd_side is not None else None  # None in unified mode
        if settings.disaggregation.mode is not None and self.pd is None:
            raise ConfigError("disaggregation.mode is set but this scheduler was built without a PD side "
                              "(pass pd_side=framework.disaggregation.make_pd_side)")

    # -- requests in and out ---------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue a request; raises AdmissionError if it can never run."""
        check_admission(self, req)
        if req.wants_prompt_logprobs() and req.logprob_start_len == 0:
            req.input_logprobs.append(None)  # the first prompt token has no logprob
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        if req.sampling_params.max_new_tokens == 0 and not req.wants_prompt_logprobs():
            # Nothing to compute: it finishes at once, without a forward or any KV.
            self.requests[req.rid] = req
            req.finished_reason = FinishReason("length")
            self.finish(req)
            return
        try:  # a constrained request waits in the grammar queue until its grammar is compiled
            compiling = self.grammar.admit(req, pd=self.pd is not None)
        except GrammarAdmissionError as exc:
            raise AdmissionError(str(exc)) from None
        # PD: checks the bootstrap fields (may raise); the decode side queues the request itself
        queued_by_pd = self.pd is not None and self.pd.admit(req)
        self.requests[req.rid] = req
        if not queued_by_pd and not compiling:
            self.waiting.append(req)
        self.prompt_tokens_seen += len(req.input_ids)

    def abort(self, rid: str, message: str | None = None) -> bool:
        """Abort a request wherever it is; its KV is released now. False if unknown."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if self.pd is not None and self.pd.abort(req, message or "aborted"):
            return True
        self.grammar.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)
        req.finished_reason = FinishReason("abort", message=message or "aborted")
        self.finish(req, error=message)
        return True

    def has_work(self) -> bool:
        if self.holds:
            return bool(self._pending)
        pd_work = self.pd is not None and self.pd.has_work()
        return bool(self.waiting or self.running or self.chunked or self._pending or self.loop.has_work() or pd_work
                    or self.grammar.pending)

    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked else 0)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch (prefill if any can be formed, else decode); return output deltas."""
        admit_compiled(self)
        if not self.holds:
            jump_forward(self)
            self.loop.step()
        out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        """Stop the loop's worker (overlap), the grammar compilers and the PD side's transfer backend."""
        self.loop.close()
        self.grammar.close()
        if self.pd is not None:
            self.pd.close()

    # -- batches -----------------------------------------------------------------------------

    def plan_prefill(self) -> PrefillPlan:
        """The next prefill batch the waiting queue and the chunked request allow (maybe empty)."""
        waiting = [] if self.hold_admission else self.waiting
        if waiting:
            fail_unrecomputable(self)
        # A mixed step's decode rows come out of its token budget.
        decode_rows = len(self.running) if self.mixed_step_now() else 0
        return self.planner.plan(waiting, self.running, self.chunked, self.new_token_ratio, decode_rows)

    def mixed_step_now(self) -> bool:
        """Whether a prefill batch formed now shares its forward with the running requests' decode
        rows: ``scheduler.mixed_chunk`` on (config resolution leaves it off, or refuses it, with the
        overlap loop or a PD role) and at least ``scheduler.mixed_chunk_min_running`` requests
        decoding, or any decoding after ``scheduler.mixed_chunk_max_stalled_steps`` prefill-only
        steps in a row stopped them."""
        if not self.cfg.mixed_chunk or not self.running:
            return False
        max_stalled = self.cfg.mixed_chunk_max_stalled_steps
        return (len(self.running) >= (self.cfg.mixed_chunk_min_running or 1)
                or (max_stalled is not None and self.stalled_steps >= max_stalled))

    def run_prefill(self, reqs: list[Req], chunked: Req | None, mixed: bool = False) -> bool:
        """Prefill ``reqs``; False if not even one of them could get KV (decode runs instead).

        ``mixed`` (``scheduler.mixed_chunk``): the running requests join the same forward as one
        token each on top of their KV (their last sampled token at ``kv_len``: the row a decode step
        computes, so outputs do not change), and a newcomer's prefill no longer stops the running
        streams (SGLang's mixed chunk; vLLM's chunked-prefill scheduling). The planner counted
        those rows in the step's token budget. False, with nothing done, when KV for both is short:
        the caller then prefills alone.
        """
        decoding = list(self.running) if mixed else []
        for r in decoding:
            r.extend_len = 1
        slots = self.kv.alloc_extend(reqs + decoding) if decoding else None
        if decoding and slots is None:
            for r in decoding:
                r.extend_len = 0
            return False
        for r in reqs:
            if r in self.waiting:
                self.waiting.remove(r)
        if not decoding:
            slots = self.kv.alloc_extend(reqs)
        while slots is None and reqs:
            # The budget estimate was off (page rounding): give back the last admitted request.
            last = reqs.pop()
            if last is chunked:
                chunked = None
            if last is self.chunked:
                last.extend_len = 0  # keeps its row and KV; continues in a later batch
            else:
                self.kv.release(last)
                self.waiting.insert(0, last)
            slots = self.kv.alloc_extend(reqs) if reqs else None
        if not reqs:
            return False
        self.chunked = chunked
        # A prefill-only step while requests run stalls them; a mixed step ends the stall.
        self.stalled_steps = 0 if decoding or not self.running else self.stalled_steps + 1
        batch_reqs = reqs + decoding
        batch, plan = build_extend(batch_reqs, slots, self.runner)
        stats = self.batch_stats("mixed" if decoding else "prefill", batch_reqs, batch.num_tokens)
        self.hook.on_batch_scheduled(batch=stats)
        start = time.perf_counter()
        logits = self.runner.forward(batch)
        for r in batch_reqs:
            r.kv_len += r.extend_len
            if r is not chunked:
                r.extend_len = 0
        for r in reqs:
            self.kv.cache_prefix(r)  # later arrivals can share this prompt while it still runs
        record_prompt_logprobs(reqs, logits, plan)
        sample_reqs, sample_rows = self.finish_scoring_only(plan)
        if sample_reqs and not (self.pd is not None and self.pd.on_prefilled(sample_reqs, logits[sample_rows])):
            self.apply_samples(sample_reqs, self.sample(sample_reqs, logits[sample_rows]))
            prefilled = [r for r in sample_reqs if r not in decoding and not r.finished]
            self.running = [r for r in decoding if not r.finished] if decoding else self.running
            self.running.extend(prefilled)
        if decoding:
            self.decay_new_token_ratio()
        self.hook.on_batch_finished(batch=stats, elapsed_s=time.perf_counter() - start)
        return True

    def finish_scoring_only(self, plan: LogitsPlan) -> tuple[list[Req], list[int]]:
        """Requests with ``max_new_tokens == 0`` (prompt logprobs only, SGLang's scoring use)
        finish after their prefill without a token; the others, and their logits rows, sample."""
        if all(r.sampling_params.max_new_tokens > 0 for r in plan.sample_reqs):
            return plan.sample_reqs, plan.sample_rows
        reqs, rows = [], []
        for r, row in zip(plan.sample_reqs, plan.sample_rows, strict=True):
            if r.sampling_params.max_new_tokens > 0:
                reqs.append(r)
                rows.append(row)
            else:
                r.finished_reason = FinishReason("length")
                self.finish(r)
        return reqs, rows

    def run_decode(self) -> None:
        """One decode step of the running batch (retracting the newest requests if KV is short)."""
        make_room_for_decode(self)
        reqs = self.running
        if not reqs:
            return
        slots = self.kv.alloc_decode(reqs)
        if slots is None:  # cannot happen after _make_room_for_decode; fail loudly if it does
            raise RuntimeError("KV allocation failed after retraction")
        self.stalled_steps = 0
        batch = build_decode(reqs, slots, self.runner)
        stats = self.batch_stats("decode", reqs, len(reqs))
        self.hook.on_batch_scheduled(batch=stats)
        start = time.perf_counter()
        logits = self.runner.forward(batch)
        for r in reqs:
            r.kv_len += 1
        self.apply_samples(list(reqs), self.sample(list(reqs), logits))
        self.running = [r for r in self.running if not r.finished]
        self.decay_new_token_ratio()
        self.hook.on_batch_finished(batch=stats, elapsed_s=time.perf_counter() - start)

    def decay_new_token_ratio(self) -> None:
        """One decode step ran without retraction: assume a little less of each request's
        remaining ``max_new_tokens`` when admitting prefills (SGLang's scheme)."""
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_step)

    # -- sampling and results --------------------------------------------------------------

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> SampleOutput:
        """The next token (and logprobs) of each request from its logits row; nothing applied."""
        return self.sample_tensors(logits, self.sampling_inputs(reqs))

    def sampling_inputs(self, reqs: list[Req], pending_one: list[bool] | None = None) -> SamplingInputs:
        """Everything sampling needs, built on the scheduler thread. ``pending_one[i]``: request i
        has one token in flight not yet in ``output_ids`` (overlap mode, which has no penalties:
        only the output length matters then, for seeds and min_new_tokens)."""
        info = self._sampling_reuse.take(reqs) if pending_one is None else None
        if info is None:
            pending = pending_one or [False] * len(reqs)
            outputs = [r.output_ids + [0] if p else r.output_ids for r, p in zip(reqs, pending, strict=True)]
            info = SamplingBatchInfo.build(
                [r.sampling_params for r in reqs], [r.text_input_ids for r in reqs], outputs,
                [r.eos_token_ids for r in reqs], self.runner.vocab_size, self.runner.device,
            )
            if pending_one is None:
                self._sampling_reuse.keep(reqs, info)
        info.token_bitmask = self.grammar.bitmask(reqs)
        top_nums = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        token_ids = [r.token_ids_logprob or [] for r in reqs]
        return SamplingInputs(info, top_nums if any(top_nums) else None, any(r.return_logprob for r in reqs),
                              token_ids if any(token_ids) else None)

    def sample_tensors(self, logits: torch.Tensor, inputs: SamplingInputs) -> SampleOutput:
        """The sampling computation alone (safe to run on the overlap worker thread)."""
        return self.sampler.sample(
            logits, inputs.info, inputs.top_nums, return_logprobs=inputs.want_logprobs, token_ids=inputs.token_ids
        )

    def apply_samples(self, reqs: list[Req], out: SampleOutput) -> None:
        """Append sampled tokens, check stop conditions, emit deltas (a request that already
        finished drops its token: overlap mode sampled it before anyone knew)."""
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        now = time.monotonic()
        for i, r in enumerate(reqs):
            if r.finished:
                continue
            r.output_ids.append(next_ids[i])
            if r.first_token_time is None:
                r.first_token_time = now
            if r.return_logprob and logprobs is not None:
                r.output_logprobs.append(logprobs[i])
                if out.top_logprobs is not None:
                    r.output_top_logprobs.append(out.top_logprobs[i])
                if r.token_ids_logprob and out.token_ids_logprobs is not None:
                    r.output_token_ids_logprobs.append(out.token_ids_logprobs[i])
            reason = self.grammar.advance(r, next_ids[i]) or check_finished(r, self.context_len, self.tokenizer)
            if reason is not None:
                r.finished_reason = reason
                self.finish(r)
            elif len(r.output_ids) - r.sent_len >= self.cfg.stream_interval:
                self.emit(r)

    def start_decoding(self, req: Req) -> None:
        """A request whose first token came from elsewhere (PD decode: the prefill server) joins
        the running batch, or finishes at once if that token ends it."""
        reason = check_finished(req, self.context_len, self.tokenizer)
        if reason is not None:
            req.finished_reason = reason
            self.finish(req)
        else:
            self.running.append(req)
            self.emit(req)

    def emit(self, req: Req) -> None:
        """Report the request's progress since its last report (returned by the next ``step``)."""
        self._pending.append(delta_of(req))

    def finish(self, req: Req, error: str | None = None) -> None:
        """The request is done (``finished_reason`` set): release its KV (now, or once no forward
        in flight reads it), forget it, report its last delta and tell the hooks."""
        self.loop.release(req)
        self.requests.pop(req.rid, None)
        self._sampling_reuse.clear()  # holds no finished request
        delta = delta_of(req)
        delta.error = error
        self._pending.append(delta)
        self.cache_hit_tokens += req.cached_tokens
        self.hook.on_request_finished(
            request=RequestStats(
                rid=req.rid,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                finish_reason=req.finished_reason.type if req.finished_reason else None,
                arrival_time=req.arrival_time,
                first_token_time=req.first_token_time,
                finish_time=time.monotonic(),
            )
        )

    # -- introspection ---------------------------------------------------------------------

    def batch_stats(self, mode: str, reqs: list[Req], new_tokens: int) -> BatchStats:
        """What the batch hooks receive about a batch of ``reqs``."""
        return BatchStats(
            mode=mode,
            num_requests=len(reqs),
            num_new_tokens=new_tokens,
            num_cached_tokens=sum(r.prefix_len for r in reqs) if mode == "prefill" else 0,
            kv_used_tokens=self.kv.used_tokens(),
            kv_total_tokens=self.kv.total_tokens(),
            num_waiting=len(self.waiting),
            num_running=len(self.running),
        )

    def leak_report(self) -> dict[str, int]:
        holders = self.running + ([self.chunked] if self.chunked else []) + self.loop.holders()
        if self.pd is not None:
            holders = holders + self.pd.holders()
        return self.kv.leak_report(self.kv.held_by(holders))

    def flush_cache(self) -> bool:
        """Drop the prefix cache; only allowed when nothing runs or waits."""
        if self.has_work():
            return False
        return self.kv.flush()

    def load(self) -> dict[str, Any]:
        return {
            "num_running": self.num_running(),
            "num_waiting": len(self.waiting),
            "num_waiting_tokens": sum(len(r.input_ids) for r in self.waiting),
            "kv_used_tokens": self.kv.used_tokens(),
            "kv_total_tokens": self.kv.total_tokens(),
            "num_retractions": self.num_retractions,
        }

