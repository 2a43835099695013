"""``plugserve bench ...`` argument parsing and dispatch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from framework.bench.datasets import add_dataset_args

DEFAULT_RESULTS = "bench_results/results.jsonl"


def add_bench_commands(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        src = p.add_mutually_exclusive_group()
        src.add_argument("--model-path", help="a Hugging Face model directory (default: the config's)")
        src.add_argument("--random-model", help="generate a random model: llama-120m or llama-tiny")
        p.add_argument("--config", metavar="FILE")
        p.add_argument("--output", default=DEFAULT_RESULTS, help="JSONL file results are appended to")
        p.add_argument("--tag", default="", help="free-form label stored with the result")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")

    p = bench_sub.add_parser("offline", help="in-process throughput of a whole workload")
    common(p)
    add_dataset_args(p)
    p.add_argument("--single-decode", action="store_true", help="also measure one request decoding alone")
    p.set_defaults(func=cmd_offline)

    p = bench_sub.add_parser("one-batch", help="prefill and decode latency of one static batch")
    common(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.set_defaults(func=cmd_one_batch)

    # Commands defined in their own modules (imports stay light: argparse only until run).
    from framework.bench.ab import add_ab_command
    from framework.bench.gemv import add_gemv_command
    from framework.bench.membw import add_membw_commands
    from framework.bench.pd import add_pd_command
    from framework.bench.plot import add_plot_command
    from framework.bench.rl import add_rl_command
    from framework.bench.serving import add_serve_command
    from framework.bench.tp import add_tp_command
    from framework.bench.transfer import add_transfer_command
    from framework.bench.transfer_heads import add_transfer_heads_command

    add_serve_command(bench_sub, output_args)
    add_plot_command(bench_sub)
    add_transfer_command(bench_sub, output_args)
    add_transfer_heads_command(bench_sub, output_args)
    add_pd_command(bench_sub, common)
    add_rl_command(bench_sub, common)
    add_tp_command(bench_sub, common)
    add_membw_commands(bench_sub, common, output_args)
    add_gemv_command(bench_sub, common)
    add_ab_command(bench_sub, common)
    _add_entry_point_commands(bench_sub, common)


BENCH_ENTRY_POINTS = "plugserve.bench"
"""Entry-point group of bench commands kept outside the core (``bench compare``, from the
``benchmarks`` package): each is ``add(bench_subparsers, common_model_args)``."""


def _add_entry_point_commands(bench_sub: Any, common: Any) -> None:
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=BENCH_ENTRY_POINTS), key=lambda e: e.name):
        try:
            add = ep.load()
        except Exception as exc:  # a broken optional command must not break the others
            print(f"plugserve: bench command {ep.name!r} ({ep.value}) failed to load: {exc}", file=sys.stderr)
            continue
        add(bench_sub, common)


def output_args(p: argparse.ArgumentParser) -> None:
    """--output and --tag, for commands that do not load a model themselves."""
    p.add_argument("--output", default=DEFAULT_RESULTS, help="JSONL file results are appended to")
    p.add_argument("--tag", default="", help="free-form label stored with the result")


def _record(args: argparse.Namespace, kind: str, engine: Any, result: dict) -> int:
    from framework.bench.offline import append_result, environment

    record = {"kind": kind, "tag": args.tag, "model": engine.runner.describe(),
              "overrides": list(args.overrides), **environment(), **result}
    append_result(args.output, record)
    print(json.dumps(result, indent=2))
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    from framework.bench.datasets import load_requests
    from framework.bench.offline import engine_from_args, run_offline, run_single_decode

    engine, _ = engine_from_args(args)
    reqs = load_requests(args, engine.tokenizer, engine.runner.vocab_size)
    result = {"dataset": args.dataset, **run_offline(engine, reqs)}
    if args.single_decode:
        result.update(run_single_decode(engine, reqs[0]))
    return _record(args, "offline", engine, result)


def cmd_one_batch(args: argparse.Namespace) -> int:
    from framework.bench.offline import engine_from_args, run_one_batch

    engine, _ = engine_from_args(args)
    rows = [run_one_batch(engine, bs, args.input_len, args.decode_steps, engine.runner.vocab_size)
            for bs in args.batch_size]
    return _record(args, "one-batch", engine, {"batches": rows})
