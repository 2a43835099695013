"""SamplingParams: validation messages, normalisation, and the JSON / msgpack round trip."""

from __future__ import annotations

import dataclasses
import json
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from framework.sampling.params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("inf")}, "temperature must be finite, got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 or 0 (off) or >= 1, got -2"),
        ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3"),
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        ({"min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens must be <= max_new_tokens (8), got 9"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"stop_token_ids": [5, 100]}, "stop_token_ids must be in [0, 100), got 100"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be in [0, 100), got -1"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings, got ['ok', '']"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer, got 1.5"),
        ({"n": True}, "n must be an integer, got True"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": float("nan")}, "top_p must be a number, got nan"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1"),
        ({"stop": [1]}, "stop must be a string or a list of strings, got [1]"),
        ({"seed": "7"}, "seed must be an integer or null, got '7'"),
    ],
)
def test_validation_names_field_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_valid_edge_values_pass() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, max_new_tokens=0).validate(100)
    SamplingParams(frequency_penalty=-2, presence_penalty=2, stop_token_ids=[0, 99]).validate(100)
    SamplingParams(stop_token_ids=[10**6]).validate()  # no vocabulary: no upper bound


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1, temperature=1.5).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # would overflow float32 logits
    assert not SamplingParams(temperature=0.1).is_greedy
    assert not SamplingParams(top_k=2).is_greedy


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]; known"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams.from_dict({"logprobs": True})  # request-level, not a sampling parameter


def test_from_dict_fills_defaults() -> None:
    assert SamplingParams.from_dict({"temperature": 0.0, "stop": "x"}) == SamplingParams(temperature=0.0, stop=["x"])


_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(0, 4096),
    temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1),
    top_k=st.sampled_from([-1, 1, 50]),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(0.1, 3),
    frequency_penalty=st.floats(-2, 2),
    presence_penalty=st.floats(-2, 2),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 99), max_size=3),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(),
    n=st.integers(1, 4),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
)


@given(params=_params)
def test_dict_round_trip_through_json_and_msgpack(params: SamplingParams) -> None:
    params.validate(vocab_size=100)
    data = params.to_dict()
    assert SamplingParams.from_dict(json.loads(json.dumps(data))) == params
    assert SamplingParams.from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(data))) == params


def test_to_dict_shares_nothing_mutable_with_the_params() -> None:
    """``to_dict`` copies field by field (not ``dataclasses.asdict``): a later change to the dict,
    nested values included, must not reach the params it came from."""
    params = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={5: 1.0},
                            custom_params={"outer": [1, {"inner": 2}]})
    data = params.to_dict()
    data["stop"].append("y")
    data["stop_token_ids"].append(4)
    data["logit_bias"]["6"] = 2.0
    data["custom_params"]["outer"][1]["inner"] = 99
    assert params == SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={5: 1.0},
                                    custom_params={"outer": [1, {"inner": 2}]})
    assert set(data) == {f.name for f in dataclasses.fields(SamplingParams)}
