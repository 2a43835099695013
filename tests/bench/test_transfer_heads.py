"""``plugserve bench transfer-heads`` at a tiny size: every layout of every installed backend runs
(the receiver checks the moved heads hold the sender's bytes and the others stay untouched) and
one sane JSON line is appended. Timing is never asserted (the machine is shared)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.bench.transfer import LAYOUTS, LIBRARY_MODULE
from framework.cli.main import main


@pytest.mark.timeout(400)
def test_bench_transfer_heads_every_layout(tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "transfer-heads", "--total-mb", "1", "--page-kb", "4", "--layers", "2", "--iters", "1",
               "--output", str(out), "--tag", "tiny"])
    assert rc == 0, capsys.readouterr().out
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kind"] == "transfer_heads" and row["tag"] == "tiny"
    assert {(r["backend"], r["layout"]) for r in row["rows"]} == {(b, lay) for b in LIBRARY_MODULE for lay in LAYOUTS}
    for r in row["rows"]:
        if r.get("skipped"):
            continue
        assert "error" not in r, r
        assert r["plugin_gbps"] > 0 and r["ms_per_room"] > 0, r
    moved = {r["layout"]: r["moved_mb"] for r in row["rows"] if "moved_mb" in r}
    assert moved["tp1-to-tp2"] == moved["tp2-to-tp1"] == pytest.approx(moved["whole"] / 2)
    assert "ms/room" in capsys.readouterr().out
