"""SGLang's ``/generate`` over HTTP, abort and flush, and parity with the in-process Engine."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import engine_overrides, sse_events

PROMPT = "All the world's a stage"
LONG = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0.0}


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def test_generate_text(http: httpx.Client) -> None:
    body = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy(5)}).json()
    assert isinstance(body["text"], str) and len(body["output_ids"]) == 5
    meta = body["meta_info"]
    assert {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"} <= set(meta)
    assert meta["completion_tokens"] == 5 and meta["finish_reason"] == {"type": "length"}
    assert meta["e2e_latency"] > 0


def test_generate_input_ids_and_batch(http: httpx.Client, tiny_model) -> None:
    ids = AutoTokenizer.from_pretrained(tiny_model).encode(PROMPT)
    by_text = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy(4)}).json()
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": greedy(4)}).json()
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt again: a prefix-cache hit
    batch = http.post("/generate", json={"text": [PROMPT, "Hello"], "sampling_params": [greedy(4), greedy(2)]})
    results = batch.json()
    assert [len(r["output_ids"]) for r in results] == [4, 2]
    assert results[0]["output_ids"] == by_text["output_ids"]
    n2 = http.post("/generate", json={"input_ids": [ids, ids[:3]], "sampling_params": {**greedy(3), "n": 2}}).json()
    assert len(n2) == 4 and n2[0]["output_ids"] == n2[1]["output_ids"]


def test_generate_stream(http: httpx.Client) -> None:
    full = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy(8)}).json()
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": greedy(8), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths)  # SGLang streams the text and ids so far


def test_generate_logprobs(http: httpx.Client) -> None:
    body = http.post("/generate", json={
        "text": PROMPT, "sampling_params": greedy(4), "return_logprob": True, "top_logprobs_num": 2,
        "logprob_start_len": 0, "return_text_in_logprobs": True,
    }).json()
    meta = body["meta_info"]
    out = meta["output_token_logprobs"]
    assert [t for _, t, _ in out] == body["output_ids"]
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in out)
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None


def test_outputs_equal_the_in_process_engine(http: httpx.Client, oai, tiny_model) -> None:
    from framework import Engine

    engine = Engine(overrides=[*engine_overrides(tiny_model), "device.num_threads=1"], progress=False)
    try:
        for params in (greedy(12), {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}):
            expected = engine.generate(PROMPT, params)
            got = http.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
            assert got["output_ids"] == expected["output_ids"], params
            assert got["text"] == expected["text"]
        expected = engine.generate("Hello", greedy(10))
        completion = oai.completions.create(model="tiny-llama", prompt="Hello", max_tokens=10, temperature=0.0,
                                            extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected["text"]
        assert engine.leak_report()["leaked"] == 0
    finally:
        del engine


def test_abort_request_and_flush_while_busy(e2e, http: httpx.Client) -> None:
    events: list = []

    def stream() -> None:
        body = {"text": PROMPT, "sampling_params": LONG, "stream": True, "rid": "abort-me"}
        with http.stream("POST", "/generate", json=body) as r:
            events.extend(sse_events(r))

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        load = http.get("/get_load").json()[0]
        if load["num_running"] >= 1:
            break
        time.sleep(0.05)
    busy = http.post("/flush_cache", headers=e2e.headers(admin=True))
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy"
    aborted = http.post("/abort_request", json={"rid": "abort-me"}, headers=e2e.headers(admin=True))
    assert aborted.status_code == 200 and aborted.json() == {"success": True, "aborted": ["abort-me"]}
    thread.join(60)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-2]["output_ids"]) < LONG["max_new_tokens"]
    missing = http.post("/abort_request", json={"rid": "abort-me"}, headers=e2e.headers(admin=True))
    assert missing.json()["success"] is False
    flushed = http.post("/flush_cache", headers=e2e.headers(admin=True))
    assert flushed.status_code == 200, flushed.text


@pytest.mark.parametrize("stream", [False, True])
def test_batch_queue_full_is_503_with_retry_after(http: httpx.Client, stream: bool) -> None:
    from tests.server.conftest import MAX_QUEUED

    body = {"text": [f"prompt {i}" for i in range(MAX_QUEUED + 4)], "sampling_params": greedy(1), "stream": stream}
    r = http.post("/generate", json=body)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
