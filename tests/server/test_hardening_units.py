"""Units behind the HTTP hardening: the JSON body checks, int64 sampling bounds and choice seeds,
fair admission's round-robin order, the API keys from the environment, and the new config keys'
range checks."""

from __future__ import annotations

import json
import sys

import pytest

from framework.config.loader import resolve_config, to_yaml
from framework.errors import ConfigError
from framework.sampling.params import INT64_MAX, INT64_MIN, SamplingParams, choice_seed
from framework.scheduler.prefill_planner import round_robin_by_group
from framework.scheduler.request import Req
from framework.server.errors import APIError
from framework.server.json_body import parse_json_body


def _error(body: bytes, depth: int = 64) -> APIError:
    with pytest.raises(APIError) as info:
        parse_json_body(body, depth)
    assert info.value.status == 400
    return info.value


def test_valid_json_passes_unchanged() -> None:
    value = {"a": [1, 2.5, "x\u00e9\U0001f600", None, True], "b": {"c": [[-(2**64) + 1, 2**64 - 1]]}}
    assert parse_json_body(json.dumps(value).encode(), 64) == value


@pytest.mark.parametrize(("body", "code", "param"), [
    (b'{"a": NaN}', "invalid_json", None),
    (b'{"a": -Infinity}', "invalid_json", None),
    (b'{"a": 1e400}', "invalid_json", None),
    (b'{"a": ' + b"7" * 4301 + b"}", "invalid_json", None),
    (b'{"a": {"b": [1, 18446744073709551616]}}', "invalid_value", "a.b.1"),
    (b'{"a": [1, -18446744073709551616]}', "invalid_value", "a.1"),
    (b'{"a": "\\ud800"}', "invalid_unicode", "a"),
    (b'{"a": ["ok", "x\\udfffy"]}', "invalid_unicode", "a.1"),
    (b'{"\\ud800": 1}', "invalid_unicode", None),
    (b'{"a": {"\\ud800": 1}}', "invalid_unicode", "a"),
    (b"\xff\xfe", "invalid_json", None),
    (b"[" * 200_000, "json_too_deep", None),
])
def test_hostile_json_is_a_400(body: bytes, code: str, param: str | None) -> None:
    err = _error(body)
    assert err.code == code, err.message
    assert err.param == param, err.message


def test_depth_limit_counts_arrays_and_objects() -> None:
    assert parse_json_body(b'{"a": [[1]]}', 3) == {"a": [[1]]}
    err = _error(b'{"a": [[[1]]]}', 3)
    assert err.code == "json_too_deep" and err.param == "a.0.0"
    # Deep enough to overflow a recursive checker, shallow enough for the C parser.
    nested = b"[" * 900 + b"]" * 900
    assert _error(nested, 64).code == "json_too_deep"
    assert sys.getrecursionlimit() >= 1000


def test_sampling_integers_must_fit_int64() -> None:
    SamplingParams(seed=INT64_MAX, top_k=INT64_MAX).validate(100)
    SamplingParams(seed=INT64_MIN).validate(100)
    for field, value in [("seed", INT64_MAX + 1), ("seed", INT64_MIN - 1), ("top_k", 2**70),
                         ("min_new_tokens", 2**63), ("n", 2**64)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value}).validate(100)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400).validate(100)


def test_choice_seeds_stay_in_int64_and_distinct() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    top = [choice_seed(INT64_MAX, i) for i in range(3)]
    assert top == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    assert all(INT64_MIN <= s <= INT64_MAX for s in top) and len(set(top)) == 3


def _req(rid: str, group: str | None) -> Req:
    return Req(rid=rid, input_ids=[1], sampling_params=SamplingParams(), group=group)


def test_round_robin_by_group_interleaves_and_keeps_order() -> None:
    batch = [_req(f"a{i}", "A") for i in range(4)]
    later = [_req("b0", "B"), _req("c0", None), _req("b1", "B")]
    ordered = round_robin_by_group(batch + later)
    assert [r.rid for r in ordered] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    singles = [_req(f"s{i}", None) for i in range(3)]
    assert round_robin_by_group(singles) == singles


def test_keys_come_from_the_environment_and_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGSERVE_API_KEY", "env-key")
    monkeypatch.setenv("PLUGSERVE_ADMIN_KEY", "env-admin")
    cfg = resolve_config(overrides=["server.admin_key=cli-admin"], validate_components=False)
    assert cfg.server.api_key == "env-key"
    assert cfg.server.admin_key == "cli-admin"  # an explicit key wins over the environment
    shown = to_yaml(cfg)
    assert "env-key" not in shown and "cli-admin" not in shown and "<redacted>" in shown
    monkeypatch.setenv("PLUGSERVE_API_KEY", "")
    assert resolve_config(validate_components=False).server.api_key is None


@pytest.mark.parametrize("override", [
    "server.max_json_depth=1", "server.max_json_depth=100000", "server.max_n=0", "server.max_n=5000",
    "server.max_sequences_per_request=0", "server.max_connections=0", "server.header_read_timeout_s=0",
    "server.body_read_timeout_s=-1", "server.keep_alive_timeout_s=0", "server.shutdown_timeout_s=-1",
])
def test_limit_keys_are_range_checked(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config(overrides=[override], validate_components=False)
