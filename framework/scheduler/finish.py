"""Stop conditions checked after each sampled token."""

from __future__ import annotations

from typing import Any

from framework.sampling.detokenizer import find_stop_string_in_tail
from framework.scheduler.request import FinishReason, Req


def check_finished(req: Req, context_len: int, tokenizer: Any) -> FinishReason | None:
    """Why ``req`` must stop after its newest token, or None.

    Order: EOS (unless ignore_eos) and stop token ids, then stop strings, then the length limits.
    The sampler already masks EOS and stop tokens before ``min_new_tokens``.
    """
    sp = req.sampling_params
    token = req.output_ids[-1]
    n = len(req.output_ids)
    if n >= sp.min_new_tokens:
        if not sp.ignore_eos and token in req.eos_token_ids:
            return FinishReason("stop", matched=token)
        if token in sp.stop_token_ids:
            return FinishReason("stop", matched=token)
        if sp.stop and tokenizer is not None:
            max_len = max(len(s) for s in sp.stop)
            if find_stop_string_in_tail(
                tokenizer, req.output_ids, sp.stop, max_len, skip_special_tokens=sp.skip_special_tokens
            ):
                text = tokenizer.decode(req.output_ids[-(4 * max_len + 2):], skip_special_tokens=sp.skip_special_tokens)
                matched = next((s for s in sp.stop if s and s in text), None)
                return FinishReason("stop", matched=matched)
    if n >= sp.max_new_tokens or req.seq_len >= context_len:
        return FinishReason("length")
    return None
