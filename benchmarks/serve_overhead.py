"""``plugserve bench serve-overhead``: what serving over HTTP adds to one request's latencies.

The in-process engine gives the floor: ``one-batch`` at batch 1 times the prefill of one prompt
and each decode step after it. A live ``plugserve serve`` on 127.0.0.1 then takes the same kind of
request one at a time (streaming ``/v1/completions``, token-id prompts of the same length,
``ignore_eos``), and the command reports served median TPOT over the decode step and served median
TTFT over the prefill: the per-token and per-request cost of the HTTP process, the ZMQ round trips,
detokenization and the scheduler loop around the forward (issue 21, item 2: within 5% and 10%).

The engine is measured before and after the server (each alone on the machine) and the floor is
the mean of the two, so a drift of the host's speed during the run shows as their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The goals of issue 21 item 2: served / in-process.
TPOT_GOAL, TTFT_GOAL = 1.05, 1.10


def add_serve_overhead_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench serve-overhead`` (the ``plugserve.bench`` entry point ``serve-overhead``)."""
    p = bench_sub.add_parser("serve-overhead",
                             help="one request at a time served over HTTP vs the same engine in-process")
    common(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="requests sent one after another to the server")
    p.add_argument("--dtype", default="float32", help="model dtype of both (default float32)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to become healthy")
    p.add_argument("--logs", help="directory for the server's log (default: a temporary one)")
    p.set_defaults(func=cmd_serve_overhead)


def in_process(args: argparse.Namespace, model: str) -> dict[str, float]:
    """Prefill latency and median decode step of ``one-batch`` at batch 1 (the median of 3 runs)."""
    from framework.bench.offline import run_one_batch
    from framework.config.loader import resolve_config
    from framework.engine.engine import Engine

    cfg = resolve_config(args.config, [f"model.path={model}", f"model.dtype={args.dtype}", *args.overrides])
    engine = Engine(cfg, progress=False)
    try:
        runs = [run_one_batch(engine, 1, args.input_len, args.output_len - 1, engine.runner.vocab_size)
                for _ in range(3)]
    finally:
        engine.close()
        del engine
        gc.collect()
    return {"prefill_ms": statistics.median(r["prefill_latency_s"] for r in runs) * 1e3,
            "decode_step_ms": statistics.median(r["decode_step_median_s"] for r in runs) * 1e3}


def served(args: argparse.Namespace, model: str, vocab_size: int, logs: Path) -> dict[str, Any]:
    """Median TTFT and TPOT of ``--requests`` requests sent one at a time to a live server."""
    from benchmarks.serve_compare import _server_command
    from framework.bench.datasets import random_dataset
    from framework.bench.pd import Process, _free_port
    from framework.bench.serving import run_workload
    from framework.bench.serving_metrics import summarize

    port = _free_port()
    cmd, env = _server_command("plugserve", args, model, port)
    server = Process([], port, logs / "plugserve.log", command=cmd, env=env)
    try:
        server.wait_healthy(args.start_timeout)
        reqs = random_dataset(args.requests, args.input_len, args.output_len, vocab_size, seed=2000)
        outputs, duration = asyncio.run(run_workload(server.url, reqs, "openai", max_concurrency=1, warmup=2,
                                                     model=None, progress=False))
    finally:
        server.stop()
    return summarize(outputs, duration)


def cmd_serve_overhead(args: argparse.Namespace) -> int:
    from benchmarks.serve_compare import _model_path
    from framework.bench.offline import append_result, environment

    model = _model_path(args)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="plugserve-serve-overhead-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    before = in_process(args, model)
    from transformers import AutoConfig

    result = served(args, model, int(AutoConfig.from_pretrained(model).vocab_size), logs)
    after = in_process(args, model)
    step = (before["decode_step_ms"] + after["decode_step_ms"]) / 2
    prefill = (before["prefill_ms"] + after["prefill_ms"]) / 2
    report = {
        "in_process_before": before, "in_process_after": after,
        "served_median_tpot_ms": result.get("median_tpot_ms"), "served_median_ttft_ms": result.get("median_ttft_ms"),
        "served_failed": result["failed"],
        "tpot_over_step": round(result["median_tpot_ms"] / step, 3) if result.get("median_tpot_ms") else None,
        "ttft_over_prefill": round(result["median_ttft_ms"] / prefill, 3) if result.get("median_ttft_ms") else None,
        "goals": {"tpot_over_step": TPOT_GOAL, "ttft_over_prefill": TTFT_GOAL},
        "elapsed_s": round(time.time() - started, 1),
    }
    append_result(args.output, {"kind": "serve-overhead", "tag": args.tag, "model": model, "input_len": args.input_len,
                                "output_len": args.output_len, "overrides": list(args.overrides), **environment(),
                                **report})
    print(json.dumps(report, indent=2))
    return 1 if result["failed"] else 0
