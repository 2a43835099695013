"""``plugserve bench tp``: one static batch on tp_size 1 and on tp_size 2, and what the collectives
cost per decode step (rank 0's time inside all-reduce / all-gather / the input broadcast, which
includes waiting for the slower rank)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_tp_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench tp`` (called from framework/bench/cli.py with its model arguments)."""
    p = bench_sub.add_parser("tp", help="one static batch at tp_size 1 and 2, and the collectives' cost")
    common(p)
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.set_defaults(func=cmd_tp)


def _collectives(engine: Any) -> dict[str, tuple[int, float]]:
    from framework.distributed.state import get_tensor_parallel

    stats = get_tensor_parallel().comm.stats
    return stats.snapshot() if stats is not None else {}


def run_tp(args: argparse.Namespace) -> list[dict[str, Any]]:
    from framework.bench.offline import engine_from_args, run_one_batch

    rows = []
    base = list(args.overrides)
    for tp in args.tp_sizes:
        args.overrides = [*base, f"parallel.tp_size={tp}"]
        engine, _ = engine_from_args(args)
        try:
            # Until its first call returns, rank 0 waits for the others to finish loading: not a cost
            # of the collectives.
            engine.generate([1, 2, 3], {"max_new_tokens": 2})
            for bs in args.batch_size:
                before = _collectives(engine)
                row = run_one_batch(engine, bs, args.input_len, args.decode_steps, engine.runner.vocab_size)
                after = _collectives(engine)
                steps = row["decode_steps"] + 1  # the prefill step's collectives are in the sum too
                spent = {name: (after[name][0] - before.get(name, (0, 0.0))[0],
                                after[name][1] - before.get(name, (0, 0.0))[1]) for name in after}
                row.update(tp_size=tp, collectives_per_step_ms={
                    name: round(1000 * secs / steps, 3) for name, (_, secs) in spent.items()},
                    collective_calls_per_step={name: round(n / steps, 1) for name, (n, _) in spent.items()})
                rows.append(row)
        finally:
            engine.close()
    args.overrides = base
    return rows


def cmd_tp(args: argparse.Namespace) -> int:
    import json

    from framework.bench.offline import append_result, environment

    rows = run_tp(args)
    append_result(args.output, {"kind": "tp", "tag": args.tag, "overrides": list(args.overrides), **environment(),
                                "batches": rows})
    print(json.dumps(rows, indent=2))
    return 0
