"""``plugserve bench plot``: PNG charts from a small synthetic results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.bench.plot import load_results, make_plots, radix_state
from framework.cli.main import main

pytestmark = pytest.mark.timeout(60)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _serve(tag: str, conc: int, tput: float) -> dict:
    row = {"kind": "serve", "tag": tag, "backend": "plugserve", "max_concurrency": conc, "num_prompts": 16,
           "output_throughput": tput, "request_throughput": tput / 8, "completed": 16}
    for i, name in enumerate(("ttft", "tpot", "itl", "e2e_latency")):
        row.update({f"mean_{name}_ms": 10.0 * (i + 1) * conc, f"median_{name}_ms": 9.0 * (i + 1) * conc,
                    f"p99_{name}_ms": 20.0 * (i + 1) * conc})
    return row


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{partial line of a killed run\n")
    return path


@pytest.fixture
def results(tmp_path: Path) -> Path:
    rows = [_serve("a", c, 40.0 * c) for c in (1, 2, 4)] + [_serve("a", 4, 150.0), _serve("b", 2, 70.0)]
    rows += [
        {"kind": "offline", "dataset": "generated-shared-prefix", "tag": "", "output_throughput": 400.0,
         "overrides": []},  # no radix information: not plotted
        {"kind": "offline", "dataset": "generated-shared-prefix", "tag": "radix-on", "output_throughput": 400.0,
         "overrides": []},
        {"kind": "offline", "dataset": "generated-shared-prefix", "tag": "", "output_throughput": 90.0,
         "overrides": ["radix_cache.enabled=false"]},
        {"kind": "one-batch", "batches": []},
    ]
    return _write(tmp_path / "results.jsonl", rows)


def test_all_charts_written(results: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "plots"
    assert main(["bench", "plot", str(results), "--out", str(out)]) == 0
    names = {"throughput_vs_concurrency.png", "latency_percentiles.png", "radix_cache.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert str(out / "radix_cache.png") in capsys.readouterr().out


def test_charts_without_their_runs_are_skipped_with_a_reason(tmp_path: Path, capsys) -> None:
    results = _write(tmp_path / "r.jsonl", [{"kind": "offline", "dataset": "random", "tag": "radix-off",
                                             "output_throughput": 50.0, "overrides": []}])
    written = make_plots(results, tmp_path / "p")
    assert [p.name for p in written] == ["radix_cache.png"]
    assert "no bench serve runs" in capsys.readouterr().out
    empty = _write(tmp_path / "empty.jsonl", [])
    assert main(["bench", "plot", str(empty), "--out", str(tmp_path / "q")]) == 1  # nothing to draw


def test_radix_state_and_loading(results: Path) -> None:
    assert len(load_results(results)) == 9  # the partial last line is skipped
    assert radix_state({"overrides": ["radix_cache.enabled=false"], "tag": "radix-on"}) is False  # overrides win
    assert radix_state({"overrides": ["radix_cache.enabled=true"]}) is True
    assert radix_state({"tag": "gsp no-radix"}) is False
    assert radix_state({"tag": "gsp radix"}) is True
    assert radix_state({"tag": "baseline", "overrides": ["model.path=x"]}) is None
