"""PD across tensor-parallel sizes, end to end on CPU: a prefill server and a decode server of
different TP sizes (two gloo ranks on one side, one on the other, one torch thread each) behind
``plugserve router``. Each decode rank receives its KV heads from the prefill ranks that hold them
(head slices of each page); greedy tokens equal the unified single-rank engine's, and no rank of
either server leaks a page or a request slot afterwards.

Each case runs three or four model processes on this 2-core machine (about a minute each), so the
default run covers each direction once with ``nccl`` (the backend that needs nothing installed);
the other backends, equal TP sizes on both sides (whole pages, rank i to rank i), and GQA
replication (more ranks than KV heads) run with ``--run-slow``."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from framework import Engine
from framework.testing.tiny_models import save_tiny_model
from tests.pd.test_router_e2e import BACKENDS, _installed, run_workload, spawn, start_pd_router
from tests.server.conftest import COMMON, assert_no_leak, free_port

pytestmark = pytest.mark.timeout(600)

KV = ["kv_cache.max_total_tokens=2048", "kv_cache.page_size=4", "scheduler.chunked_prefill_size=32"]
LENGTHS = [3, 5, 8, 12, 17, 24, 31, 33, 40, 47, 55, 64, 70, 90, 9, 2]


def slow(reason: str):
    return pytest.mark.slow(reason=reason)


CASES = [
    pytest.param("nccl", 2, 1, id="nccl-tp2-to-tp1"),
    pytest.param("nccl", 1, 2, id="nccl-tp1-to-tp2"),
    pytest.param("mooncake", 2, 1, id="mooncake-tp2-to-tp1", marks=slow("four model processes per case")),
    pytest.param("mooncake", 1, 2, id="mooncake-tp1-to-tp2", marks=slow("four model processes per case")),
    pytest.param("nixl", 2, 1, id="nixl-tp2-to-tp1", marks=slow("four model processes per case")),
    pytest.param("nixl", 1, 2, id="nixl-tp1-to-tp2", marks=slow("four model processes per case")),
    pytest.param("nccl", 2, 2, id="nccl-tp2-to-tp2", marks=slow("four model processes: whole pages rank to rank")),
]


def make_workload(model: Path) -> tuple[Path, list[list[int]], list[dict], list[list[int]]]:
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 300) for _ in range(n)] for n in LENGTHS]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": rng.randrange(1, 10)} for _ in prompts]
    unified = Engine(overrides=[f"model.path={model}", *KV, "device.num_threads=1"], progress=False)
    ref = [unified.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)]
    unified.close()
    return model, prompts, params, ref


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The tiny model (4 query heads, 2 KV heads), the requests and the unified engine's tokens."""
    return make_workload(save_tiny_model(tmp_path_factory.mktemp("pd-tp-model") / "model"))


def run_cluster(tmp: Path, workload, backend: str, prefill_tp: int, decode_tp: int) -> None:
    if not _installed(BACKENDS[backend]):
        pytest.skip(f"the {backend} transfer backend's library ({BACKENDS[backend]}) is not installed")
    p_port, d_port, b_port = (free_port() for _ in range(3))
    pd = [f"disaggregation.transfer_backend={backend}", "disaggregation.bootstrap_timeout_s=60",
          "disaggregation.transfer_timeout_s=60"]
    base = ["serve", *COMMON, f"model.path={workload[0]}", *KV, *pd]
    servers = [
        spawn([*base, f"server.port={p_port}", "disaggregation.mode=prefill", f"disaggregation.bootstrap_port={b_port}",
               f"parallel.tp_size={prefill_tp}"], tmp / "prefill.log", p_port),
        spawn([*base, f"server.port={d_port}", "disaggregation.mode=decode", "memory_pool.name=decode_prealloc",
               f"parallel.tp_size={decode_tp}"], tmp / "decode.log", d_port),
    ]
    servers.append(start_pd_router(tmp, servers[0], servers[1], b_port))
    try:
        for s in reversed(servers):
            s.wait_healthy()
        run_workload(servers[2].url, workload, f"{backend} tp{prefill_tp}->tp{decode_tp}")
        time.sleep(0.5)
        assert_no_leak(servers[0])  # every rank of each (tp_ranks in the leak report)
        assert_no_leak(servers[1])
    finally:
        for s in servers:
            s.stop(timeout=20)


@pytest.mark.parametrize("backend, prefill_tp, decode_tp", CASES)
def test_pd_across_tp_sizes_matches_unified(workload, tmp_path, backend, prefill_tp, decode_tp):
    run_cluster(tmp_path, workload, backend, prefill_tp, decode_tp)


@pytest.mark.slow(reason="four model processes; GQA replication is the rarer layout")
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_pd_gqa_replicated_heads(tmp_path, prefill_tp, decode_tp):
    """One KV head, two ranks: both ranks hold the head; a decode rank takes it from prefill rank 0."""
    model = save_tiny_model(tmp_path / "one-kv-head" / "model", num_key_value_heads=1)  # served as "model"
    run_cluster(tmp_path, make_workload(model), "nccl", prefill_tp, decode_tp)


@pytest.mark.slow(reason="three model processes started twice; the relinking path across ranks")
def test_prefill_ranks_relink_together_when_the_decode_server_restarts(workload, tmp_path):
    """A prefill server of TP 2 whose decode server is killed (SIGKILL) and restarted on the same
    port: both prefill ranks drop their links and link to the new decode session in the same
    step (agreed), the same requests give the same tokens again, and no rank of either server
    leaks."""
    p_port, d_port, b_port = (free_port() for _ in range(3))
    pd = ["disaggregation.transfer_backend=nccl", "disaggregation.bootstrap_timeout_s=60",
          "disaggregation.transfer_timeout_s=60"]
    base = ["serve", *COMMON, f"model.path={workload[0]}", *KV, *pd]
    decode_args = [*base, f"server.port={d_port}", "disaggregation.mode=decode", "memory_pool.name=decode_prealloc"]
    prefill = spawn([*base, f"server.port={p_port}", "disaggregation.mode=prefill",
                     f"disaggregation.bootstrap_port={b_port}", "parallel.tp_size=2"], tmp_path / "prefill.log", p_port)
    decode = spawn(decode_args, tmp_path / "decode.log", d_port)
    router = start_pd_router(tmp_path, prefill, decode, b_port)
    servers = [prefill, decode, router]
    try:
        for s in reversed(servers):
            s.wait_healthy()
        run_workload(router.url, workload, "before the restart")
        decode.proc.kill()
        decode.proc.wait(timeout=30)
        servers[1] = decode = spawn(decode_args, tmp_path / "decode-2.log", d_port)
        decode.wait_healthy()
        run_workload(router.url, workload, "after the restart")
        time.sleep(0.5)
        assert_no_leak(prefill)
        assert_no_leak(decode)
        assert "registered anew" in prefill.log.read_text() or "broke" in prefill.log.read_text()
    finally:
        for s in servers:
            s.stop(timeout=20)
