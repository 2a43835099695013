"""Operations routes: health, info, load, metrics, OpenAPI, and the KV leak check after a
client disconnects mid-stream."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import API_KEY, KV_TOKENS, assert_no_leak, wait_idle


def test_health_and_health_generate(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/health_generate").json() == {"status": "ok"}


def test_model_info(http: httpx.Client, tiny_model) -> None:
    info = http.get("/model_info").json()
    assert info["model_path"] == str(tiny_model)
    assert info["served_model_name"] == "tiny-llama" and info["is_generation"] is True
    assert info["context_length"] == 1024 and info["max_total_num_tokens"] == KV_TOKENS
    assert info["architecture"] == "LlamaForCausalLM"


def test_server_info_redacts_keys(e2e, http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    assert info["pid"] == e2e.proc.pid and info["scheduler_pid"] != e2e.proc.pid
    assert info["config"]["server"]["api_key"] == "<redacted>"
    assert info["config"]["server"]["admin_key"] == "<redacted>"
    assert API_KEY not in str(info)
    assert {"total", "free", "evictable", "protected", "req_slots_total", "req_slots_free"} <= set(info["leak_report"])


def test_a_streamed_first_token_is_waited_for_and_delivered(e2e, http: httpx.Client) -> None:
    """``server.first_token_wait_ms`` (5 on the test server, off by default): after the step that
    gives a stream its first token, with more steps due, the scheduler waits for the HTTP process
    to say the token is written (tests/server/test_first_token_wait.py has both halves alone)."""
    before = http.get("/server_info").json()["first_token_waits"]
    body = {"model": "tiny-llama", "prompt": "once upon a time", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert events
    after = http.get("/server_info").json()["first_token_waits"]
    assert after["delivered"] + after["timed_out"] == before["delivered"] + before["timed_out"] + 1
    # In time or not (a loaded machine may take longer than the bound), the answer did come.
    assert after["delivered"] + after["late"] == before["delivered"] + before["late"] + 1


def test_get_load(http: httpx.Client) -> None:
    """SGLang's shape (a list, one entry per data-parallel rank, with the fields sglang-router
    reads) carrying plugserve's own fields too."""
    loads = http.get("/get_load").json()
    assert isinstance(loads, list) and len(loads) == 1
    load = loads[0]
    assert {"num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens", "prefix_cache_hit_rate"} <= set(load)
    assert load["kv_total_tokens"] == KV_TOKENS
    assert load["dp_rank"] == 0
    assert load["num_reqs"] == load["num_running"] + load["num_waiting"]
    assert load["num_waiting_reqs"] == load["num_waiting"]
    assert load["num_tokens"] == load["kv_used_tokens"] + load["num_waiting_tokens"]


def test_sglang_load_counts_waiting_prompts() -> None:
    """``num_tokens`` is what a busy server holds and has queued, as in SGLang's scheduler."""
    from framework.server.ops_routes import sglang_load

    busy = {"num_running": 3, "num_waiting": 2, "num_waiting_tokens": 700, "kv_used_tokens": 1200,
            "kv_total_tokens": 4096}
    entry = sglang_load(busy)
    assert (entry["num_reqs"], entry["num_waiting_reqs"], entry["num_tokens"]) == (5, 2, 1900)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            rest = line[len(name):]
            if rest[:1] in (" ", "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics(http: httpx.Client) -> None:
    before = http.get("/metrics").text
    http.post("/generate", json={"text": "metrics please", "sampling_params": {"max_new_tokens": 4,
                                                                                "ignore_eos": True}})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text
    assert _metric(after, "plugserve_requests_total") == _metric(before, "plugserve_requests_total") + 1
    assert _metric(after, "plugserve_generation_tokens_total") - _metric(before, "plugserve_generation_tokens_total") == 4
    assert _metric(after, "plugserve_prompt_tokens_total") > _metric(before, "plugserve_prompt_tokens_total")
    assert _metric(after, "plugserve_time_to_first_token_seconds_count") > 0
    assert _metric(after, "plugserve_time_per_output_token_seconds_count") > 0
    for gauge in ("plugserve_num_queue_requests", "plugserve_num_running_requests", "plugserve_kv_cache_usage",
                  "plugserve_prefix_cache_hit_rate"):
        assert f"\n{gauge} " in after, gauge


def test_openapi_schema(e2e) -> None:
    doc = httpx.get(f"{e2e.url}/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.")
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert name in doc["components"]["schemas"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"model", "prompt", "max_tokens", "logprobs", "top_k", "rid"} <= set(props)
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["additionalProperties"] is False


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_kv(e2e, http: httpx.Client, route: str) -> None:
    before = _metric(http.get("/metrics").text, "plugserve_requests_total{finish_reason=\"abort\"}")
    if route == "/generate":
        body = {"text": "a long story", "stream": True,
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    else:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a long story"}], "stream": True,
                "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(base_url=e2e.url, headers=e2e.headers(), timeout=60) as client:
        with client.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    info = wait_idle(e2e)
    assert info["load"]["num_running"] == 0
    assert_no_leak(e2e)
    after = _metric(http.get("/metrics").text, "plugserve_requests_total{finish_reason=\"abort\"}")
    assert after == before + 1


def test_disconnect_while_waiting_non_stream(e2e, http: httpx.Client) -> None:
    before = _metric(http.get("/metrics").text, "plugserve_requests_total{finish_reason=\"abort\"}")
    body = {"text": "another long story", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    # The client gives up long before 900 tokens can be ready: each decode step costs at least
    # ~0.3 ms of scheduler and Python work even on the tiny model (0.5 s was once enough margin,
    # until fused decode steps made the tiny model finish 900 tokens inside it on a fast minute).
    with httpx.Client(base_url=e2e.url, headers=e2e.headers(), timeout=httpx.Timeout(30, read=0.1)) as client:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=body)
    assert time.monotonic() - start < 10
    assert_no_leak(e2e)
    after = _metric(http.get("/metrics").text, "plugserve_requests_total{finish_reason=\"abort\"}")
    assert after == before + 1
