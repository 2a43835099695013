"""``plugserve bench transfer`` and ``plugserve bench pd`` at tiny sizes: they run, print their
table and append one sane JSON line. Timing is never asserted (the machine is shared)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from framework.bench.transfer import LIBRARY_MODULE, page_set
from framework.cli.main import main
from framework.disaggregation.addressing import merge_page_runs


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _one_line(path: Path) -> dict:
    lines = path.read_text().splitlines()
    assert len(lines) == 1  # one JSON line per run
    return json.loads(lines[0])


def test_page_set_is_fragmented_in_runs_the_plugins_merge() -> None:
    src, dst, pool = page_set(200, 8, seed=3)
    assert len(src) == len(dst) == 200
    assert len(set(src)) == 200 and len(set(dst)) == 200 and 0 not in src + dst  # page 0 is padding
    assert max(src + dst) < pool
    runs = merge_page_runs(src, dst)
    assert sum(r.num_pages for r in runs) == 200
    assert 200 / 16 < len(runs) < 200  # runs of 1..15 pages, none merged across a gap
    assert sorted(dst) != dst  # the destination order is shuffled


@pytest.mark.timeout(300)
def test_bench_transfer_every_installed_backend(tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "transfer", "--total-mb", "2", "--page-kb", "4", "--layers", "2", "--iters", "2",
               "--output", str(out), "--tag", "tiny"])
    assert rc == 0, capsys.readouterr().out
    row = _one_line(out)
    assert row["kind"] == "transfer" and row["tag"] == "tiny" and row["moved_bytes"] > 1e6
    assert row["merged_runs"] > 1
    by_name = {b["backend"]: b for b in row["backends"]}
    assert set(by_name) == set(LIBRARY_MODULE)
    for name, b in by_name.items():
        if not _installed(LIBRARY_MODULE[name]):
            assert b.get("skipped"), b
            continue
        assert "error" not in b, b
        assert b["plugin_gbps"] > 0 and b["raw_gbps"] > 0 and b["ratio"] > 0, b
        assert len(b["plugin_s"]) == 2 and len(b["raw_s"]) == 2
    assert "plugin/raw" in capsys.readouterr().out


@pytest.mark.timeout(400)  # starts a unified server, then prefill + decode + router, on a busy machine
def test_bench_pd_unified_vs_disaggregated(bench_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "pd", "--model-path", str(bench_model), "--num-prompts", "4", "--input-len", "16",
               "--output-len", "4", "--warmup", "1", "--disable-tqdm", "--output", str(out),
               "--log-dir", str(tmp_path / "logs"), "device.num_threads=1", "kv_cache.max_total_tokens=4096"])
    assert rc == 0
    row = _one_line(out)
    assert row["kind"] == "pd" and row["transfer_backend"] == "nccl" and row["num_prompts"] == 4
    for name in ("unified", "pd"):
        r = row[name]
        assert r["completed"] == 4 and r["failed"] == 0, r
        assert r["total_output_tokens"] == 16
        for key in ("median_e2e_latency_ms", "p99_e2e_latency_ms", "median_ttft_ms", "p99_ttft_ms"):
            assert r[key] > 0, key
        assert r["p99_e2e_latency_ms"] >= r["median_e2e_latency_ms"]
    assert all(v > 0 for v in row["pd_over_unified"].values())
    assert (tmp_path / "logs" / "router.log").exists()
    assert "pd/unified" in capsys.readouterr().out


@pytest.mark.timeout(200)
def test_bench_transfer_mooncake_room_beyond_one_batch(tmp_path: Path) -> None:
    """732 single-page runs x 4 buffers = 2928 spans in one room: more than one Mooncake batch
    (at most 2048 entries), which the plugin must split."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is not installed")
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "transfer", "--backends", "mooncake", "--total-mb", "12", "--page-kb", "4", "--layers", "2",
               "--run-pages", "1", "--iters", "1", "--warmup", "0", "--output", str(out)])
    row = _one_line(out)
    assert row["merged_runs"] * 4 > 2048
    assert rc == 0 and "error" not in row["backends"][0], row["backends"]
