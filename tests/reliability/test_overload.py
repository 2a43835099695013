"""Overload and disconnects against a real server (issue "Reliability and security", items 2-3).

A server with a tiny running cap and a KV budget that forces retraction gets twice as many
concurrent streaming requests as it can run: each must finish with the in-process Engine's greedy
output. Then 100 streams are dropped at random points: afterwards no page or row leaks and the
server serves normally.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator

import httpx
import pytest

from framework import Engine
from tests.server.conftest import Server, assert_no_leak, start_server

MAX_RUNNING = 4
KV = ["kv_cache.max_total_tokens=112", f"scheduler.max_running_requests={MAX_RUNNING}",
      "scheduler.init_new_token_ratio=0.0", "scheduler.min_new_token_ratio=0.0"]
PARAMS = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randint(10, 36))] for _ in range(n)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("overload"), [f"model.path={tiny_model}", *KV])
    yield srv
    srv.stop()


def stream_generate(url: str, ids: list[int], params: dict, stop_after: int | None = None) -> list[int]:
    """Stream /generate; return the final output ids (or stop reading after ``stop_after`` events)."""
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    out: list[int] = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for i, line in enumerate(resp.iter_lines()):
            if stop_after is not None and i >= stop_after:
                return out  # leaving the with-block closes the connection mid-stream
            if not line or line == "data: [DONE]":
                continue
            out = json.loads(line[len("data: "):])["output_ids"]
    return out


@pytest.mark.timeout(300)
def test_twice_the_running_cap_with_retraction_gives_exact_greedy_output(server, tiny_model):
    batch = prompts(2 * MAX_RUNNING)
    engine = Engine(overrides=[f"model.path={tiny_model}", "kv_cache.max_total_tokens=4096",
                               "device.num_threads=1"], progress=False)
    expected = [engine.generate(p, PARAMS)["output_ids"] for p in batch]
    results: list[list[int] | BaseException] = [[] for _ in batch]

    def run(i: int) -> None:
        try:
            results[i] = stream_generate(server.url, batch[i], PARAMS)
        except BaseException as exc:  # reported below, with the request it belongs to
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert results == expected
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert info["load"]["num_retractions"] > 0, "the KV budget did not force a retraction"
    assert_no_leak(server)


@pytest.mark.timeout(300)
def test_100_random_disconnects_leak_nothing(server):
    rng = random.Random(7)
    batch = prompts(100, seed=11)
    lock = threading.Semaphore(8)  # bounded concurrency: 8 clients at a time

    def run(ids: list[int]) -> None:
        with lock:
            stream_generate(server.url, ids, {**PARAMS, "max_new_tokens": 40}, stop_after=rng.randint(0, 12))

    threads = [threading.Thread(target=run, args=(p,)) for p in batch]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert_no_leak(server)
    # and it still serves, correctly
    out = httpx.post(f"{server.url}/generate", json={"input_ids": batch[0], "sampling_params": PARAMS},
                     timeout=120).json()
    assert len(out["output_ids"]) == PARAMS["max_new_tokens"]
    assert_no_leak(server)
