"""Data parallelism (``parallel.dp_size=2``) behind one real ``plugserve serve``.

Two scheduler processes serve the tiny Llama; the HTTP process balances requests over them. The
references are the in-process Engine's outputs (one replica, no HTTP): greedy tokens must be the
same whichever replica ran them. Each replica must receive work, every control call must reach
every replica, and no replica may leak KV. Killing one replica's scheduler takes the server down.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import (
    ADMIN_KEY,
    Server,
    assert_no_leak,
    engine_overrides,
    replicas,
    sse_events,
    start_server,
)

PROMPTS = ["The quick brown fox", "Once upon a time", "To be or not", "Hello there, general", "A B C D E F",
           "In the beginning"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
# The fault plugin's slow_steps makes each step of these streams last >= 10 ms, so 900 tokens cannot
# finish before the test aborts them, however fast the host runs the tiny model.
LONG = {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True, "custom_params": {"sleep_s": 0.01}}


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _engine_outputs(model: Path, prompts: list[str]) -> list[list[int]]:
    from framework import Engine

    engine = Engine(overrides=[*engine_overrides(model), "device.num_threads=1"], progress=False)
    try:
        return [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    finally:
        del engine


def _generate_all(server: Server, prompts: list[str]) -> list[list[int]]:
    """Every prompt at once (one thread each), so both replicas have requests in flight together."""
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        with server.client() as c:
            r = c.post("/generate", json={"text": prompts[i], "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            out[i] = r.json()["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [out[i] for i in range(len(prompts))]


def _loads(server: Server) -> list[dict]:
    return httpx.get(f"{server.url}/get_load", headers=server.headers(), timeout=30).json()


def _wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def dp_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("dp2"), [
        *engine_overrides(tiny_model), "parallel.dp_size=2", "parallel.load_balance_method=shortest_queue",
        "server.enable_custom_logit_processor=true",
    ], admin_key=ADMIN_KEY)
    try:
        yield server
        assert server.proc.poll() is None, f"the server died:\n{server.log_text()}"
        assert_no_leak(server)
        pids = [r["scheduler_pid"] for r in replicas(httpx.get(f"{server.url}/server_info", timeout=30).json())]
        assert server.stop() == 0, server.log_text()  # SIGTERM: a clean stop of every replica
        assert all(_gone(pid) for pid in pids), f"a scheduler of {pids} outlived the server"
    finally:
        server.stop()


def test_two_replicas_are_reported(dp_server: Server) -> None:
    loads = _loads(dp_server)
    assert [entry["dp_rank"] for entry in loads] == [0, 1]
    for entry in loads:  # SGLang's fields, per replica
        assert entry["num_reqs"] == entry["num_running"] + entry["num_waiting"]
        assert {"num_waiting_reqs", "num_tokens", "kv_total_tokens"} <= entry.keys()
    info = httpx.get(f"{dp_server.url}/server_info", timeout=30).json()
    assert info["dp_size"] == 2 and [r["dp_rank"] for r in info["dp"]] == [0, 1]
    pids = [r["scheduler_pid"] for r in info["dp"]]
    assert len(set(pids)) == 2 and info["scheduler_pid"] == pids[0]  # top level: replica 0, as with dp 1
    assert "leak_report" in info and "model_path" in info


def test_greedy_outputs_equal_the_engine_and_both_replicas_work(dp_server: Server, tiny_model: Path) -> None:
    expected = _engine_outputs(tiny_model, PROMPTS)
    before = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
    assert _generate_all(dp_server, PROMPTS) == expected
    with dp_server.client() as c:  # one at a time: ties in shortest_queue go round-robin
        for prompt, want in zip(PROMPTS[:2], expected[:2], strict=True):
            assert c.post("/generate", json={"text": prompt, "sampling_params": GREEDY}).json()["output_ids"] == want
        # n > 1: the group runs on one replica, every choice equal to the greedy reference
        body = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[0], "n": 3,
                                               "max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        assert body.status_code == 200, body.text
        texts = {choice["text"] for choice in body.json()["choices"]}
        assert len(texts) == 1
    after = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    info = httpx.get(f"{dp_server.url}/server_info", timeout=30).json()
    assert [r["http_in_flight"] for r in replicas(info)] == [0, 0]  # the balancer's counts came back down
    assert_no_leak(dp_server)


def test_data_parallel_rank_picks_the_replica(dp_server: Server, tiny_model: Path) -> None:
    """SGLang's ``data_parallel_rank`` (what sglang-router --dp-aware sends) overrides the balancer."""
    expected = _engine_outputs(tiny_model, PROMPTS[:1])[0]
    for rank in (1, 1, 0):
        before = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
        body = {"text": PROMPTS[0], "sampling_params": GREEDY, "data_parallel_rank": rank}
        r = httpx.post(f"{dp_server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text
        after = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
        assert [a > b for a, b in zip(after, before, strict=True)] == [rank == 0, rank == 1], (rank, before, after)
    chat = httpx.post(f"{dp_server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "data_parallel_rank": 1})
    assert chat.status_code == 200, chat.text
    bad = httpx.post(f"{dp_server.url}/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "x", "max_tokens": 2, "data_parallel_rank": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "data_parallel_rank", bad.text


def test_flush_abort_and_metrics_cover_every_replica(dp_server: Server) -> None:
    admin = dp_server.headers(admin=True)
    events: list[list] = [[], []]

    def stream(i: int) -> None:
        body = {"text": PROMPTS[i], "sampling_params": LONG, "stream": True, "custom_logit_processor": "slow_steps"}
        with httpx.Client(base_url=dp_server.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            events[i].extend(sse_events(r))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # shortest_queue: the second stream goes to the replica that is not running the first
    _wait_until(lambda: [e["num_running"] for e in _loads(dp_server)] == [1, 1], "one stream on each replica")
    metrics = httpx.get(f"{dp_server.url}/metrics", timeout=30).text
    running = re.search(r"^plugserve_num_running_requests(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert running is not None and float(running.group(1)) == 2.0  # summed over replicas
    busy = httpx.post(f"{dp_server.url}/flush_cache", headers=admin, timeout=30)
    assert busy.status_code == 409
    aborted = httpx.post(f"{dp_server.url}/abort_request", json={"abort_all": True}, headers=admin, timeout=30)
    assert aborted.status_code == 200 and len(aborted.json()["aborted"]) == 2
    for t in threads:
        t.join(60)
    for ev in events:
        assert ev[-1] == "[DONE]" and ev[-2]["meta_info"]["finish_reason"]["type"] == "abort", ev[-2:]
    assert_no_leak(dp_server)
    evictable = [r["leak_report"]["evictable"] for r in replicas(httpx.get(f"{dp_server.url}/server_info").json())]
    assert all(e > 0 for e in evictable), evictable  # both replicas cached the aborted prompts
    flushed = httpx.post(f"{dp_server.url}/flush_cache", headers=admin, timeout=30)
    assert flushed.status_code == 200, flushed.text
    evictable = [r["leak_report"]["evictable"] for r in replicas(httpx.get(f"{dp_server.url}/server_info").json())]
    assert evictable == [0, 0]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's architecture with other random weights (a weight update's target)."""
    from framework.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("dp-v1") / "v1", seed=1)


def test_health_generate_runs_on_every_replica(dp_server: Server) -> None:
    before = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
    r = httpx.get(f"{dp_server.url}/health_generate", timeout=60)
    assert r.status_code == 200, r.text
    after = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_weight_update_reaches_every_replica(dp_server: Server, tiny_model: Path, other_model: Path) -> None:
    admin = dp_server.headers(admin=True)
    other = other_model
    missing = httpx.post(f"{dp_server.url}/update_weights_from_disk", headers=admin, timeout=60,
                         json={"model_path": str(other.parent / "missing")})
    assert missing.status_code >= 400 and "dp rank 0" in missing.json()["error"]["message"], missing.text
    try:
        ok = httpx.post(f"{dp_server.url}/update_weights_from_disk", headers=admin, timeout=120,
                        json={"model_path": str(other)})
        assert ok.status_code == 200, ok.text
        expected = _engine_outputs(other, PROMPTS[:4])
        assert expected != _engine_outputs(tiny_model, PROMPTS[:4])  # the update is visible at all
        before = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
        assert _generate_all(dp_server, PROMPTS[:4]) == expected
        after = [entry["prompt_tokens_seen"] for entry in _loads(dp_server)]
        assert all(a > b for a, b in zip(after, before, strict=True))  # both replicas answered
    finally:
        back = httpx.post(f"{dp_server.url}/update_weights_from_disk", headers=admin, timeout=120,
                          json={"model_path": str(tiny_model)})
        assert back.status_code == 200, back.text


def test_a_dead_replica_takes_the_server_down(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tmp_path_factory.mktemp("dp-doomed"), [
        f"model.path={tiny_model}", "kv_cache.max_total_tokens=2048", "parallel.dp_size=2",
        "parallel.load_balance_method=round_robin", "server.enable_custom_logit_processor=true",
    ])
    try:
        pids = [r["scheduler_pid"] for r in httpx.get(f"{server.url}/server_info", timeout=30).json()["dp"]]
        # One short request per replica first (round robin): a replica's first request pays for
        # its warm-up, and a cold replica 1 would let replica 0 finish its whole long request
        # before both run, leaving nothing in flight on the healthy replica to fail.
        for prompt in PROMPTS[2:4]:
            warm = httpx.post(f"{server.url}/generate", timeout=120,
                              json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
            assert warm.status_code == 200, warm.text
        events: list[list] = [[], []]

        def stream(i: int) -> None:
            body = {"text": PROMPTS[i], "sampling_params": LONG, "stream": True, "custom_logit_processor": "slow_steps"}
            with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
                events[i].extend(sse_events(r))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        _wait_until(lambda: [e["num_running"] for e in _loads(server)] == [1, 1], "round robin: one on each")
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        status = None
        while status != 503 and time.monotonic() - killed < 0.8:
            status = httpx.get(f"{server.url}/health", timeout=2).status_code
        assert status == 503
        health = httpx.get(f"{server.url}/health", timeout=2).json()
        assert "dp rank 1" in health["error"]["message"], health
        for t in threads:
            t.join(60)
        for ev in events:  # the healthy replica's request fails too: the whole server goes down
            assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "scheduler_dead", ev[-2:]
        assert server.proc.wait(60) != 0
        assert "dp rank 1: exit code -9" in server.log_text()
        assert _gone(pids[0]), f"replica 0 ({pids[0]}) outlived the server"
    finally:
        server.stop()


def test_trainer_broadcast_reaches_every_replica(dp_server: Server, tiny_model: Path, other_model: Path) -> None:
    """A trainer (this process, rank 0) and both replicas in one gloo group of 3: replica d joins
    as rank_offset + d, and one broadcast updates both."""
    import concurrent.futures as cf

    from safetensors.torch import load_file

    from framework.executor.weight_sync import WeightUpdateGroup
    from tests.server.conftest import free_port

    admin = dp_server.headers(admin=True)
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": "dp-rl", "backend": "gloo"}
    with cf.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(httpx.post, f"{dp_server.url}/init_weights_update_group", json=init, headers=admin,
                             timeout=120)
        group = WeightUpdateGroup("127.0.0.1", port, 0, 3, "dp-rl", "gloo", timeout_s=120)
        assert joined.result().status_code == 200, joined.result().text
    try:
        state = load_file(str(other_model / "model.safetensors"))
        names = sorted(state)
        body = {"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(state[n].shape) for n in names], "group_name": "dp-rl"}
        with cf.ThreadPoolExecutor(1) as pool:  # the route answers once both replicas received it
            call = pool.submit(httpx.post, f"{dp_server.url}/update_weights_from_distributed", json=body,
                               headers=admin, timeout=120)
            group.broadcast([state[n] for n in names], src=0)
            assert call.result().status_code == 200, call.result().text
        expected = _engine_outputs(other_model, PROMPTS[:4])
        for rank in (0, 1):  # each replica, by data_parallel_rank
            for prompt, want in zip(PROMPTS[:4], expected, strict=True):
                body = {"text": prompt, "sampling_params": GREEDY, "data_parallel_rank": rank}
                assert httpx.post(f"{dp_server.url}/generate", json=body, timeout=60).json()["output_ids"] == want
    finally:
        httpx.post(f"{dp_server.url}/destroy_weights_update_group", json={"group_name": "dp-rl"}, headers=admin,
                   timeout=60)
        group.close()
        back = httpx.post(f"{dp_server.url}/update_weights_from_disk", headers=admin, timeout=120,
                          json={"model_path": str(tiny_model)})
        assert back.status_code == 200, back.text


def test_dp2_with_tp2_equals_the_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two replicas of two tensor-parallel ranks each (four scheduler processes): each replica's
    rendezvous is its own, greedy tokens equal the single-rank Engine's, and SIGTERM stops all."""
    server = start_server(tmp_path_factory.mktemp("dp2-tp2"), [
        f"model.path={tiny_model}", "kv_cache.max_total_tokens=2048", "parallel.dp_size=2", "parallel.tp_size=2"])
    try:
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        pids = [pid for r in info["dp"] for pid in r["tp_ranks"].values()]
        assert len(set(pids)) == 4, info["dp"]
        expected = _engine_outputs(tiny_model, PROMPTS[:4])
        assert _generate_all(server, PROMPTS[:4]) == expected
        assert all(entry["prompt_tokens_seen"] > 0 for entry in _loads(server))
        assert_no_leak(server)
        assert server.stop() == 0, server.log_text()
        assert all(_gone(pid) for pid in pids), f"a rank of {pids} outlived the server"
    finally:
        server.stop()
