"""A second server: a model directory with no tokenizer files, served with
``model.skip_tokenizer_init=true``, the ``priority`` schedule policy and SGLang's metric names.

Ids in, ids out is checked against transformers' greedy generation on the same weights; the
metrics by parsing /metrics with prometheus_client's own text parser.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server, served

NAME = "no-tok"
PROMPT_IDS = [17, 52, 33, 101, 7, 64]


@pytest.fixture(scope="module")
def bare_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint without any tokenizer file."""
    out = tmp_path_factory.mktemp("bare") / "bare-llama"
    out.mkdir()
    for f in tiny_model.iterdir():
        if f.name == "config.json" or f.name == "generation_config.json" or f.suffix == ".safetensors":
            shutil.copy(f, out / f.name)
    assert not any("token" in f.name for f in out.iterdir())
    return out


@pytest.fixture(scope="module")
def server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory.mktemp("no-tokenizer-server"), [
        f"model.path={bare_model}", "model.skip_tokenizer_init=true", f"model.served_model_name={NAME}",
        "kv_cache.max_total_tokens=2048", "scheduler.policy=priority", "server.sglang_metric_names=true",
    ]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_ids_in_ids_out_match_transformers(http: httpx.Client, bare_model: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(bare_model).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT_IDS])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT_IDS):].tolist()
    body = http.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, "return_logprob": True}).json()
    assert body["output_ids"] == ref
    assert body["text"] == ""
    assert [t for _, t in body["meta_info"]["output_token_logprobs"]] == ref
    done = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 6,
                                              "temperature": 0.0, "ignore_eos": True}).json()
    assert done["choices"][0]["text"] == "" and done["usage"]["completion_tokens"] == 6


def test_model_info_says_there_is_no_tokenizer(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["skip_tokenizer_init"] is True and info["priority_scheduling"] is True


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/generate", {"text": "hello"}, "text"),
    ("/generate", {"input_ids": PROMPT_IDS, "return_text_in_logprobs": True}, "return_text_in_logprobs"),
    ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": {"stop": ["x"]}}, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "hello"}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT_IDS, "echo": True}, "echo"),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT_IDS, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/tokenize", {"prompt": "hello"}, "prompt"),
    ("/v1/detokenize", {"tokens": PROMPT_IDS}, "tokens"),
])
def test_what_needs_a_tokenizer_is_a_400_naming_the_field(http: httpx.Client, route: str, body: dict,
                                                          param: str) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param and "skip_tokenizer_init" in err["message"], err


def test_priority_is_accepted_with_the_priority_policy(http: httpx.Client) -> None:
    for priority in (7, -3, None):
        r = http.post("/generate", json={"input_ids": PROMPT_IDS, "priority": priority,
                                         "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 1, "priority": 4})
    assert r.status_code == 200, r.text


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_sglang_metric_names(http: httpx.Client) -> None:
    label = (("model_name", NAME),)
    before = _samples(http.get("/metrics").text)
    r = http.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200
    after = _samples(http.get("/metrics").text)

    def delta(name: str, labels: tuple = label) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("sglang:generation_tokens_total") == 5
    assert delta("sglang:prompt_tokens_total") == len(PROMPT_IDS)
    assert delta("sglang:num_requests_total") == 1
    assert delta("sglang:time_to_first_token_seconds_count") == 1
    assert delta("sglang:e2e_request_latency_seconds_count") == 1
    assert delta("sglang:time_per_output_token_seconds_count") == 1
    assert delta("sglang:inter_token_latency_seconds_count") == 4  # tokens after the first
    # the same observations as plugserve's own names
    assert delta("plugserve_generation_tokens_total", ()) == 5
    assert after[("sglang:e2e_request_latency_seconds_count", label)] == after[
        ("plugserve_e2e_request_latency_seconds_count", ())]
    for gauge in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                  "sglang:num_used_tokens"):
        assert (gauge, label) in after, gauge
    assert after[("sglang:num_running_reqs", label)] == 0 and 0 <= after[("sglang:token_usage", label)] <= 1
    assert after[("sglang:gen_throughput", label)] > 0  # 5 tokens within the last window
