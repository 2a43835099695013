"""Linear layers at prefill sizes on the small-GEMM kernel's weight copy, in one C call
(``panel_gemm.c``): fp32, on CPUs with AVX2 and FMA.

Where :mod:`framework.kernels.small_gemm` takes a decode step's few rows, this takes the calls past
its limit (prompts, mixed steps) on the same panel-packed weights, with the loops blocked for the
caches as BLIS's AVX2 kernels are (see the C file). On the AVX2-only Zen 3 host (2 cores) it ran
llama-120m's four GEMM shapes at 128 rows ~1.1x faster than oneDNN's packed weights and at 1,024
rows as fast as MKL's sgemm or faster (docs/benchmarks.md), and it needs no other weight copy than
the one the decode steps already read. ``device.cpu_prefill_gemm`` chooses it.

:func:`panel_linear` returns ``None`` when the kernel does not apply (not fp32 CPU tensors, a
column count off the 16-column tiles, autograd on, no C compiler or no AVX2 build) and the caller
runs its usual GEMM.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional
from framework.kernels.small_gemm import PanelWeight

SOURCE = Path(__file__).with_name("panel_gemm.c")
# -fno-trapping-math: lets GCC vectorise the SwiGLU epilogue's exp_nonpositive (see small_gemm.py).
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fPIC", "-shared"]

#: Output columns of the kernel's micro-tile: a layer's output width must be a multiple of it.
TILE_COLS = 16


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "panel_gemm", CFLAGS, "panel GEMM kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.panel_gemm.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.panel_gemm_swiglu.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.panel_gemm.restype = lib.panel_gemm_swiglu.restype = lib.panel_gemm_vector.restype = ctypes.c_int
    lib.panel_gemm_held_bytes.restype = ctypes.c_int64
    return lib


def kernel_available() -> bool:
    """Whether the kernel builds here with its AVX2 micro-kernel (the scalar fallback a build
    without AVX2 gets computes correctly, but far slower than oneDNN: :func:`panel_linear` does
    not use it unless ``vector_only`` is off)."""
    lib = _load()
    return lib is not None and bool(lib.panel_gemm_vector())


def held_bytes() -> int:
    """Bytes of input copy and SwiGLU sums the calling thread keeps between calls (at most
    ``KEEP_BYTES`` in the C, 64 MiB: a larger call's buffers are freed after it)."""
    lib = _load()
    return 0 if lib is None else int(lib.panel_gemm_held_bytes())


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None,
                 add: torch.Tensor | None = None, swiglu: bool = False,
                 vector_only: bool = True) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ add)``, or with ``swiglu`` ``F.silu(gate) * up`` of a merged
    ``[gate; up]`` weight (half as wide), as a new tensor of ``x``'s leading shape; ``None`` when
    the kernel does not apply. ``weight`` is fp32 from :func:`~framework.kernels.small_gemm.pack_weight`.
    The result differs from ``F.linear``'s by fp32 summation order; ``add`` is added last, as
    ``add + F.linear(x, W, bias)`` adds it. ``vector_only=False`` lets tests run the scalar
    fallback."""
    if x.dtype is not torch.float32 or weight.dtype is not torch.float32 or not x.is_cpu:
        return None
    lib = _load()
    if lib is None or (vector_only and not lib.panel_gemm_vector()):
        return None
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k or n % (2 * TILE_COLS if swiglu else TILE_COLS) or (swiglu and add is not None):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None  # autograd cannot see through the kernel
    if bias is not None and (bias.shape != (n,) or bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows == 0:
        return None
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    bias_ptr = None if bias is None else bias.data_ptr()
    kp = weight.data.shape[1]  # fp32 panels: [panels, K padded, 32, 1]
    threads = torch.get_num_threads()
    if swiglu:
        out = torch.empty(rows, n // 2, dtype=torch.float32)
        rc = lib.panel_gemm_swiglu(x2.data_ptr(), x2.stride(0), weight.data.data_ptr(), bias_ptr, out.data_ptr(),
                                   out.stride(0), rows, n, k, kp, threads)
    else:
        add2 = None
        if add is not None:
            if add.dtype is not torch.float32 or add.numel() != rows * n:
                return None
            add2 = add.reshape(rows, n)
            if add2.stride(1) != 1 or add2.stride(0) < n:
                add2 = add2.contiguous()
        out = torch.empty(rows, n, dtype=torch.float32)
        rc = lib.panel_gemm(x2.data_ptr(), x2.stride(0), weight.data.data_ptr(), bias_ptr,
                            None if add2 is None else add2.data_ptr(), 0 if add2 is None else add2.stride(0),
                            out.data_ptr(), n, rows, n, k, kp, threads)
    if rc != 0:
        raise RuntimeError(f"panel_gemm failed ({rc}) at rows {rows}, out {n}, in {k}")
    return out.view(*x.shape[:-1], out.shape[1])
