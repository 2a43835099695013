"""Routers in front of unified servers, end to end with real processes on 127.0.0.1: two
``plugserve serve`` workers behind ``plugserve router --worker-urls`` (round robin, shortest queue,
a dead worker skipped) and behind sglang-router's regular (non-PD) mode, when an interpreter that
has it is found (this one, or ``$SGLANG_ROUTER_PYTHON``).

The reference is the in-process Engine: greedy tokens through a router equal its tokens, both
workers receive work (their own /get_load counters), and neither leaks KV afterwards.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from framework import Engine
from tests.pd.test_router_e2e import sglang_router_python, spawn, wait_for_workers
from tests.server.conftest import Server, assert_no_leak, free_port, sse_events, start_server

pytestmark = pytest.mark.timeout(400)

KV = ["kv_cache.max_total_tokens=4096"]
LONG = {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workload(tiny_model: Path) -> tuple[list[list[int]], list[dict], list[list[int]]]:
    """12 prompts of token ids, their sampling parameters, and the Engine's tokens for them."""
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randrange(2, 40))] for _ in range(12)]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": rng.randrange(2, 10)} for _ in prompts]
    engine = Engine(overrides=[f"model.path={tiny_model}", *KV, "device.num_threads=1"], progress=False)
    try:
        ref = [engine.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)]
    finally:
        del engine
    return prompts, params, ref


@pytest.fixture(scope="module")
def workers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    tmp = tmp_path_factory.mktemp("unified-workers")
    servers: list[Server] = []
    try:
        for _ in range(2):
            servers.append(start_server(tmp, [f"model.path={tiny_model}", *KV]))
        yield servers
        for s in servers:
            assert s.proc.poll() is None, s.log_text()
            assert_no_leak(s)
    finally:
        for s in servers:
            s.stop()


def prompts_seen(server: Server) -> int:
    return sum(entry["prompt_tokens_seen"] for entry in httpx.get(f"{server.url}/get_load", timeout=30).json())


def run_workload(url: str, workload, label: str) -> None:
    """Every request at once (every third streamed): the Engine's tokens for each."""
    prompts, params, ref = workload

    def call(i: int) -> list[int]:
        body = {"input_ids": prompts[i], "sampling_params": params[i]}
        if i % 3 == 2:
            with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as r:
                assert r.status_code == 200, r.read()
                events = sse_events(r)
            assert events[-1] == "[DONE]"
            return [e for e in events if isinstance(e, dict)][-1]["output_ids"]
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(call, range(len(prompts))))
    for i, (g, e) in enumerate(zip(got, ref, strict=True)):
        assert g == e, f"{label}: request {i}: {g} != {e}"
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hello world", "max_tokens": 4,
                                                  "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def wait_listening(server: Server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log_text()
        try:
            httpx.get(f"{server.url}/workers", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the router did not start")


def test_round_robin_matches_the_engine_and_skips_a_dead_worker(workers, workload, tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused, skipped, tried last
    port = free_port()
    router = spawn(["router", "--worker-urls", workers[0].url, dead, workers[1].url, "--policy", "round_robin",
                    "--port", str(port), "--eject-s", "60"], tmp_path / "router-rr.log", port)
    try:
        wait_listening(router)
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503  # one worker is down
        before = [prompts_seen(w) for w in workers]
        run_workload(router.url, workload, "plugserve router round_robin")
        after = [prompts_seen(w) for w in workers]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        sent = {w["url"]: w for w in httpx.get(f"{router.url}/workers", timeout=10).json()}
        assert sent[dead]["sent"] == 0
        counts = [sent[w.url]["sent"] for w in workers]
        assert sum(counts) == len(workload[0]) + 1 and min(counts) >= 4, counts  # close to even
        assert all(w["in_flight"] == 0 for w in sent.values()), sent
        loads = httpx.get(f"{workers[0].url}/get_load", timeout=10).json()
        assert loads[0]["dp_rank"] == 0
        models = httpx.get(f"{router.url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny-llama"
    finally:
        router.stop(timeout=20)


def test_shortest_queue_spreads_long_requests(workers, workload, tmp_path) -> None:
    """A long stream, a short request, a second long stream: round robin would send the second
    stream to the first one's worker, the shortest queue to the other. What is checked is the
    routing itself (the router's per-worker counts while stream 0 is known to be open): polling
    the workers for a moment when both streams run is a race against the streams' end. Should
    stream 0 finish before stream 1 is routed (900 tokens of the tiny model take ~1-2 s), the
    round proves nothing either way and runs again."""
    port = free_port()
    router = spawn(["router", "--worker-urls", workers[0].url, workers[1].url, "--policy", "shortest_queue",
                    "--port", str(port)], tmp_path / "router-sq.log", port)

    def router_counts(key: str) -> list[int]:
        entries = {w["url"]: w[key] for w in httpx.get(f"{router.url}/workers", timeout=10).json()}
        return [entries[w.url] for w in workers]

    def routed_since(before: list[int]) -> list[int]:
        return [a - b for a, b in zip(router_counts("sent"), before, strict=True)]

    def wait_idle() -> None:
        deadline = time.monotonic() + 30
        while any(router_counts("in_flight")):
            assert time.monotonic() < deadline, "the router's in-flight counts did not come back to 0"
            time.sleep(0.1)

    def one_round() -> bool:
        """Whether stream 0 was still open when stream 1 had been routed (else nothing is shown)."""
        opened = [threading.Event(), threading.Event()]
        stops = [threading.Event(), threading.Event()]
        outcome: list[dict] = [{"status": None, "events": 0, "ended": False} for _ in range(2)]

        def stream(i: int) -> None:
            body = {"text": f"stream {i}", "sampling_params": LONG, "stream": True}
            try:
                with httpx.Client(timeout=120) as c, c.stream("POST", f"{router.url}/generate", json=body) as r:
                    outcome[i]["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            outcome[i]["events"] += 1
                            opened[i].set()
                        if stops[i].is_set():
                            return  # the client leaves: router and worker abort the request
                    outcome[i]["ended"] = True
            finally:
                opened[i].set()  # an error wakes the test too; outcome says what happened

        seen_before = [prompts_seen(w) for w in workers]
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        try:
            before = router_counts("sent")
            threads[0].start()
            assert opened[0].wait(60) and outcome[0]["status"] == 200, outcome
            first = routed_since(before)
            busy = first.index(1)
            assert sorted(first) == [0, 1], first

            before = router_counts("sent")  # a short request: both policies pick the idle worker
            r = httpx.post(f"{router.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                           timeout=120)
            assert r.status_code == 200, r.text
            assert routed_since(before)[busy] == 0
            deadline = time.monotonic() + 30  # its count drops after the reply is sent: wait for it
            while (counts := router_counts("in_flight")) != [int(i == busy) for i in range(2)]:
                if counts[busy] == 0:
                    return False  # stream 0 is over already
                assert time.monotonic() < deadline, counts
                time.sleep(0.05)

            before = router_counts("sent")
            threads[1].start()  # round robin's turn is the busy worker; its queue is the longer one
            assert opened[1].wait(60) and outcome[1]["status"] == 200, outcome
            second = routed_since(before)
            if outcome[0]["ended"]:  # read after stream 1's first event: open now, open when it was routed
                return False
            assert second[busy] == 0 and sum(second) == 1, (busy, second, outcome)
            seen = [a - b for a, b in zip((prompts_seen(w) for w in workers), seen_before, strict=True)]
            assert all(s > 0 for s in seen), (seen, outcome)  # the workers admitted what was sent
            return True
        finally:
            for s in stops:
                s.set()
            for t in threads:
                if t.ident is not None:  # started
                    t.join(60)
            wait_idle()

    try:
        router.wait_healthy()
        assert any(one_round() for _ in range(3)), "stream 0 ended before stream 1 was routed in three rounds"
    finally:
        router.stop(timeout=20)


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_sglang_router_regular_mode_fronts_plugserve(workers, workload, tmp_path, policy) -> None:
    """sglang-router 0.3.2 without ``--pd-disaggregation``: it reads each worker's /server_info and
    /health, then forwards /generate and the OpenAI routes unchanged."""
    exe = sglang_router_python()
    if exe is None:
        pytest.skip("sglang_router is not importable here and $SGLANG_ROUTER_PYTHON names no interpreter that has "
                    "it (pip install sglang-router==0.3.2 into a separate venv)")
    port = free_port()
    router = spawn(["--worker-urls", *(w.url for w in workers), "--host", "127.0.0.1", "--port", str(port),
                    "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                   tmp_path / "sglang-router.log", port, exe=[exe, "-m", "sglang_router.launch_router"])
    try:
        registered = wait_for_workers(router.url, 2)
        assert {w["model_id"] for w in registered["workers"]} == {"tiny-llama"}, registered
        assert {w["worker_type"] for w in registered["workers"]} == {"regular"}, registered
        before = [prompts_seen(w) for w in workers]
        run_workload(router.url, workload, f"sglang-router {policy}")
        after = [prompts_seen(w) for w in workers]
        if policy == "round_robin":  # power_of_two may pick one worker for a whole short burst
            assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        else:
            assert sum(after) > sum(before)
    finally:
        router.stop(timeout=20)


def test_sglang_router_dp_aware_reaches_each_replica(tiny_model, workload, tmp_path) -> None:
    """sglang-router's ``--dp-aware`` reads ``dp_size`` from /server_info, registers one worker per
    replica and sends ``data_parallel_rank``: both replicas of a dp 2 server get work."""
    exe = sglang_router_python()
    if exe is None:
        pytest.skip("sglang_router is not importable here and $SGLANG_ROUTER_PYTHON names no interpreter that has "
                    "it (pip install sglang-router==0.3.2 into a separate venv)")
    server = start_server(tmp_path, [f"model.path={tiny_model}", *KV, "parallel.dp_size=2"])
    port = free_port()
    router = spawn(["--worker-urls", server.url, "--dp-aware", "--host", "127.0.0.1", "--port", str(port),
                    "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                   tmp_path / "sglang-router-dp.log", port, exe=[exe, "-m", "sglang_router.launch_router"])
    try:
        registered = wait_for_workers(router.url, 2)
        assert sorted(w["url"] for w in registered["workers"]) == [f"{server.url}@0", f"{server.url}@1"], registered
        before = [e["prompt_tokens_seen"] for e in httpx.get(f"{server.url}/get_load", timeout=30).json()]
        run_workload(router.url, workload, "sglang-router --dp-aware")
        after = [e["prompt_tokens_seen"] for e in httpx.get(f"{server.url}/get_load", timeout=30).json()]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        assert_no_leak(server)
    finally:
        router.stop(timeout=20)
        server.stop()
