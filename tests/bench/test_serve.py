"""``plugserve bench serve`` against a real tiny server, both backends, and its metric summary."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from framework.bench.datasets import BenchRequest
from framework.bench.serving import run_workload
from framework.bench.serving_metrics import RequestOutput, summarize
from framework.cli.main import main
from tests.bench.conftest import ADMIN_KEY

pytestmark = pytest.mark.timeout(300)  # includes starting the server on a busy 2-core machine

LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2e_latency")
                for stat in ("mean", "median", "p99")]


def _bench(tmp_path: Path, url: str, *extra: str, progress: bool = False) -> dict:
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "serve", "--base-url", url, "--output", str(out), *extra,
               *([] if progress else ["--disable-tqdm"])])
    assert rc == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1  # one JSON line per run
    return json.loads(lines[0])


def _check_timings(row: dict, names: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e_latency")) -> None:
    for key in LATENCY_KEYS:
        if key.split("_", 1)[1].removesuffix("_ms") in names:
            assert row[key] is not None and row[key] > 0, key
    for name in names:
        assert row[f"p99_{name}_ms"] >= row[f"median_{name}_ms"]
    assert row["mean_e2e_latency_ms"] >= row["mean_ttft_ms"]
    assert row["request_throughput"] > 0 and row["output_throughput"] > 0 and row["input_throughput"] > 0


def test_plugserve_backend_random_max_concurrency(bench_server, tmp_path: Path, capsys) -> None:
    row = _bench(tmp_path, bench_server.url, "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                 "--max-concurrency", "3", "--warmup", "2", "--admin-key", ADMIN_KEY, "--tag", "c3")
    assert row["kind"] == "serve" and row["backend"] == "plugserve" and row["tag"] == "c3"
    assert row["completed"] == 6 and row["failed"] == 0
    # token counts come from the server's meta_info: 6 x 16 in, 6 x 8 out (ignore_eos)
    assert row["total_input_tokens"] == 96 and row["total_output_tokens"] == 48
    assert row["max_concurrency"] == 3 and row["request_rate"] == "inf"
    _check_timings(row)
    assert "TTFT (ms) mean/median/p99" in capsys.readouterr().out


def test_openai_backend_ids_poisson_rate(bench_server, tmp_path: Path) -> None:
    row = _bench(tmp_path, bench_server.url, "--backend", "openai", "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "6", "--request-rate", "20", "--warmup", "1")
    assert row["backend"] == "openai" and row["request_rate"] == 20.0
    assert row["completed"] == 4 and row["failed"] == 0
    assert row["total_input_tokens"] == 48 and row["total_output_tokens"] == 24  # from usage
    _check_timings(row)


@pytest.mark.parametrize("backend", ["plugserve", "openai"])
def test_sampled_workload(bench_server, tmp_path: Path, backend: str) -> None:
    """``--temperature``: the requests sample (the server draws from the whole vocabulary each step)."""
    row = _bench(tmp_path, bench_server.url, "--backend", backend, "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "6", "--max-concurrency", "4", "--temperature", "1.0", "--warmup", "1")
    assert row["temperature"] == 1.0 and row["completed"] == 4 and row["failed"] == 0
    assert row["total_output_tokens"] == 24
    # No ITL: the client times gaps between chunks that carry text, and tokens drawn at random from
    # the tiny model's vocabulary often decode to nothing alone (pieces of a UTF-8 character), so a
    # run whose four streams each got fewer than two text chunks has no gap to time (seen in CI).
    _check_timings(row, ("ttft", "tpot", "e2e_latency"))


def test_openai_backend_text_prompts_shared_prefix(bench_server, tmp_path: Path) -> None:
    row = _bench(tmp_path, bench_server.url, "--backend", "openai", "--prompt-format", "text",
                 "--dataset", "generated-shared-prefix", "--gsp-groups", "2", "--gsp-prompts-per-group", "2",
                 "--gsp-system-len", "24", "--gsp-question-len", "4", "--output-len", "4", "--warmup", "0")
    assert row["dataset"] == "generated-shared-prefix" and row["completed"] == 4
    assert row["total_output_tokens"] == 16
    # the server re-tokenises decoded text: the count is the server's, whatever it is
    assert row["total_input_tokens"] > 0


def test_jsonl_dataset_with_progress_bar(bench_server, tmp_path: Path, capsys) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "To be, or not to be", "output_len": 3}\n\n{"input_ids": [20, 21, 22]}\n')
    row = _bench(tmp_path, bench_server.url, "--dataset", "jsonl", "--dataset-path", str(data),
                 "--output-len", "5", "--warmup", "0", progress=True)
    assert row["completed"] == 2 and row["total_output_tokens"] == 3 + 5
    assert "bench serve: 100%" in capsys.readouterr().err  # tqdm writes to stderr


def test_failed_requests_are_counted_not_fatal(bench_server) -> None:
    reqs = [BenchRequest([20, 21, 22], 4), BenchRequest([20, 21, 22], 10**7)]  # beyond the context: a 400
    outs, duration = asyncio.run(run_workload(bench_server.url, reqs, warmup=0, progress=False))
    assert outs[0].success and outs[0].output_tokens == 4
    assert not outs[1].success and outs[1].error.startswith("HTTP 400")
    summary = summarize(outs, duration)
    assert summary["completed"] == 1 and summary["failed"] == 1 and "HTTP 400" in summary["first_error"]
    with pytest.raises(SystemExit, match="warm-up request failed: HTTP 400"):  # stops before measuring
        asyncio.run(run_workload(bench_server.url, reqs[1:], warmup=1, progress=False))


def test_summarize_definitions() -> None:
    outs = [
        RequestOutput(True, "", 10, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestOutput(True, "", 20, 1, ttft=0.3, latency=0.3, itl=[]),  # one token: no TPOT
        RequestOutput(False, "boom"),
    ]
    s = summarize(outs, 2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["first_error"] == "boom"
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["input_throughput"] == 15.0 and s["output_throughput"] == 3.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4, the 1-token request left out
    assert s["median_itl_ms"] == pytest.approx(100.0) and s["p99_e2e_latency_ms"] <= 500.0
    empty = summarize([], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and not math.isnan(empty["output_throughput"])


def test_warm_up_gives_the_measured_requests_no_cache_hits(bench_server) -> None:
    """The warm-up must not prefill the workload's own prompts: that would hand the measured
    requests radix-cache hits and flatter TTFT (no --admin-key, so nothing is flushed)."""
    import httpx

    def hits() -> int:
        return httpx.get(f"{bench_server.url}/get_load", timeout=30).json()[0]["cache_hit_tokens"]

    rng_ids = [[300 + 7 * i + j for j in range(24)] for i in range(3)]  # no prefix shared with other tests
    reqs = [BenchRequest(ids, 2) for ids in rng_ids]
    before = hits()
    outs, _ = asyncio.run(run_workload(bench_server.url, reqs, warmup=3, progress=False))
    assert all(o.success for o in outs)
    assert hits() == before


def test_requests_log_one_line_per_request_in_send_order(bench_server, tmp_path: Path) -> None:
    """``--requests-log``: every request's send time and timings; with one stream in flight each
    request is sent only after the one before it finished, and its TPOT is the summary's."""
    log = tmp_path / "requests.jsonl"
    row = _bench(tmp_path, bench_server.url, "--num-prompts", "4", "--input-len", "10", "--output-len", "5",
                 "--max-concurrency", "1", "--warmup", "1", "--requests-log", str(log), "--tag", "one")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3] and all(r["tag"] == "one" for r in records)
    assert all(r["success"] and r["output_tokens"] == 5 and r["error"] is None for r in records)
    assert records[0]["sent_s"] >= 0.0
    for before, after in zip(records, records[1:], strict=False):
        assert after["sent_s"] >= before["sent_s"] + before["e2e_latency_ms"] / 1000.0 - 1e-3
    assert all(0 < r["ttft_ms"] <= r["e2e_latency_ms"] for r in records)
    import numpy as np

    assert float(np.median([r["tpot_ms"] for r in records])) == pytest.approx(row["median_tpot_ms"], abs=0.01)
    assert max(r["ttft_ms"] for r in records) >= row["p99_ttft_ms"] - 0.01
