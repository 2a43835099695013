"""Token bitmasks in the sampler, against xgrammar's own bitmask kernel as the reference."""

from __future__ import annotations

import pytest
import torch

from framework.sampling.grammar_mask import allowed_tokens, apply_token_bitmask, bitmask_words, full_bitmask
from framework.sampling.params import SamplingParams
from framework.sampling.sampler import Sampler, SamplingBatchInfo

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [31, 32, 33, 400, 1000])
def test_mask_matches_xgrammar(vocab):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, vocab, generator=gen)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab)
    ours = apply_token_bitmask(logits, bitmask)
    assert torch.equal(ours, reference)
    assert torch.equal(allowed_tokens(full_bitmask(2, vocab), vocab), torch.ones(2, vocab, dtype=torch.bool))


def _info(params, vocab):
    n = len(params)
    return SamplingBatchInfo.build(params, [[1]] * n, [[]] * n, [[0]] * n, vocab, "cpu")


def test_sampler_draws_only_allowed_tokens():
    vocab = 100
    allowed = {3, 17, 64, 99}
    bitmask = torch.zeros(3, bitmask_words(vocab), dtype=torch.int32)
    for t in allowed:
        bitmask[:, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    info = _info(params, vocab)
    info.token_bitmask = bitmask
    sampler = Sampler()
    logits = torch.randn(3, vocab) * 5
    seen = set()
    for _ in range(200):
        out = sampler.sample(logits, info, return_logprobs=True)
        seen.update(out.next_token_ids.tolist())
    assert seen <= allowed and len(seen) > 1
    greedy = sampler.sample(logits, info).next_token_ids[1].item()
    assert greedy == max(allowed, key=lambda t: logits[1, t].item())
    # logprobs stay those of the raw model distribution
    out = sampler.sample(logits, info, return_logprobs=True)
    raw = torch.log_softmax(logits, -1).gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, raw)
    probs = sampler.processed_probs(logits, info)
    assert float(probs[:, sorted(set(range(vocab)) - allowed)].sum()) == 0.0
