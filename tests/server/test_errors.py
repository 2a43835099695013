"""Bad input gets OpenAI's error shape and a 4xx, auth is enforced, and the server survives it all."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MAX_BODY, MAX_N, MAX_TOP_LOGPROBS

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello world " * 700  # well over the tiny model's 1024-token context


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


CASES = [
    # (id, route, body, status, param)
    ("wrong type max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("wrong type prompt", COMP, {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("wrong type messages", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("bool as n", COMP, {"model": MODEL, "prompt": "x", "n": True}, 400, "n"),
    ("missing model", COMP, {"prompt": "x"}, 400, "model"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("bad role", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("unknown field", COMP, {"model": MODEL, "prompt": "x", "max_token": 5}, 400, "max_token"),
    ("unknown chat field", CHAT, {"model": MODEL, "messages": MSGS, "temprature": 0.5}, 400, "temprature"),
    ("negative max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("oversized max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("oversized chat max_tokens", CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),
    ("prompt over context", COMP, {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 1}, 400, "prompt"),
    ("prompt + max_tokens over context", COMP, {"model": MODEL, "prompt": "hello " * 300, "max_tokens": 1000},
     400, "max_tokens"),
    ("n over limit", COMP, {"model": MODEL, "prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ("n zero", COMP, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("logprobs over limit", COMP, {"model": MODEL, "prompt": "x", "logprobs": MAX_TOP_LOGPROBS + 1}, 400,
     "logprobs"),
    ("top_logprobs over limit", CHAT, {"model": MODEL, "messages": MSGS, "logprobs": True,
                                       "top_logprobs": MAX_TOP_LOGPROBS + 1}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 1}, 400,
     "top_logprobs"),
    ("temperature negative", COMP, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p zero", CHAT, {"model": MODEL, "messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", COMP, {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("token id out of range", COMP, {"model": MODEL, "prompt": [1, 10**7]}, 400, "prompt"),
    ("stream_options without stream", COMP, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("tool without a name", CHAT, {"model": MODEL, "messages": MSGS, "tools": [{"type": "function"}]}, 400,
     "tools.0.function.name"),
    ("tool_choice auto without a parser", CHAT, {"model": MODEL, "messages": MSGS, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("image part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0"),
    ("image to a text-only model", "/generate", {"text": "x", "image_data": "AAAA"}, 400, "image_data"),
    ("images on completions", COMP, {"model": MODEL, "prompt": "x", "image_data": "AAAA"}, 400, "image_data"),
    ("logit_bias out of range", COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("logit_bias bad token", CHAT, {"model": MODEL, "messages": MSGS, "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("generate: no prompt", "/generate", {"sampling_params": {}}, 400, "text"),
    ("generate: unknown sampling param", "/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, 400,
     None),
    ("generate: bad sampling value", "/generate", {"text": "x", "sampling_params": {"top_k": -5}}, 400, "top_k"),
    ("generate: prompt over context", "/generate", {"input_ids": list(range(1, 200)) * 6}, 400, "input_ids"),
    ("generate: unknown field", "/generate", {"text": "x", "foo": 1}, 400, "foo"),
    ("generate: batch length mismatch", "/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400,
     "sampling_params"),
    ("abort: nothing to abort", "/abort_request", {}, 400, "rid"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_requests(e2e, http: httpx.Client, route: str, body: dict, status: int, param: str | None) -> None:
    headers = e2e.headers(admin=route == "/abort_request")
    assert_error(http.post(route, json=body, headers=headers), status, param)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(http: httpx.Client, stream: bool) -> None:
    r = http.post(CHAT, json={"model": "gpt-4", "messages": MSGS, "stream": stream})
    assert_error(r, 404, "model", "model_not_found")


@pytest.mark.parametrize("route", [COMP, CHAT, "/generate"])
def test_invalid_json(http: httpx.Client, route: str) -> None:
    r = http.post(route, content=b'{"model": "tiny-llama", "prompt": ', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    assert_error(http.post(route, json=[1, 2]), 400, code="invalid_json")


def test_body_too_large_is_413(http: httpx.Client) -> None:
    r = http.post(COMP, json={"model": MODEL, "prompt": "x" * (MAX_BODY + 10)})
    assert_error(r, 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    assert_error(http.post(COMP, content=chunks()), 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get(COMP), 405)


def test_api_key_required(e2e) -> None:
    with httpx.Client(base_url=e2e.url, timeout=30) as anon:
        for method, path in [("POST", COMP), ("POST", CHAT), ("POST", "/generate"), ("GET", "/v1/models"),
                             ("GET", "/server_info"), ("GET", "/get_load"), ("GET", "/model_info"),
                             ("GET", "/health_generate")]:
            r = anon.request(method, path, json={})
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = anon.post(COMP, json={"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401)
        assert anon.get("/health").status_code == 200  # probes need no key
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/openapi.json").status_code == 200


def test_admin_key_required(e2e) -> None:
    with httpx.Client(base_url=e2e.url, timeout=30) as anon:
        for headers in ({}, e2e.headers(admin=False)):  # the api_key is not the admin key
            assert_error(anon.post("/flush_cache", headers=headers), 401)
            assert_error(anon.post("/abort_request", json={"rid": "x"}, headers=headers), 401)
        ok = anon.post("/abort_request", json={"rid": "nothing"}, headers=e2e.headers(admin=True))
        assert ok.status_code == 200 and ok.json()["success"] is False


def test_server_still_serves_after_errors(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "still alive?", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) <= 3
