"""Hostile input against the main server: out-of-range integers, lone surrogates, deep nesting,
huge digit strings, ``max_tokens`` 0, too many sequences, the body limit on every route,
Content-Type (malformed HTTP: test_connections.py, on both HTTP protocols). Each case is a 4xx
in OpenAI's shape, and nothing stays registered:
the HTTP process tracks no request afterwards and a request id used in a refused request can be
used again at once."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MAX_BODY, Server, wait_idle
from tests.server.test_errors import assert_error

MODEL = "tiny-llama"
COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
GEN = "/generate"
MSGS = [{"role": "user", "content": "hi"}]
BIG = 2**70


def _no_request_left(server: Server) -> None:
    info = wait_idle(server)
    assert info["active_requests"] == 0, info


# -- 1. integers out of range -------------------------------------------------------------------

RANGE_CASES = [
    ("seed 2**64", COMP, {"model": MODEL, "prompt": "x", "seed": 2**64}, "seed"),
    ("seed below int64", COMP, {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("seed 2**64-1 n=2", COMP, {"model": MODEL, "prompt": "x", "seed": 2**64 - 1, "n": 2}, "seed"),
    ("chat seed 2**64", CHAT, {"model": MODEL, "messages": MSGS, "seed": 2**64}, "seed"),
    ("top_k 2**70", COMP, {"model": MODEL, "prompt": "x", "top_k": BIG}, "top_k"),
    ("top_k 2**70 stream", COMP, {"model": MODEL, "prompt": "x", "top_k": BIG, "stream": True}, "top_k"),
    ("generate top_k 2**70", GEN, {"text": "x", "sampling_params": {"top_k": BIG}}, "sampling_params.top_k"),
    ("generate top_k 2**63", GEN, {"text": "x", "sampling_params": {"top_k": 2**63}}, "top_k"),
    ("generate seed 2**63", GEN, {"text": "x", "sampling_params": {"seed": 2**63, "n": 2}}, "seed"),
    ("generate top_k stream", GEN, {"text": "x", "stream": True, "sampling_params": {"top_k": 2**63}}, "top_k"),
    ("bootstrap_room 2**70", COMP, {"model": MODEL, "prompt": "x", "bootstrap_room": BIG}, "bootstrap_room"),
    ("generate bootstrap_room 2**63", GEN, {"text": "x", "bootstrap_room": 2**63}, "bootstrap_room"),
    ("logprob_start_len 2**70", GEN, {"text": "x", "logprob_start_len": BIG}, "logprob_start_len"),
    ("logprob_start_len 2**63", GEN, {"text": "x", "return_logprob": True, "logprob_start_len": 2**63},
     "logprob_start_len"),
    ("min_tokens 2**63", COMP, {"model": MODEL, "prompt": "x", "min_tokens": 2**63}, "min_tokens"),
    ("stop_token_ids 2**63", COMP, {"model": MODEL, "prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids.0"),
    ("temperature 2**63 as int", GEN, {"text": "x", "sampling_params": {"temperature": 2**63 - 1,
                                                                          "max_new_tokens": 1}}, None),
]


@pytest.mark.parametrize(("route", "body", "param"), [c[1:] for c in RANGE_CASES], ids=[c[0] for c in RANGE_CASES])
def test_out_of_range_integer_is_400_and_leaves_nothing(e2e: Server, http: httpx.Client, route: str, body: dict,
                                                        param: str | None) -> None:
    rid = f"range-{abs(hash(json.dumps(body))) % 10**9}"
    refused = http.post(route, json={**body, "rid": rid})
    if param is None:  # a huge but valid number: served
        assert refused.status_code == 200, refused.text
    else:
        err = assert_error(refused, 400)
        assert param.split(".")[-1] in (err["param"] or "") + err["message"], err
    _no_request_left(e2e)
    # The rid is free again at once (a leaked registration refused it forever).
    ok = http.post(GEN, json={"text": "x", "rid": rid, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200, ok.text


def test_seed_at_the_top_of_int64_serves_n_choices(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "seed", "seed": 2**63 - 1, "n": 2, "max_tokens": 4, "temperature": 1.0}
    first = http.post(COMP, json=body)
    assert first.status_code == 200, first.text
    again = http.post(COMP, json=body)
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


# -- 2. lone surrogates --------------------------------------------------------------------------

SURROGATE = "\\ud800"
SURROGATE_CASES = [
    ("prompt", COMP, '{"model": "tiny-llama", "prompt": "a%sb"}', "prompt"),
    ("prompt list", COMP, '{"model": "tiny-llama", "prompt": ["ok", "%s"]}', "prompt.1"),
    ("echo", COMP, '{"model": "tiny-llama", "prompt": "%s", "echo": true, "max_tokens": 1}', "prompt"),
    ("chat content", CHAT, '{"model": "tiny-llama", "messages": [{"role": "user", "content": "%s"}]}',
     "messages.0.content"),
    ("generate text", GEN, '{"text": "%s"}', "text"),
    ("model", COMP, '{"model": "x%s", "prompt": "a"}', "model"),
    ("rid", COMP, '{"model": "tiny-llama", "prompt": "a", "rid": "r%s"}', "rid"),
    ("stop", COMP, '{"model": "tiny-llama", "prompt": "a", "stop": ["%s"]}', "stop.0"),
    ("generate stop", GEN, '{"text": "a", "sampling_params": {"stop": "%s"}}', "sampling_params.stop"),
    ("key", GEN, '{"text": "a", "sampling_params": {"%s": 1}}', "sampling_params"),
    ("abort rid", "/abort_request", '{"rid": "%s"}', "rid"),
]


@pytest.mark.parametrize(("route", "template", "param"), [c[1:] for c in SURROGATE_CASES],
                         ids=[c[0] for c in SURROGATE_CASES])
def test_lone_surrogate_is_400(e2e: Server, http: httpx.Client, route: str, template: str, param: str) -> None:
    r = http.post(route, content=(template % SURROGATE).encode(), headers={
        "content-type": "application/json", **e2e.headers(admin=route == "/abort_request")})
    err = assert_error(r, 400, param, "invalid_unicode")
    assert "surrogate" in err["message"]
    _no_request_left(e2e)


def test_abort_all_still_works_after_surrogates(e2e: Server, http: httpx.Client) -> None:
    http.post(COMP, content=b'{"model": "tiny-llama", "prompt": "a", "rid": "\\udfff"}',
              headers={"content-type": "application/json"})
    r = http.post("/abort_request", json={"abort_all": True}, headers=e2e.headers(admin=True))
    assert r.status_code == 200, r.text


def test_valid_astral_characters_are_fine(http: httpx.Client) -> None:
    # A correctly paired surrogate escape is one character (U+1F600), not a lone surrogate.
    r = http.post(GEN, content=b'{"text": "smile \\ud83d\\ude00", "sampling_params": {"max_new_tokens": 1}}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# -- 3. and 4. nesting and digit strings ----------------------------------------------------------


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


NESTING_CASES = [
    ("60k brackets", COMP, "[" * 60_000),  # the main server's body limit is 64 KiB
    ("prompt 2000 deep", COMP, '{"model": "tiny-llama", "prompt": ' + _nested(2000) + "}"),
    ("chat extra field 900 deep", CHAT,
     '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x", "extra": ' + _nested(900) + "}]}"),
    ("generate sampling 600 deep", GEN, '{"text": "x", "sampling_params": {"stop": ' + _nested(600, '"s"') + "}}"),
]


@pytest.mark.parametrize(("route", "raw"), [c[1:] for c in NESTING_CASES], ids=[c[0] for c in NESTING_CASES])
def test_deep_nesting_is_400(e2e: Server, http: httpx.Client, route: str, raw: str) -> None:
    r = http.post(route, content=raw.encode(), headers={"content-type": "application/json"})
    err = assert_error(r, 400, code="json_too_deep")
    assert "nested too deeply" in err["message"]
    _no_request_left(e2e)


def test_moderate_nesting_in_a_chat_extra_field_is_served(http: httpx.Client) -> None:
    raw = '{"model": "tiny-llama", "max_tokens": 1, "messages": [{"role": "user", "content": "x", "extra": %s}]}'
    r = http.post(CHAT, content=(raw % _nested(20)).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", ["max_tokens", "unknown_field", "seed"])
def test_integer_literal_over_4300_digits_is_400(http: httpx.Client, field: str) -> None:
    raw = '{"model": "tiny-llama", "prompt": "x", "' + field + '": ' + "9" * 5000 + "}"
    assert_error(http.post(COMP, content=raw.encode(), headers={"content-type": "application/json"}), 400,
                 code="invalid_json")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_400(http: httpx.Client, literal: str) -> None:
    raw = '{"text": "x", "sampling_params": {"temperature": ' + literal + "}}"
    assert_error(http.post(GEN, content=raw.encode(), headers={"content-type": "application/json"}), 400,
                 code="invalid_json")


# -- 5. max_tokens = 0 ---------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body", "param"), [
    (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 0, "stream": True}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": 0, "stream": True}, "max_completion_tokens"),
])
def test_openai_max_tokens_zero_is_400(http: httpx.Client, route: str, body: dict, param: str) -> None:
    assert_error(http.post(route, json=body), 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_max_tokens_zero_returns_the_prompt(http: httpx.Client, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "to be or not", "max_tokens": 0, "echo": True, "stream": stream}
    r = http.post(COMP, json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        choice = r.json()["choices"][0]
        text = choice["text"]
        assert r.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert text == "to be or not"


def test_generate_max_new_tokens_zero_generates_nothing(http: httpx.Client) -> None:
    r = http.post(GEN, json={"text": "once more unto", "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == [] and body["text"] == ""
    assert body["meta_info"]["completion_tokens"] == 0
    assert body["meta_info"]["finish_reason"] == {"type": "length"}


def test_generate_max_new_tokens_zero_still_scores_the_prompt(http: httpx.Client) -> None:
    ids = [5, 17, 29, 41, 53, 65, 77]
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    zero = http.post(GEN, json={"input_ids": ids, **lp, "sampling_params": {"max_new_tokens": 0}}).json()
    one = http.post(GEN, json={"input_ids": ids, **lp, "sampling_params": {"max_new_tokens": 1,
                                                                         "temperature": 0}}).json()
    assert zero["output_ids"] == [] and len(one["output_ids"]) == 1
    got, ref = zero["meta_info"]["input_token_logprobs"], one["meta_info"]["input_token_logprobs"]
    assert len(got) == len(ids) and got[0][0] is None
    assert [t for _, t in got] == ids
    # The same prompt scored by a request that also generates.
    assert [lp for lp, _ in got[1:]] == pytest.approx([lp for lp, _ in ref[1:]], abs=1e-5)
    tops = [zero["meta_info"]["input_top_logprobs"][1:], one["meta_info"]["input_top_logprobs"][1:]]
    assert [[t for _, t in row] for row in tops[0]] == [[t for _, t in row] for row in tops[1]]
    assert [lp for row in tops[0] for lp, _ in row] == pytest.approx([lp for row in tops[1] for lp, _ in row],
                                                                     abs=1e-5)


# -- 8. prompts x n per request -----------------------------------------------------------------


def test_thousands_of_prompts_in_one_body_are_400_before_tokenizing(e2e: Server, http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": ["a"] * 2000, "n": 16, "max_tokens": 1}
    assert_error(http.post(COMP, json=body), 400, "prompt", "too_many_sequences")
    assert_error(http.post(GEN, json={"text": ["a"] * 300}), 400, "prompt", "too_many_sequences")
    assert_error(http.post(GEN, json={"input_ids": [[1, 2]] * 100, "sampling_params": {"n": 3}}), 400,
                 code="too_many_sequences")
    _no_request_left(e2e)


# -- 9. body limit on every route, Content-Type ----------------------------------


def test_body_limit_applies_to_every_route(e2e: Server) -> None:
    big = b"x" * (MAX_BODY + 1024)
    with httpx.Client(base_url=e2e.url, timeout=30) as client:
        for method, path, admin in [("POST", "/flush_cache", True), ("GET", "/health", False),
                                    ("POST", "/abort_request", True), ("GET", "/v1/models", False)]:
            r = client.request(method, path, content=big, headers=e2e.headers(admin=admin))
            assert_error(r, 413, code="request_too_large")

            def chunks():  # chunked, no Content-Length: refused while reading
                for _ in range(MAX_BODY // 4096 + 2):
                    yield b" " * 4096

            r = client.request(method, path, content=chunks(), headers=e2e.headers(admin=admin))
            assert_error(r, 413, code="request_too_large")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_non_json_content_type_is_415(http: httpx.Client, content_type: str) -> None:
    for route, body in [(GEN, {"text": "x"}), (COMP, {"model": MODEL, "prompt": "x"})]:
        r = http.post(route, content=json.dumps(body).encode(), headers={"content-type": content_type})
        assert_error(r, 415, code="unsupported_media_type")


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_are_accepted(e2e: Server, content_type: str | None) -> None:
    headers = {**e2e.headers(), **({"content-type": content_type} if content_type else {})}
    body = json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 1}}).encode()
    with httpx.Client(base_url=e2e.url, timeout=30) as client:
        request = client.build_request("POST", GEN, content=body, headers=headers)
        if content_type is None:
            request.headers.pop("content-type", None)
        r = client.send(request)
    assert r.status_code == 200, r.text
