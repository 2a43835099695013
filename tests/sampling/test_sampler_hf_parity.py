"""The batched sampler's distribution equals HF's logits processors applied row by row."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from framework.sampling.params import SamplingParams
from framework.sampling.sampler import Sampler, SamplingBatchInfo
from tests.sampling.hf_reference import hf_probs, hf_scores

EOS = [3, 7]

# One row per combination that exercises a different branch; every row of the batch differs.
ROW_PARAMS: list[dict] = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.5, "top_k": 5},
    {"top_p": 0.9},
    {"temperature": 0.8, "top_p": 0.6, "top_k": 20},
    {"min_p": 0.1},
    {"temperature": 1.2, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"repetition_penalty": 1.3, "temperature": 0.9, "top_p": 0.8},
    {"repetition_penalty": 0.7, "top_k": 10},
    {"min_new_tokens": 10, "top_p": 0.9},  # output shorter than 10: EOS masked
    {"min_new_tokens": 2, "temperature": 0.5},  # output already long enough: nothing masked
    {"frequency_penalty": 0.5, "presence_penalty": -0.3, "temperature": 0.9},
    {"temperature": 0.0, "repetition_penalty": 1.2},  # greedy
    {"top_k": 1, "min_new_tokens": 5, "stop_token_ids": [11]},  # greedy through top_k
    {"top_k": 10_000},  # top_k beyond the vocabulary: off
    {
        "top_p": 0.3,
        "min_p": 0.2,
        "repetition_penalty": 1.1,
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "min_new_tokens": 100,
        "stop_token_ids": [12, 13],
        "seed": 5,
    },
]


def _histories(rng: random.Random, n: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    # Repeats on purpose: frequency counts above 1 and prompt/output overlap.
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    outputs = [[rng.randrange(vocab // 4) for _ in range(rng.randrange(3, 8))] for _ in range(n)]
    return prompts, outputs


def _assert_matches_hf(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    eos: list[list[int]],
    device: str = "cpu",
    atol: float = 1e-6,
) -> None:
    vocab = logits.shape[1]
    info = SamplingBatchInfo.build(params, prompts, outputs, eos, vocab, device)
    ours = Sampler().processed_probs(logits.to(device), info).cpu()
    for i, p in enumerate(params):
        ref = hf_probs(logits[i], p, prompts[i], outputs[i], eos[i])
        torch.testing.assert_close(ours[i], ref, atol=atol, rtol=0, msg=lambda m, i=i: f"row {i}: {m}")
        # The allowed set must be identical, not just close: a filtered token has probability 0.
        assert torch.equal(ours[i] > 0, ref > 0), f"row {i} ({p}): different allowed tokens"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vocab", [64, 1000])
def test_mixed_batch_matches_hf_row_by_row(seed: int, vocab: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [SamplingParams(**kw) for kw in ROW_PARAMS]
    rng.shuffle(params)
    prompts, outputs = _histories(rng, len(params), vocab)
    # A spread of scales: flat rows make top-p keep many tokens, peaky rows only a few.
    scale = torch.tensor([0.5, 1.0, 3.0, 6.0]).repeat(len(params))[: len(params), None]
    logits = torch.randn(len(params), vocab) * scale
    _assert_matches_hf(logits, params, prompts, outputs, [EOS] * len(params))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_mixed_batch_on_cuda_matches_hf_on_cpu(seed: int) -> None:
    """Same pipeline on the GPU; HF runs on the CPU, so reductions round differently (1e-5)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [SamplingParams(**kw) for kw in ROW_PARAMS]
    prompts, outputs = _histories(rng, len(params), 50_000)
    logits = torch.randn(len(params), 50_000) * 4
    _assert_matches_hf(logits, params, prompts, outputs, [EOS] * len(params), device="cuda", atol=1e-5)


def test_large_vocab_batch_matches_hf() -> None:
    torch.manual_seed(11)
    params = [SamplingParams(**kw) for kw in ROW_PARAMS[:8]]
    prompts, outputs = _histories(random.Random(11), len(params), 32_000)
    logits = torch.randn(len(params), 32_000) * 4
    _assert_matches_hf(logits, params, prompts, outputs, [EOS] * len(params))


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.875, 0.90625, 0.25, 0.999])
def test_top_p_boundary_matches_hf(top_p: float) -> None:
    """Probabilities whose cumulative sums land exactly on 1 - top_p (dyadic values are exact in
    float32): HF removes a token whose ascending cumulative mass equals 1 - top_p, i.e. it keeps the
    smallest set with mass >= top_p. We must keep exactly the same set."""
    probs = torch.tensor([16, 8, 4, 2, 1, 1 / 2, 1 / 4, 1 / 4], dtype=torch.float64) / 32
    logits = probs.log().float().view(1, -1)
    p = SamplingParams(top_p=top_p)
    info = SamplingBatchInfo.build([p], [[]], [[]], [[]], logits.shape[1], "cpu")
    ours = Sampler().processed_probs(logits, info)[0]
    ref = hf_probs(logits[0], p, [], [], [])
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_top_p_always_keeps_the_best_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    info = SamplingBatchInfo.build([SamplingParams(top_p=1e-6)], [[]], [[]], [[]], 4, "cpu")
    ours = Sampler().processed_probs(logits, info)[0]
    assert ours.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
    for params in (SamplingParams(top_k=2), SamplingParams(top_k=2, top_p=0.999)):
        info = SamplingBatchInfo.build([params], [[]], [[]], [[]], 6, "cpu")
        ours = Sampler().processed_probs(logits, info)[0]
        ref = hf_probs(logits[0], params, [], [], [])
        assert (ours > 0).tolist() == [False, True, True, True, True, False]
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Property: every sampled token is one HF would allow.

_row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 2, 5, 30]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 40), batch=st.integers(1, 4))
def test_sampled_tokens_are_in_the_allowed_set(data: st.DataObject, vocab: int, batch: int) -> None:
    params = data.draw(st.lists(_row_params, min_size=batch, max_size=batch))
    rows = data.draw(
        st.lists(
            st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab, unique=True),
            min_size=batch,
            max_size=batch,
        )
    )
    logits = torch.tensor(rows, dtype=torch.float32)
    # Tied scores after temperature make "the" top-p set depend on sort order; HF would be as
    # arbitrary there as we are, so such draws say nothing.
    for i, p in enumerate(params):
        scaled = logits[i] / p.temperature
        assume(torch.unique(scaled).numel() == vocab)
    info = SamplingBatchInfo.build(params, [[]] * batch, [[]] * batch, [[]] * batch, vocab, "cpu")
    allowed = [
        (hf_scores(logits[i], p, [], [], []) > float("-inf")) if not p.is_greedy else None for i, p in enumerate(params)
    ]
    sampler = Sampler()
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    for _ in range(8):
        ids = sampler.sample(logits, info).next_token_ids.tolist()
        for i, p in enumerate(params):
            if p.is_greedy:
                assert ids[i] == int(logits[i].argmax())
            else:
                assert bool(allowed[i][ids[i]]), f"row {i} ({p}) sampled filtered token {ids[i]}"
