"""End to end on CPU with real processes, for each KV transfer plugin (``nccl`` over gloo,
``mooncake`` over TCP, ``nixl`` over UCX on DRAM): a prefill server, a decode server and
``plugserve router`` on 127.0.0.1. Concurrent greedy requests of mixed lengths (some longer than a
prefill chunk) give exactly the unified engine's tokens, and neither server leaks a page or a
request slot afterwards. The unified reference is computed once for all backends.

The same servers also run behind SGLang's own router (``sglang_router.launch_router
--pd-disaggregation``), when an interpreter that has it is found: this one, or
``$SGLANG_ROUTER_PYTHON`` (e.g. a separate venv: ``pip install sglang-router==0.3.2``)."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from framework import Engine
from framework.testing.tiny_models import save_tiny_model
from tests.server.conftest import COMMON, PLUGSERVE, Server, assert_no_leak, free_port, sse_events

pytestmark = pytest.mark.timeout(400)

KV = ["kv_cache.max_total_tokens=4096", "kv_cache.page_size=4", "scheduler.chunked_prefill_size=32"]
LENGTHS = [3, 5, 8, 12, 17, 24, 31, 33, 40, 47, 55, 64, 70, 90, 9, 2]  # 5 longer than a 32-token chunk

# backend -> the module that must import for it (None: torch.distributed, always there)
BACKENDS = {"nccl": None, "mooncake": "mooncake.engine", "nixl": "nixl._api"}


def _installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def spawn(args: list[str], log: Path, port: int, exe: list[str] | None = None) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([*(exe or [PLUGSERVE]), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(proc, port, log)


def start_pd_servers(tmp: Path, model: Path, backend: str) -> tuple[Server, Server, int]:
    """A prefill and a decode server (not yet healthy) and the prefill side's bootstrap port."""
    p_port, d_port, b_port = (free_port() for _ in range(3))
    pd = [f"disaggregation.transfer_backend={backend}", "disaggregation.bootstrap_timeout_s=60",
          "disaggregation.transfer_timeout_s=60"]
    base = ["serve", *COMMON, f"model.path={model}", *KV, *pd]
    prefill = spawn([*base, f"server.port={p_port}", "disaggregation.mode=prefill",
                     f"disaggregation.bootstrap_port={b_port}"], tmp / "prefill.log", p_port)
    decode = spawn([*base, f"server.port={d_port}", "disaggregation.mode=decode", "memory_pool.name=decode_prealloc"],
                   tmp / "decode.log", d_port)
    return prefill, decode, b_port


def start_pd_router(tmp: Path, prefill: Server, decode: Server, bootstrap_port: int) -> Server:
    """``plugserve router`` pairing ``prefill`` (its bootstrap on ``bootstrap_port``) with ``decode``
    (not yet healthy)."""
    port = free_port()
    return spawn(["router", "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url, "--port", str(port)],
                 tmp / "router.log", port)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The tiny model, the requests, and the unified engine's tokens for them (computed once)."""
    model = save_tiny_model(tmp_path_factory.mktemp("pd-e2e-model") / "model")
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 300) for _ in range(n)] for n in LENGTHS]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": rng.randrange(1, 10)} for _ in prompts]
    unified = Engine(overrides=[f"model.path={model}", *KV, "device.num_threads=1"], progress=False)
    ref = [unified.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)]
    del unified
    return model, prompts, params, ref


@pytest.fixture(scope="module", params=list(BACKENDS))
def pd_cluster(request, workload, tmp_path_factory):
    backend = request.param
    if not _installed(BACKENDS[backend]):
        pytest.skip(f"the {backend} transfer backend's library ({BACKENDS[backend]}) is not installed")
    tmp = tmp_path_factory.mktemp(f"pd-e2e-{backend}")
    prefill, decode, b_port = start_pd_servers(tmp, workload[0], backend)
    servers = [prefill, decode, start_pd_router(tmp, prefill, decode, b_port)]
    try:
        for s in reversed(servers):  # the router first: it starts in a second
            s.wait_healthy()
        yield backend, *servers
    finally:
        for s in servers:
            s.stop(timeout=20)


def run_workload(url: str, workload, label: str, text_prompt: bool = False) -> None:
    """16 concurrent greedy requests (every fourth streamed) equal the unified engine's tokens, and
    an OpenAI completion goes through too (its prompt as text where the router takes no token ids)."""
    _model, prompts, params, ref = workload

    def call(i: int) -> list[int]:
        body = {"input_ids": prompts[i], "sampling_params": params[i]}
        if i % 4 == 3:  # some stream through the router
            with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as r:
                assert r.status_code == 200, r.read()
                events = sse_events(r)
            assert events[-1] == "[DONE]"
            return [e for e in events if isinstance(e, dict)][-1]["output_ids"]
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, range(len(prompts))))
    for i, (g, e) in enumerate(zip(got, ref, strict=True)):
        assert g == e, f"{label}: request {i} (prompt {LENGTHS[i]} tokens): {g} != {e}"

    r = httpx.post(f"{url}/v1/completions", json={
        "model": "model", "prompt": "hello world" if text_prompt else prompts[4], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_pd_router_matches_unified_and_leaks_nothing(pd_cluster, workload):
    backend, prefill, decode, router = pd_cluster
    run_workload(router.url, workload, backend)
    time.sleep(0.5)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


# -- SGLang's router in front of plugserve ---------------------------------------------------------


def sglang_router_python() -> str | None:
    """An interpreter that can import ``sglang_router``: this one, or ``$SGLANG_ROUTER_PYTHON``."""
    if _installed("sglang_router"):
        return sys.executable
    exe = os.environ.get("SGLANG_ROUTER_PYTHON")
    if exe and shutil.which(exe):
        ok = subprocess.run([exe, "-c", "import sglang_router.launch_router"], capture_output=True, timeout=60)
        return exe if ok.returncode == 0 else None
    return None


def wait_for_workers(url: str, count: int, timeout_s: float = 120.0) -> dict:
    """sglang-router answers /health at once and registers its workers in the background: a worker
    shows up healthy with model_id "unknown" until the router has read its /server_info (a CI run
    caught it in between), so this waits for that too; a router that never learns the name times
    out here with what it last reported."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        try:
            info = httpx.get(f"{url}/workers", timeout=5).json()
            workers = info.get("workers", [])
            if len(workers) == count and all(w["is_healthy"] and w.get("model_id") != "unknown" for w in workers):
                return info
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"sglang-router did not register {count} healthy workers: {info}")


def test_sglang_router_pd_mode_fronts_plugserve(workload, tmp_path):
    """Both policies end to end, one router after the other in front of one PD pair;
    ``power_of_two`` also polls each server's ``/get_load`` (every 30 s, so a run this short sees
    its first poll only; the shape itself is checked in tests/server)."""
    exe = sglang_router_python()
    if exe is None:
        pytest.skip("sglang_router is not importable here and $SGLANG_ROUTER_PYTHON names no interpreter that has "
                    "it (pip install sglang-router==0.3.2 into a separate venv)")
    prefill, decode, b_port = start_pd_servers(tmp_path, workload[0], "nccl")
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        for policy in ("round_robin", "power_of_two"):
            r_port = free_port()
            router = spawn(["--pd-disaggregation", "--prefill", prefill.url, str(b_port), "--decode", decode.url,
                            "--host", "127.0.0.1", "--port", str(r_port), "--policy", policy,
                            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                           tmp_path / f"sglang-router-{policy}.log", r_port,
                           exe=[exe, "-m", "sglang_router.launch_router"])
            try:
                workers = wait_for_workers(router.url, 2)
                # it reads the served model name from plugserve's /server_info
                assert {w["model_id"] for w in workers["workers"]} == {"model"}, (policy, workers)
                assert {w["worker_type"] for w in workers["workers"]} == {"prefill", "decode"}
                # sglang-router 0.3.2 takes a completion prompt as a string or strings only (422 for token ids)
                run_workload(router.url, workload, f"sglang-router {policy}", text_prompt=True)
                time.sleep(0.5)
                assert_no_leak(prefill)
                assert_no_leak(decode)
            finally:
                router.stop(timeout=20)
    finally:
        for s in (prefill, decode):
            s.stop(timeout=20)


def test_sglang_router_request_bodies_validate():
    """The bodies sglang-router 0.3.2 sends in PD mode (captured from it), accepted without
    sglang-router installed; asking for a feature plugserve lacks is still refused."""
    from pydantic import ValidationError

    from framework.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 8149567089256526977}
    GenerateRequest.model_validate({
        "model": None, "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6},
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False, **room})
    CompletionRequest.model_validate({
        "model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0.0, "stream": False, "echo": False,
        "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True, "return_hidden_states": False, **room})
    ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "model": "m", "logprobs": False,
        "max_completion_tokens": 4, "stream": False, "temperature": 0.0, "no_stop_trim": False, "ignore_eos": False,
        "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
        "stream_reasoning": True, "return_hidden_states": False, **room})
    for model, body in ((GenerateRequest, {"input_ids": [1], "return_hidden_states": True}),
                        (CompletionRequest, {"model": "m", "prompt": "x", "no_stop_trim": True}),
                        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "continue_final_message": True})):
        with pytest.raises(ValidationError):
            model.model_validate(body)
