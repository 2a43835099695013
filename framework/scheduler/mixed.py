"""Mixed steps (``scheduler.mixed_chunk``): a prefill chunk and the running decode rows in one forward.

Without them a running batch stops decoding for every prefill step, so a newcomer's prompt adds
its whole prefill time to every running stream's next token. Here each running request joins the
prefill's extend batch as one token on top of its KV (its last sampled token at position
``kv_len``), exactly the row a decode step would compute, so outputs do not change; the prefill
budget (``max_prefill_tokens``) counts those rows, which bounds the step and so the TPOT. SGLang
calls this a mixed chunk; vLLM's chunked-prefill scheduling does the same. Attention backends see an
ordinary extend batch with prefixes (the conformance kit's ``mixed`` scenario).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from framework.scheduler.batch_builder import build_extend, record_prompt_logprobs

if TYPE_CHECKING:
    from framework.scheduler.request import Req
    from framework.scheduler.scheduler import Scheduler


def run_mixed(s: Scheduler, reqs: list[Req], chunked: Req | None) -> bool:
    """Prefill ``reqs`` and decode every running request in one forward; False (nothing done) when
    the KV for both is not there, and the caller runs the prefill alone."""
    decoding = list(s.running)
    for r in decoding:
        r.extend_len = 1
    batch_reqs = [*reqs, *decoding]
    slots = s.kv.alloc_extend(batch_reqs)
    if slots is None:
        for r in decoding:
            r.extend_len = 0
        return False
    for r in reqs:
        if r in s.waiting:
            s.waiting.remove(r)
    s.chunked = chunked
    batch, plan = build_extend(batch_reqs, slots, s.runner)
    stats = s.batch_stats("mixed", batch_reqs, batch.num_tokens)
    s.hook.on_batch_scheduled(batch=stats)
    start = time.perf_counter()
    logits = s.runner.forward(batch)
    for r in batch_reqs:
        r.kv_len += r.extend_len
        if r is not chunked:
            r.extend_len = 0
    for r in reqs:
        s.kv.cache_prefix(r)  # as after a prefill: later arrivals can share the prompt
    record_prompt_logprobs(reqs, logits, plan)
    sample_reqs, sample_rows = s.finish_scoring_only(plan)
    if sample_reqs:
        s.apply_samples(sample_reqs, s.sample(sample_reqs, logits[sample_rows]))
    newly = [r for r in reqs if r in sample_reqs and r not in decoding]
    s.running = [r for r in decoding if not r.finished] + [r for r in newly if not r.finished]
    s.decay_new_token_ratio()
    s.hook.on_batch_finished(batch=stats, elapsed_s=time.perf_counter() - start)
    return True
