"""In-process benchmarks: ``bench offline`` (a whole workload) and ``bench one-batch`` (one static
batch: prefill latency, then per-step decode latency)."""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from framework.bench.datasets import BenchRequest


def greedy_params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}


def _warm_up(engine: Any) -> None:
    engine.generate(list(range(10, 42)), greedy_params(4))
    engine.flush_cache()  # the warm-up prompt must not give the workload cache hits


def run_offline(engine: Any, requests: list[BenchRequest], warmup: bool = True,
                outputs: list[list[int]] | None = None) -> dict[str, Any]:
    """Submit every request at once and run them to completion; report throughputs.

    ``outputs``, when given, receives each request's output ids (``bench compare`` checks them
    against the peers' greedy tokens)."""
    if warmup:  # first calls pay for lazy initialisation in torch: keep them out of the timing
        _warm_up(engine)
    start = time.perf_counter()
    rids = [engine.submit(r.input_ids, greedy_params(r.output_len)) for r in requests]
    engine.run_until_done(rids)
    elapsed = time.perf_counter() - start
    states = [engine._states.pop(r) for r in rids]
    if outputs is not None:
        outputs.extend(list(s.output_ids) for s in states)
    out_tokens = sum(len(s.output_ids) for s in states)
    in_tokens = sum(len(r.input_ids) for r in requests)
    cached = sum(s.cached_tokens for s in states)
    return {
        "num_requests": len(requests),
        "elapsed_s": round(elapsed, 3),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": cached,
        "output_throughput": round(out_tokens / elapsed, 2),
        "input_throughput": round(in_tokens / elapsed, 2),
        "request_throughput": round(len(requests) / elapsed, 3),
    }


def run_single_decode(engine: Any, request: BenchRequest) -> dict[str, Any]:
    """Decode speed of one request alone: tokens after the first / time after the first."""
    rid = engine.submit(request.input_ids, greedy_params(request.output_len))
    state = engine._states[rid]
    start = time.perf_counter()
    first = None
    while not state.finished:
        engine.step()
        if first is None and state.output_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    engine._states.pop(rid)
    n = len(state.output_ids)
    return {
        "ttft_s": round((first or end) - start, 4),
        "decode_tokens": n - 1,
        "single_decode_tok_s": round((n - 1) / (end - first), 2) if first and n > 1 else None,
    }


def engine_from_args(args: Any) -> tuple[Any, Any]:
    """The Engine (and resolved config) a bench command's model arguments describe:
    ``--model-path``, ``--random-model``, ``--config`` and ``KEY=VALUE`` overrides."""
    from framework.bench.random_model import make_random_model
    from framework.config.loader import resolve_config
    from framework.engine.engine import Engine

    overrides = list(args.overrides)
    if args.random_model:
        path = make_random_model(args.random_model, tempfile.gettempdir() + "/plugserve-bench-models")
        # The reference workload is fp32 on every CPU, whatever ``auto`` would pick (the
        # checkpoint is fp32 too); a later ``model.dtype=...`` override still wins.
        overrides[:0] = [f"model.path={path}", "model.dtype=float32"]
    elif args.model_path:
        overrides.insert(0, f"model.path={args.model_path}")
    cfg = resolve_config(args.config, overrides)
    return Engine(cfg, progress=False), cfg


def run_one_batch(engine: Any, batch_size: int, input_len: int, decode_steps: int, vocab: int) -> dict[str, Any]:
    """Prefill ``batch_size`` prompts of ``input_len`` as one batch, then time each decode step."""
    from framework.bench.datasets import random_dataset

    reqs = random_dataset(batch_size, input_len, decode_steps + 1, vocab, seed=1)
    _warm_up(engine)
    sched = engine.scheduler
    rids = [engine.submit(r.input_ids, greedy_params(r.output_len)) for r in reqs]
    start = time.perf_counter()
    while sched.waiting or sched.chunked:
        engine.step()
    prefill = time.perf_counter() - start
    steps = []
    while sched.running:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    engine.run_until_done(rids)
    for r in rids:
        engine._states.pop(r)
    median = statistics.median(steps) if steps else float("nan")
    mean = statistics.fmean(steps) if steps else float("nan")
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "prefill_latency_s": round(prefill, 4),
        "prefill_throughput": round(batch_size * input_len / prefill, 1),
        "decode_steps": len(steps),
        "decode_step_median_s": round(median, 5),
        "decode_step_mean_s": round(mean, 5),
        "decode_throughput": round(batch_size / median, 1) if steps else None,
    }


def environment() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def append_result(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line per run (the plot and compare commands read these)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
