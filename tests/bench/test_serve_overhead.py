"""``plugserve bench serve-overhead``: one request at a time over HTTP against the same engine's
in-process floor (issue 21 item 2). Runs for real on a small model: the engine twice, a live
``plugserve serve`` on 127.0.0.1 in between."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_reports_served_over_in_process(tmp_path: Path, bench_model: Path) -> None:
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "framework.cli.main", "bench", "serve-overhead", "--model-path", str(bench_model),
           "--requests", "3", "--input-len", "16", "--output-len", "6", "--output", str(out),
           "--logs", str(tmp_path / "logs"), "kv_cache.max_total_tokens=2048"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kind"] == "serve-overhead" and row["served_failed"] == 0
    for side in ("in_process_before", "in_process_after"):
        assert row[side]["prefill_ms"] > 0 and row[side]["decode_step_ms"] > 0
    floor_step = (row["in_process_before"]["decode_step_ms"] + row["in_process_after"]["decode_step_ms"]) / 2
    assert abs(row["tpot_over_step"] - row["served_median_tpot_ms"] / floor_step) < 1e-2
    assert row["served_median_ttft_ms"] > 0 and row["ttft_over_prefill"] > 0
    assert row["goals"] == {"tpot_over_step": 1.05, "ttft_over_prefill": 1.1}
    assert (tmp_path / "logs" / "plugserve.log").exists()
