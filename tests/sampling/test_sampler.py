"""Sampler behaviour: greedy, seeds, penalties, logprobs, statistics, incremental batch state."""

from __future__ import annotations

import random

import pytest
import torch

from framework.sampling.params import SamplingParams
from framework.sampling.sampler import Sampler, SamplingBatchInfo, mix_seed
from tests.sampling.hf_reference import frequency_presence_formula

V = 97


def _info(params: list[SamplingParams], outputs: list[list[int]] | None = None, **kw) -> SamplingBatchInfo:
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = kw.get("prompts", [[] for _ in range(n)])
    eos = kw.get("eos", [[0] for _ in range(n)])
    return SamplingBatchInfo.build(params, prompts, outputs, eos, kw.get("vocab", V), kw.get("device", "cpu"))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_greedy_is_argmax_and_uses_no_randomness() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=2.0)] * 3
    state = torch.get_rng_state()
    out = Sampler().sample(logits, _info(params))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state), "an all-greedy batch must not consume the RNG"


def test_greedy_rows_in_a_mixed_batch_take_argmax_of_penalised_logits() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=5.0),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_new_tokens=3),
    ]
    best = [int(logits[i].argmax()) for i in range(4)]
    prompts = [[best[0]], [], [], []]
    logits[3, 0] = 100.0  # EOS (id 0) would win, but min_new_tokens masks it
    info = _info(params, prompts=prompts, outputs=[[], [], [], [5]])
    ids = Sampler().sample(logits, info).next_token_ids.tolist()
    penalised = logits[0].clone()
    penalised[best[0]] = penalised[best[0]] / 5 if penalised[best[0]] > 0 else penalised[best[0]] * 5
    assert ids[0] == int(penalised.argmax()) != best[0]
    assert ids[2] == best[2]
    assert ids[3] == int(logits[3, 1:].argmax()) + 1


def test_logits_are_not_modified_in_place() -> None:
    logits = torch.randn(3, V)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, min_new_tokens=4, frequency_penalty=1.0)] * 3
    Sampler().sample(logits, _info(params, prompts=[[1, 2]] * 3, outputs=[[2, 2]] * 3))
    assert torch.equal(logits, before)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[2, 97\]"):
        Sampler().sample(torch.zeros(3, V), _info([SamplingParams()] * 2))


def test_frequency_and_presence_penalties_follow_the_formula() -> None:
    rng = random.Random(3)
    torch.manual_seed(3)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.0),
        SamplingParams(frequency_penalty=0.0, presence_penalty=1.5),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=0.3),
        SamplingParams(),  # no penalty: untouched
    ]
    outputs = [[rng.randrange(10) for _ in range(rng.randrange(1, 25))] for _ in params]
    logits = torch.randn(len(params), V)
    info = _info(params, outputs=outputs, prompts=[[50, 51]] * 4)
    assert info.penalties is not None and info.penalties.repetition is None  # only what is used
    got = info.penalties.apply(logits)
    for i, p in enumerate(params):
        want = frequency_presence_formula(logits[i], outputs[i], p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)
    assert torch.equal(got[3], logits[3])


def test_no_penalty_state_when_no_row_needs_it() -> None:
    info = _info([SamplingParams(temperature=0.5, min_new_tokens=3)], outputs=[[1, 2, 3]])
    assert info.penalties is None  # min_new_tokens already reached


def test_logprobs_are_raw_log_softmax_and_top_logprobs_are_topk() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, V) * 3
    params = [
        SamplingParams(temperature=0.3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, frequency_penalty=2.0),
        SamplingParams(min_p=0.5),
        SamplingParams(),
    ]
    nums = [3, 0, 1, 5, 20]
    out = Sampler().sample(logits, _info(params, prompts=[[1, 2, 3]] * 5, outputs=[[4]] * 5), nums)
    raw = torch.log_softmax(logits, dim=-1)
    want = raw.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32 and out.next_token_ids.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, want, atol=1e-5, rtol=0)
    assert out.top_logprobs is not None
    for i, k in enumerate(nums):
        vals, ids = torch.topk(raw[i], k)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in out.top_logprobs[i]]), vals, atol=1e-5, rtol=0)
    assert Sampler().sample(logits, _info(params)).top_logprobs is None
    cheap = Sampler().sample(logits, _info(params), [0] * 5, return_logprobs=False)
    assert cheap.logprobs is None and cheap.top_logprobs == [[]] * 5


# ---------------------------------------------------------------------------------------------------
# Seeds


# Neighbours switch on every optional step (top-k, min-p, penalties, greedy) in turn, so the
# seeded row must come out the same whichever code paths its batch takes.
_NEIGHBOURS = [
    {"temperature": 0.7},
    {"top_k": 5, "seed": 1000},
    {"temperature": 0.0},
    {"min_p": 0.2, "seed": 1001},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.5},
    {"min_new_tokens": 50, "top_p": 0.5},
]


def _seeded_run(
    row_logits: list[torch.Tensor], seed: int, others: int, position: int, device: str = "cpu"
) -> list[int]:
    """Generate len(row_logits) steps for a seeded row placed at ``position`` among ``others``
    other rows with their own params and logits."""
    sampler, tokens = Sampler(), []
    for step, row in enumerate(row_logits):
        params = [SamplingParams(**_NEIGHBOURS[(j + step) % len(_NEIGHBOURS)]) for j in range(others)]
        params.insert(position, SamplingParams(temperature=1.3, top_p=0.97, seed=seed))
        logits = torch.randn(others + 1, V)
        logits[position] = row
        outputs = [[1] * step for _ in params]
        info = _info(params, outputs=outputs, prompts=[[2, 3]] * len(params), device=device)
        out = sampler.sample(logits.to(device), info)
        tokens.append(int(out.next_token_ids[position]))
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_reproduces_across_batch_composition_and_order(device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    row_logits = [torch.randn(V, generator=gen) for _ in range(12)]
    torch.manual_seed(0)
    reference = _seeded_run(row_logits, seed=42, others=0, position=0, device=device)
    for others, position, global_seed in [(3, 0, 1), (3, 3, 2), (7, 4, 3), (1, 1, 4), (6, 2, 5)]:
        torch.manual_seed(global_seed)  # unseeded neighbours draw different noise each time
        assert _seeded_run(row_logits, 42, others, position, device) == reference
    assert len(set(reference)) > 1, "steps must draw fresh noise"
    torch.manual_seed(0)
    assert _seeded_run(row_logits, 43, 2, 1, device) != reference


def test_mix_seed_separates_seeds_and_steps() -> None:
    values = {mix_seed(s, t) for s in range(50) for t in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**64 for v in values)
    assert mix_seed(-1, 0) == mix_seed(2**64 - 1, 0)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_the_distribution(seeded: bool) -> None:
    """Pearson chi-square over 20k draws with fixed seeds (deterministic, so never flaky); the
    bound is the 99.99th percentile of chi-square with 6 degrees of freedom (~27.9)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0, -3.5])
    n = 20_000
    seeds = list(range(n)) if seeded else [None] * n
    params = [SamplingParams(temperature=0.8, top_k=7, seed=s) for s in seeds]
    info = _info(params, vocab=logits.numel())
    batch = logits.expand(n, -1).contiguous()
    sampler = Sampler()
    probs = sampler.processed_probs(batch[:1], info.filter([0]))[0]
    torch.manual_seed(1234)
    ids = sampler.sample(batch, info).next_token_ids
    counts = torch.bincount(ids, minlength=logits.numel()).float()
    assert (probs > 0).sum() == 7
    assert _chi_square(counts, probs) < 27.9


# ---------------------------------------------------------------------------------------------------
# Incremental batch state


def test_advance_filter_merge_equal_a_fresh_build() -> None:
    rng = random.Random(9)
    torch.manual_seed(9)
    make = [
        {"repetition_penalty": 1.4, "min_new_tokens": 3, "seed": 1},
        {"frequency_penalty": 0.8, "presence_penalty": 0.4},
        {"temperature": 0.0},
        {"min_new_tokens": 6, "stop_token_ids": [9, 10], "top_p": 0.7},
    ]
    params_a = [SamplingParams(**kw) for kw in make]
    params_b = [SamplingParams(presence_penalty=1.0, top_k=5), SamplingParams(min_new_tokens=4)]
    prompts = [[rng.randrange(V) for _ in range(8)] for _ in range(6)]
    eos = [[0, 1]] * 6
    outs_a: list[list[int]] = [[rng.randrange(20)] for _ in range(4)]
    outs_b: list[list[int]] = [[], [3]]
    info_a = SamplingBatchInfo.build(params_a, prompts[:4], [o[:] for o in outs_a], eos[:4], V, "cpu")
    for _ in range(2):
        nxt = [rng.randrange(20) for _ in range(4)]
        info_a.advance(torch.tensor(nxt))
        for o, t in zip(outs_a, nxt, strict=True):
            o.append(t)
    info_b = SamplingBatchInfo.build(params_b, prompts[4:], outs_b, eos[4:], V, "cpu")
    live = info_a.filter([3, 0, 1]).merge(info_b)
    order = [3, 0, 1]
    fresh = SamplingBatchInfo.build(
        [params_a[i] for i in order] + params_b,
        [prompts[i] for i in order] + prompts[4:],
        [outs_a[i] for i in order] + outs_b,
        eos[:5],
        V,
        "cpu",
    )
    assert live.output_lens == fresh.output_lens and live.seeds == fresh.seeds
    logits = torch.randn(5, V)
    assert live.penalties is not None and fresh.penalties is not None
    torch.testing.assert_close(live.penalties.apply(logits), fresh.penalties.apply(logits), atol=0, rtol=0)
    sampler = Sampler()
    torch.testing.assert_close(sampler.processed_probs(logits, live), sampler.processed_probs(logits, fresh))
    for _ in range(6):  # run past every min_new_tokens: the masking state then goes away
        live.advance(torch.full((5,), 20))
    assert live.penalties is not None and live.penalties.min_tokens is None


@pytest.mark.parametrize("plain_first", [True, False])
def test_merge_with_a_batch_without_penalties(plain_first: bool) -> None:
    torch.manual_seed(10)
    plain = [SamplingParams(temperature=0.5), SamplingParams(top_k=3)]
    penalised = [SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2, min_new_tokens=4)]
    prompts, outputs, eos = [[5, 6], [7], [8, 9]], [[1], [2, 2], [3, 3, 4]], [[0], [0], [0, 1]]
    a = SamplingBatchInfo.build(plain, prompts[:2], outputs[:2], eos[:2], V, "cpu")
    b = SamplingBatchInfo.build(penalised, prompts[2:], outputs[2:], eos[2:], V, "cpu")
    assert a.penalties is None and b.penalties is not None
    merged = a.merge(b) if plain_first else b.merge(a)
    order = [0, 1, 2] if plain_first else [2, 0, 1]
    params = plain + penalised
    fresh = SamplingBatchInfo.build(
        [params[i] for i in order],
        [prompts[i] for i in order],
        [outputs[i] for i in order],
        [eos[i] for i in order],
        V,
        "cpu",
    )
    logits = torch.randn(3, V)
    sampler = Sampler()
    torch.testing.assert_close(sampler.processed_probs(logits, merged), sampler.processed_probs(logits, fresh))
    # Once the penalised row is gone, its state goes too: no penalty work for plain rows.
    assert merged.filter([order.index(0), order.index(1)]).penalties is None
    assert merged.filter([order.index(2)]).penalties is not None
