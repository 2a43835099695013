"""Head-sliced KV transfers between real processes on 127.0.0.1, for each installed backend: a
prefill side and a decode side of different TP sizes (one process per rank), linked rank pair by
rank pair as the PD sides link them. Every decode rank ends up with exactly its KV heads of each
source page, byte for byte, and nothing else touched; equal TP sizes move whole pages rank to rank.
The head plan itself (who sends which heads to whom, GQA replication) is checked in-process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.disaggregation.addressing import PageRun, transfer_spans
from framework.disaggregation.base import KVLayout
from framework.disaggregation.bootstrap import BootstrapService
from framework.disaggregation.heads import HeadSlice, ModelIdentity, all_shards, head_plan
from framework.disaggregation.links import link_slices
from tests.pd.test_router_e2e import BACKENDS, _installed
from tests.server.conftest import free_port

PEER = Path(__file__).with_name("head_slice_peer.py")
ROOT = Path(__file__).resolve().parents[2]


def run_ranks(backend: str, m: int, n: int) -> list[dict]:
    service = BootstrapService("127.0.0.1", free_port()).start()
    procs = [subprocess.Popen([sys.executable, str(PEER), role, str(rank), str(m), str(n), backend,
                               str(service.port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role, size in (("decode", n), ("prefill", m)) for rank in range(size)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=100)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"{proc.args[2:4]} printed no verdict (exit {proc.returncode}):\n{err[-3000:]}"
            results.append(json.loads(lines[-1]))
            assert proc.returncode == 0, f"{results[-1]}\n{err[-3000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        service.close()
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("m, n", [(2, 1), (1, 2), (2, 2)], ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"])
def test_head_sliced_transfer_is_byte_exact(backend, m, n):
    if not _installed(BACKENDS[backend]):
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    results = run_ranks(backend, m, n)
    assert all(r["ok"] for r in results), results
    links = {(r["role"], r["rank"]): r["links"] for r in results}
    if m == n:  # rank i to rank i, whole pages
        assert all(links[(role, i)] == [i] for role in ("prefill", "decode") for i in range(n)), links
    elif m == 2:  # the decode rank gathers both halves of its heads
        assert links[("decode", 0)] == [0, 1] and links[("prefill", 1)] == [0]
    else:  # the prefill rank serves both decode ranks
        assert links[("prefill", 0)] == [0, 1] and links[("decode", 1)] == [0]


def test_head_plan_covers_each_decode_rank_once():
    four = lambda size: all_shards(4, size)  # noqa: E731
    assert head_plan(four(2), four(1)) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 4)]
    assert head_plan(four(1), four(2)) == [HeadSlice(0, 0, 0, 2), HeadSlice(0, 1, 2, 4)]
    assert head_plan(four(2), four(2)) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 1, 2, 4)]
    assert head_plan(four(4), four(2)) == [HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 2), HeadSlice(2, 1, 2, 3),
                                           HeadSlice(3, 1, 3, 4)]
    # GQA replication: 1 KV head on 2 ranks. Each decode rank takes it from prefill rank 0;
    # prefill rank 1 (a replica) has no link at all.
    one = lambda size: all_shards(1, size)  # noqa: E731
    assert head_plan(one(2), one(2)) == [HeadSlice(0, 0, 0, 1), HeadSlice(0, 1, 0, 1)]
    assert link_slices("prefill", one(2)[1], 1, one(2)) == {}
    assert link_slices("prefill", one(2)[0], 1, one(1)) == {0: HeadSlice(0, 0, 0, 1)}


def test_spans_of_a_head_slice_are_strided_per_token():
    ident = ModelIdentity("LlamaForCausalLM", 1, 8, 4, "float32", 2)
    # prefill tp 1 (4 heads x 32 bytes = 128 bytes a token), decode rank 1 of 2 (heads 2..3, 64 bytes)
    src = KVLayout((1000, 5000), 256, 8, page_size=2, heads=4, identity=ident).sliced(2, 4)
    dst = KVLayout((100000, 200000), 128, 8, page_size=2, heads=2, identity=ident)
    spans = transfer_spans(src, dst, [PageRun(3, 5, 1)])
    assert [(s.buffer, s.src_addr, s.dst_addr, s.nbytes) for s in spans] == [
        (0, 1000 + 6 * 128 + 64, 100000 + 10 * 64, 64), (0, 1000 + 7 * 128 + 64, 100000 + 11 * 64, 64),
        (1, 5000 + 6 * 128 + 64, 200000 + 10 * 64, 64), (1, 5000 + 7 * 128 + 64, 200000 + 11 * 64, 64)]
    # another model's KV is refused even with the same bytes
    other = KVLayout((100000, 200000), 128, 8, page_size=2, heads=2,
                     identity=ModelIdentity("Qwen2ForCausalLM", 1, 8, 4, "float32", 2))
    with pytest.raises(ValueError, match="different models' KV: architecture"):
        transfer_spans(src, other, [PageRun(3, 5, 1)])
