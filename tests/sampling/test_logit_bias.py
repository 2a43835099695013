"""``logit_bias`` in the batched sampler, against a plain torch reference computed row by row."""

from __future__ import annotations

import pytest
import torch

from framework.sampling.params import SamplingParams
from framework.sampling.sampler import Sampler, SamplingBatchInfo

V = 97


def _info(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatchInfo:
    n = len(params)
    outs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingBatchInfo.build(params, [[] for _ in range(n)], outs, [[0] for _ in range(n)], V, "cpu")


def _reference_probs(logits: torch.Tensor, bias: dict[int, float], temperature: float) -> torch.Tensor:
    """softmax((logits + bias) / T) for one row, written out with a dense bias vector."""
    dense = torch.zeros(V, dtype=torch.float64)
    for token, value in bias.items():
        dense[token] += value
    return torch.softmax((logits.double() + dense) / temperature, dim=-1)


def test_bias_matches_the_torch_reference_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    biases = [{3: 5.0, 7: -2.5}, {}, {11: 1.25, 0: -100.0, 96: 0.5}, {50: 100.0}]
    params = [SamplingParams(temperature=0.7, logit_bias={str(k): v for k, v in b.items()}) for b in biases]
    probs = Sampler().processed_probs(logits, _info(params))
    for row, bias in enumerate(biases):
        ref = _reference_probs(logits[row], bias, 0.7).float()
        torch.testing.assert_close(probs[row], ref, rtol=1e-5, atol=1e-7)
    # the unbiased row really is unbiased, and the biased rows really moved
    assert not torch.allclose(probs[0], torch.softmax(logits[0] / 0.7, -1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.7, -1))


def test_plus_100_forces_and_minus_100_bans() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, V)
    forced = [(i * 7) % V for i in range(32)]
    banned_params = []
    for i in range(32):
        banned_params.append(SamplingParams(temperature=1.0, seed=i, logit_bias={int(logits[32 + i].argmax()): -100}))
    params = [SamplingParams(temperature=1.0, seed=i, logit_bias={str(t): 100}) for i, t in enumerate(forced)]
    params += banned_params
    out = Sampler().sample(logits, _info(params)).next_token_ids.tolist()
    assert out[:32] == forced
    for i in range(32):
        assert out[32 + i] != int(logits[32 + i].argmax())
    # greedy: the ban moves argmax to the runner-up
    greedy = Sampler().sample(logits[:1], _info([SamplingParams(temperature=0.0,
                                                                logit_bias={int(logits[0].argmax()): -100})]))
    assert int(greedy.next_token_ids[0]) == int(logits[0].topk(2).indices[1])


def test_bias_does_not_change_logprobs_or_the_input() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100}), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, _info(params))
    assert torch.equal(logits, before)
    assert int(out.next_token_ids[0]) == 5
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits[0], -1)[5])


def test_min_new_tokens_mask_wins_over_a_positive_bias_on_eos() -> None:
    logits = torch.zeros(1, V)
    params = [SamplingParams(temperature=0.0, min_new_tokens=3, logit_bias={0: 100})]
    out = Sampler().sample(logits, _info(params, outputs=[[5]]))
    assert int(out.next_token_ids[0]) != 0


def test_rows_survive_filter_and_merge() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logit_bias={1: 100}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={2: 100})]
    info = _info(params)
    kept = info.filter([2, 0])
    assert Sampler().sample(logits[[2, 0]], kept).next_token_ids.tolist() == [2, 1]
    merged = kept.merge(_info([SamplingParams(temperature=0.0, logit_bias={9: 100})]))
    assert Sampler().sample(logits, merged).next_token_ids.tolist() == [2, 1, 9]


def test_round_trip_through_to_dict_keeps_the_bias() -> None:
    p = SamplingParams(logit_bias={"12": -3, 4: 2.5})
    assert p.logit_bias == {12: -3.0, 4: 2.5}
    again = SamplingParams.from_dict(p.to_dict())
    assert again.logit_bias == p.logit_bias
    assert all(isinstance(k, str) for k in p.to_dict()["logit_bias"])  # JSON-safe


@pytest.mark.parametrize(("bias", "message"), [
    ({"x": 1}, "logit_bias keys must be integer token ids"),
    ({"1": "a"}, "logit_bias values must be numbers"),
    ({"1": True}, "logit_bias values must be numbers"),
    ({str(V): 1}, f"logit_bias token id {V} is out of range [0, {V})"),
    ({"-1": 1}, "logit_bias token id -1 is out of range"),
    ({"1": 100.5}, "logit_bias for token 1 must be in [-100, 100]"),
    ({"1": float("nan")}, "logit_bias for token 1 must be in [-100, 100]"),
])
def test_invalid_bias_names_the_field(bias: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(logit_bias=bias).validate(V)
    assert str(err.value).startswith(message), str(err.value)
