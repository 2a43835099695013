"""``plugserve bench serve-overhead``: one request at a time over HTTP against the same engine's
in-process floor (issue 21 item 2). Runs for real on a small model: the engine and a live
``plugserve serve`` on 127.0.0.1 taking turns, each served round between two engine turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_reports_served_over_in_process(tmp_path: Path, bench_model: Path) -> None:
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "framework.cli.main", "bench", "serve-overhead", "--model-path", str(bench_model),
           "--requests", "3", "--rounds", "2", "--input-len", "16", "--output-len", "6", "--output", str(out),
           "--logs", str(tmp_path / "logs"), "kv_cache.max_total_tokens=2048"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kind"] == "serve-overhead" and row["served_failed"] == 0
    assert len(row["in_process"]) == 3 and len(row["rounds"]) == 2
    for floor in row["in_process"]:
        assert floor["prefill_ms"] > 0 and floor["decode_step_ms"] > 0 and floor["decode_tpot_ms"] > 0
    for i, r in enumerate(row["rounds"]):
        # Each round against the engine turns on either side of it.
        around = row["in_process"][i:i + 2]
        tpot = sum(f["decode_tpot_ms"] for f in around) / 2
        step = sum(f["decode_step_ms"] for f in around) / 2
        prefill = sum(f["prefill_ms"] for f in around) / 2
        assert abs(r["tpot_over_step"] - r["served_median_tpot_ms"] / tpot) < 1e-2
        assert abs(r["tpot_over_step_median"] - r["served_median_tpot_ms"] / step) < 1e-2
        assert abs(r["ttft_over_prefill"] - r["served_median_ttft_ms"] / prefill) < 1e-2
    ratios = sorted(r["tpot_over_step"] for r in row["rounds"])
    assert abs(row["tpot_over_step"] - sum(ratios) / 2) < 1e-2  # the median of two
    assert 0 <= row["rounds_within_goals_median_step"] <= 2
    assert 0 <= row["rounds_within_goals"] <= 2
    assert row["goals"] == {"tpot_over_step": 1.05, "ttft_over_prefill": 1.1}
    assert (tmp_path / "logs" / "plugserve.log").exists()


def test_refuses_no_rounds(tmp_path: Path, bench_model: Path) -> None:
    cmd = [sys.executable, "-m", "framework.cli.main", "bench", "serve-overhead", "--model-path", str(bench_model),
           "--rounds", "0", "--output", str(tmp_path / "r.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--rounds and --requests must be at least 1" in proc.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_an_engine_turn_takes_the_medians_of_as_many_runs_as_a_round_has_requests(monkeypatch) -> None:
    """The floor is the same statistic as the served figure: medians over ``--requests`` runs, and
    a run's TPOT is its mean decode step (a served request's TPOT is its mean time per token)."""
    import argparse

    import framework.bench.offline as offline
    from benchmarks.serve_overhead import in_process

    runs = iter([
        {"prefill_latency_s": 0.030, "decode_step_median_s": 0.008, "decode_step_mean_s": 0.009},
        {"prefill_latency_s": 0.040, "decode_step_median_s": 0.010, "decode_step_mean_s": 0.012},
        {"prefill_latency_s": 0.020, "decode_step_median_s": 0.007, "decode_step_mean_s": 0.011},
    ])
    calls = []

    def fake_one_batch(engine, batch_size, input_len, decode_steps, vocab):
        calls.append((batch_size, input_len, decode_steps))
        return next(runs)

    monkeypatch.setattr(offline, "run_one_batch", fake_one_batch)
    engine = argparse.Namespace(runner=argparse.Namespace(vocab_size=100))
    args = argparse.Namespace(requests=3, input_len=16, output_len=6)
    floor = in_process(engine, args)
    assert calls == [(1, 16, 5)] * 3
    assert floor == {"prefill_ms": 30.0, "decode_step_ms": 8.0, "decode_tpot_ms": 11.0}
