"""End to end on CPU with real processes: a prefill server, a decode server (``nccl`` transfer
backend, gloo) and ``plugserve router`` on 127.0.0.1. Concurrent greedy requests of mixed lengths
(some longer than a prefill chunk) give exactly the unified engine's tokens, and neither server
leaks a page or a request slot afterwards."""

from __future__ import annotations

import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from framework import Engine
from framework.testing.tiny_models import save_tiny_model
from tests.server.conftest import COMMON, PLUGSERVE, Server, assert_no_leak, free_port, sse_events

pytestmark = pytest.mark.timeout(400)

KV = ["kv_cache.max_total_tokens=4096", "kv_cache.page_size=4", "scheduler.chunked_prefill_size=32"]


def spawn(args: list[str], log, port: int) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([PLUGSERVE, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(proc, port, log)


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-e2e")
    model = save_tiny_model(tmp / "model")
    p_port, d_port, b_port, r_port = (free_port() for _ in range(4))
    pd = ["disaggregation.transfer_backend=nccl", "disaggregation.bootstrap_timeout_s=60",
          "disaggregation.transfer_timeout_s=60"]
    base = ["serve", *COMMON, f"model.path={model}", *KV, *pd]
    servers = [
        spawn([*base, f"server.port={p_port}", "disaggregation.mode=prefill",
               f"disaggregation.bootstrap_port={b_port}"], tmp / "prefill.log", p_port),
        spawn([*base, f"server.port={d_port}", "disaggregation.mode=decode", "memory_pool.name=decode_prealloc"],
              tmp / "decode.log", d_port),
        spawn(["router", "--prefill", f"http://127.0.0.1:{p_port}", str(b_port),
               "--decode", f"http://127.0.0.1:{d_port}", "--port", str(r_port)], tmp / "router.log", r_port),
    ]
    try:
        for s in reversed(servers):  # the router first: it starts in a second
            s.wait_healthy()
        yield model, *servers
    finally:
        for s in servers:
            s.stop(timeout=20)


def test_pd_router_matches_unified_and_leaks_nothing(pd_cluster):
    model, prefill, decode, router = pd_cluster
    rng = random.Random(7)
    lengths = [3, 5, 8, 12, 17, 24, 31, 33, 40, 47, 55, 64, 70, 90, 9, 2]
    prompts = [[rng.randrange(5, 300) for _ in range(n)] for n in lengths]
    max_new = [rng.randrange(1, 14) for _ in prompts]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": m} for m in max_new]
    unified = Engine(overrides=[f"model.path={model}", *KV, "device.num_threads=1"], progress=False)
    ref = [unified.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)]

    def call(i: int) -> list[int]:
        body = {"input_ids": prompts[i], "sampling_params": params[i]}
        if i % 4 == 3:  # some stream through the router
            with httpx.stream("POST", f"{router.url}/generate", json={**body, "stream": True}, timeout=120) as r:
                assert r.status_code == 200, r.read()
                events = sse_events(r)
            assert events[-1] == "[DONE]"
            return [e for e in events if isinstance(e, dict)][-1]["output_ids"]
        r = httpx.post(f"{router.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, range(len(prompts))))
    for i, (g, e) in enumerate(zip(got, ref, strict=True)):
        assert g == e, f"request {i} (prompt {lengths[i]} tokens): {g} != {e}"

    # an OpenAI route through the router too
    r = httpx.post(f"{router.url}/v1/completions", json={
        "model": "model", "prompt": prompts[4], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4

    time.sleep(0.5)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
