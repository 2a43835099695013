"""``plugserve bench membw`` and ``plugserve bench decode-bound``: how close single-stream decode
comes to the machine's memory read bandwidth.

At batch 1 a decode step reads every weight once (plus the request's KV) and does 2 flops per
weight (half a flop per fp32 byte), so on a CPU it is bounded by how fast the cores can stream
memory. The bound is measured here STREAM-style with torch itself on a buffer far larger than the
caches:

- ``read``: ``buf.sum()`` (one read of the buffer; bytes = buffer size);
- ``copy``: ``dst.copy_(src)`` (STREAM Copy; bytes = read + write, two buffer sizes);

each on 1 thread and on all of torch's threads, best of ``--repeats`` (the first run is a warm-up
that faults the pages in), on 2 MiB pages where Linux offers them (``huge_pages`` in each row).
``decode-bound`` then divides the weight (+ KV) bytes one decode step reads at batch 1 by that
step's median time (``bench one-batch --batch-size 1``'s measurement) and reports it as a fraction
of the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a command runs, not when the CLI parses (cli.py)
    import torch

DEFAULT_SIZE_MB = 512
"""Buffer size: well over any CPU's last-level cache (32 MB on this project's hosts), so the
read comes from DRAM."""


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: page faults, thread-pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(size_bytes: int, threads: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` read and copy bandwidth in GB/s (1e9 bytes) on ``threads`` threads."""
    import torch

    from framework.kernels.huge_pages import empty_on_huge_pages, huge_pages_available

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # On 2 MiB pages where Linux offers them, as the small-GEMM weights are (device.cpu_huge_pages):
        # the bound is the fastest read the machine does. On the Zen 4 host 4 KiB pages read at
        # ~23 GB/s on one thread and ~31 on two, 2 MiB pages at ~34 and ~36.
        count = size_bytes // 4
        src = empty_on_huge_pages(count * 4).view(torch.float32)
        dst = empty_on_huge_pages(count * 4).view(torch.float32)
        # Distinct values, like the weights a decode step reads (no page is like another).
        torch.rand(count, dtype=torch.float32, generator=torch.Generator().manual_seed(0), out=src)
        nbytes = src.numel() * 4
        read_s = _best_seconds(src.sum, repeats)
        copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(old)
    return {"threads": threads, "read_gb_s": round(nbytes / read_s / 1e9, 2),
            "copy_gb_s": round(2 * nbytes / copy_s / 1e9, 2), "huge_pages": huge_pages_available()}


def run_membw(size_mb: int = DEFAULT_SIZE_MB, repeats: int = 10, threads: list[int] | None = None) -> dict[str, Any]:
    """Bandwidth on 1 thread and on all of torch's threads (or on each of ``threads``)."""
    import torch

    counts = threads or sorted({1, torch.get_num_threads()})
    rows = [measure_bandwidth(size_mb * 2**20, n, repeats) for n in counts]
    return {"buffer_mb": size_mb, "repeats": repeats, "runs": rows,
            "read_gb_s": max(r["read_gb_s"] for r in rows)}


def weight_bytes_per_token(model_path: str, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads at batch 1, from the checkpoint's tensor shapes.

    Every tensor is read whole except the input embedding, of which one row is read (unless the
    LM head shares it, which then is read whole as the head). Sizes are in the serving dtype.
    """
    import torch
    from safetensors import safe_open

    from framework.models.loader import safetensors_files

    shapes: dict[str, int] = {}
    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = _numel(f.get_slice(name).get_shape())
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = sum(shapes.values())
    embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
    tied = not any(n.endswith("lm_head.weight") for n in shapes)
    if embed is not None and not tied:
        total -= shapes[embed]  # a decode step gathers one row of it
    return total * itemsize


def significant(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (figures of tiny and large models alike)."""
    return float(f"{x:.{digits}g}")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def kv_bytes_per_token(engine: Any, context_len: int) -> int:
    """KV bytes one decode step reads at batch 1 with ``context_len`` tokens cached."""
    import torch

    cfg = engine.runner.hf_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty((), dtype=engine.runner.kv_cache.dtype).element_size()
    return cfg.num_hidden_layers * 2 * heads * head_dim * itemsize * context_len


def decode_against_bound(engine: Any, model_path: str, read_gb_s: float, input_len: int,
                         decode_steps: int) -> dict[str, Any]:
    """One-batch decode at batch 1, as bytes read per step over the step time vs the read bound."""
    from framework.bench.offline import run_one_batch

    row = run_one_batch(engine, 1, input_len, decode_steps, engine.runner.vocab_size)
    weights = weight_bytes_per_token(model_path, engine.runner.dtype)
    kv = kv_bytes_per_token(engine, input_len + decode_steps // 2)
    step = row["decode_step_median_s"]
    achieved = (weights + kv) / step / 1e9
    return {
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "weight_bytes_per_token": weights,
        "kv_bytes_per_token": kv,
        "decode_step_median_ms": round(step * 1e3, 4),
        "achieved_gb_s": significant(achieved),
        "read_bound_gb_s": read_gb_s,
        "fraction_of_bound": significant(achieved / read_gb_s),
        "bound_step_ms": round((weights + kv) / (read_gb_s * 1e9) * 1e3, 3),
        "one_batch": row,
    }


def add_membw_commands(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None],
                       output_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench membw`` and ``bench decode-bound``."""
    def bw_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB, help="buffer size in MiB")
        p.add_argument("--repeats", type=int, default=10, help="runs per measurement; the best counts")
        p.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 and all)")

    p = bench_sub.add_parser("membw", help="STREAM-like memory read and copy bandwidth (torch)")
    bw_args(p)
    output_args(p)
    p.set_defaults(func=cmd_membw)

    p = bench_sub.add_parser("decode-bound", help="batch-1 decode step vs the measured read bandwidth")
    common(p)
    bw_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3,
                   help="bound + decode measurements back to back; the median round's fraction is reported")
    p.set_defaults(func=cmd_decode_bound)


def cmd_membw(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment

    result = run_membw(args.size_mb, args.repeats, args.threads)
    append_result(args.output, {"kind": "membw", "tag": args.tag, **environment(), **result})
    print(json.dumps(result, indent=2))
    return 0


def cmd_decode_bound(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, engine_from_args, environment

    engine, cfg = engine_from_args(args)
    # The read rate of the shared Zen 4 host moved between ~31 and ~64 GB/s from one minute to the
    # next, and the decode step with it: a bound and a step measured minutes apart gave fractions
    # from 0.43 to 0.94 for the same code. Each round measures the two back to back; the median
    # round's fraction is the result.
    rounds = []
    for _ in range(args.rounds):
        bw = run_membw(args.size_mb, args.repeats, args.threads)
        rounds.append({"membw": bw, **decode_against_bound(engine, str(cfg.model.path), bw["read_gb_s"],
                                                           args.input_len, args.decode_steps)})
    ordered = sorted(rounds, key=lambda r: r["fraction_of_bound"])
    result = {**ordered[len(ordered) // 2], "round_fractions": [r["fraction_of_bound"] for r in rounds],
              "round_steps_ms": [r["decode_step_median_ms"] for r in rounds],
              "round_bounds_gb_s": [r["read_bound_gb_s"] for r in rounds]}
    append_result(args.output, {"kind": "decode-bound", "tag": args.tag, "model": engine.runner.describe(),
                                "overrides": list(args.overrides), **environment(), **result})
    print(json.dumps(result, indent=2))
    return 0
