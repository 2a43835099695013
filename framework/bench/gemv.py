"""``plugserve bench gemv``: a served model's decode-step linear layers, small-GEMM kernel vs oneDNN.

A decode step at a few rows is a chain of matrix-vector products that read every linear weight
once (docs/benchmarks.md, the memory-bound section). This command loads the model as the engine
does (oneDNN-packed layers with the small-GEMM kernel's copy, ``device.cpu_small_gemm=kernel``),
then times the whole chain of those layers at each row count two ways in the same process,
alternating so that a host whose speed drifts over minutes treats both alike:

- ``kernel``: ``framework/kernels/small_gemm`` on its panel copy (at any row count, past the
  per-build limit the engine applies, so the crossover is visible);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the packed weight (a merged SwiGLU layer
  as its two GEMMs).

Each round takes the best of ``--inner`` chain runs per way; the figure is the median over
``--rounds`` rounds, as milliseconds and as weight bytes over time (GB/s, comparable with ``bench
membw``'s read figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def add_gemv_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench gemv``."""
    p = bench_sub.add_parser("gemv", help="a decode step's linear layers: small-GEMM kernel vs oneDNN")
    common(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="input rows (decode batch sizes)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds; the median counts")
    p.add_argument("--inner", type=int, default=5, help="chain runs per way per round; the best counts")
    p.set_defaults(func=cmd_gemv)


def _layers(model: Any) -> list[tuple[Any, list[Any], Any]]:
    """``(kernel weight, oneDNN packed weights, bias)`` of every packed linear layer with a kernel copy."""
    from framework.models.cpu_linear import PackedLinear, PackedSwiGLU

    out = []
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.small_weight is not None:
            out.append((module.small_weight, [module.packed_weight], module.bias))
        elif isinstance(module, PackedSwiGLU) and module.small_weight is not None:
            out.append((module.small_weight, [module.gate, module.up], module.small_bias))
    return out


def time_chains(layers: list[tuple[Any, list[Any], Any]], rows: int, rounds: int, inner: int) -> dict[str, float]:
    """Median (over ``rounds``) of the best-of-``inner`` time of each way through all ``layers``."""
    import torch

    from framework.kernels import small_gemm

    dtype = layers[0][0].dtype
    fn, threads = small_gemm._gemm_fn(dtype is torch.float32), torch.get_num_threads()
    inputs = {w.in_features: torch.randn(rows, w.in_features).to(dtype) for w, _, _ in layers}
    outputs = [torch.empty(rows, w.out_features, dtype=dtype) for w, _, _ in layers]

    def kernel() -> None:
        # The C function itself: small_linear would hand row counts past the build's limit to oneDNN.
        for (w, _, bias), y in zip(layers, outputs, strict=True):
            x = inputs[w.in_features]
            fn(x.data_ptr(), x.stride(0), w.data.data_ptr(), None if bias is None else bias.data_ptr(), None, 0,
               y.data_ptr(), w.out_features, rows, w.out_features, w.in_features, threads)

    def onednn() -> None:
        for w, packed, _ in layers:
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(inputs[w.in_features], p, None, "none", [], "")

    best: dict[str, list[float]] = {"kernel": [], "onednn": []}
    for _ in range(rounds):
        for name, run in (("kernel", kernel), ("onednn", onednn)):
            run()  # warm: the previous way's weights are in the caches, not these
            times = []
            for _ in range(inner):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best[name].append(min(times))
    return {name: statistics.median(ts) for name, ts in best.items()}


def run_gemv(engine: Any, rows_list: list[int], rounds: int, inner: int) -> dict[str, Any]:
    """Both ways at each row count for ``engine``'s model; raises when it has no kernel copies."""
    from framework.bench.membw import significant
    from framework.kernels import small_gemm

    layers = _layers(engine.runner.model)
    if not layers:
        raise SystemExit("bench gemv: the model has no small-GEMM layers (set device.cpu_small_gemm=kernel; "
                         "it needs oneDNN-packed fp32, or bf16 on a CPU with native bf16)")
    nbytes = sum(w.out_features * w.in_features for w, _, _ in layers) * layers[0][0].data.element_size()
    dtype = layers[0][0].dtype
    results = []
    for rows in rows_list:
        t = time_chains(layers, rows, rounds, inner)
        results.append({"rows": rows, "engine_uses": "kernel" if rows <= small_gemm.max_rows(dtype) else "onednn",
                        # Significant digits, not decimals: a tiny model's chain takes microseconds.
                        "kernel_ms": significant(t["kernel"] * 1e3), "onednn_ms": significant(t["onednn"] * 1e3),
                        "kernel_gb_s": round(nbytes / t["kernel"] / 1e9, 2),
                        "onednn_gb_s": round(nbytes / t["onednn"] / 1e9, 2),
                        "kernel_speedup": significant(t["onednn"] / t["kernel"])})
    return {"dtype": str(dtype).removeprefix("torch."), "layers": len(layers),
            "weight_bytes": nbytes, "kernel_max_rows": small_gemm.max_rows(dtype), "rounds": rounds, "inner": inner,
            "results": results}


def cmd_gemv(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, engine_from_args, environment

    args.overrides = ["device.cpu_small_gemm=kernel", *args.overrides]
    engine, _ = engine_from_args(args)
    result = run_gemv(engine, args.rows, args.rounds, args.inner)
    append_result(args.output, {"kind": "gemv", "tag": args.tag, "model": engine.runner.describe(),
                                "overrides": list(args.overrides), **environment(), **result})
    print(json.dumps(result, indent=2))
    return 0
