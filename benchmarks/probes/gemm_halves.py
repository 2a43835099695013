"""Probe: what splitting a decode batch in two halves costs the small-GEMM kernel.

llama-120m's 48 decode GEMMs (12 layers of qkv, o_proj, gate/up with SwiGLU, down; random fp32
weights in the kernel's panel layout) at M rows in one call each, against two calls of M/2 rows
each (every weight streamed twice, half the rows per panel). Not part of plugserve: a measurement
for docs/benchmarks.md ("can decode attention hide behind the GEMMs?").

    python benchmarks/probes/gemm_halves.py 64 32 16
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from framework.kernels import small_gemm

SHAPES = ((2304, 768, False), (768, 768, False), (4096, 768, True), (768, 2048, False))
"""(N, K, SwiGLU) of one llama-120m layer's GEMMs."""


def main(rows: list[int], rounds: int = 30, threads: int = 2) -> None:
    lib = small_gemm._load()
    if lib is None:
        sys.exit("the small-GEMM kernel did not build on this machine")
    torch.manual_seed(0)
    layers = [[(small_gemm.pack_weight(torch.randn(n, k) * 0.02), n, k, swiglu) for n, k, swiglu in SHAPES]
              for _ in range(12)]
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in (768, 2048)}
        out = torch.empty(m, 4096)
        whole, halves = [], []
        for _ in range(rounds):  # alternating, so both see the same minutes of a shared machine
            whole.append(_chain(lib, layers, inputs, out, m, 1, threads))
            halves.append(_chain(lib, layers, inputs, out, m // 2, 2, threads))
        a, b = statistics.median(whole), statistics.median(halves)
        print(f"{m} rows: one call per GEMM {a * 1e3:.1f} ms, two calls of {m // 2} rows {b * 1e3:.1f} ms, "
              f"ratio {b / a:.2f}")


def _chain(lib, layers, inputs: dict[int, torch.Tensor], out: torch.Tensor, part_rows: int, parts: int,
           threads: int) -> float:
    """Seconds for every layer's GEMMs, each called ``parts`` times on ``part_rows`` rows."""
    start = time.perf_counter()
    for layer in layers:
        for part in range(parts):
            for weight, n, k, swiglu in layer:
                x = inputs[k][part * part_rows:]
                w = weight.data.data_ptr()
                if swiglu:
                    lib.small_gemm_swiglu(x.data_ptr(), k, w, None, out.data_ptr(), n // 2, part_rows, n, k, threads, 0)
                else:
                    lib.small_gemm(x.data_ptr(), k, w, None, None, 0, out.data_ptr(), n, part_rows, n, k, threads)
    return time.perf_counter() - start


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 32, 16])
