"""Linear layers at a decode step's few rows, in one C call (``small_gemm.c``).

At up to :data:`MAX_ROWS` rows a linear layer reads every weight once and does little arithmetic
with it, so its speed is the rate the cores stream the weight at. The C kernel walks the plain
``nn.Linear`` weight in contiguous per-thread slices; on this project's 2-core AVX2 host it streamed
the ``llama-120m`` weights at ~20.5 GB/s at one row where oneDNN's packed GEMV streamed ~19, and was
1.4x / 1.1x / 1.2x faster at 2 / 4 / 8 rows (``plugserve bench small-gemm``). At 16 rows the two
were even and above that oneDNN's blocked GEMM wins, hence the limit.

:func:`small_linear` returns ``None`` when the kernel does not apply (not fp32 CPU tensors, too
many rows, autograd on, no C compiler) and the caller runs its usual GEMM.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("small_gemm.c")
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared"]

#: The most rows the kernel takes; above it oneDNN's blocked GEMM measured faster.
MAX_ROWS = 8


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "small_gemm", CFLAGS, "small-GEMM kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.small_gemm.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64, i64, ctypes.c_int]
    lib.small_gemm.restype = ctypes.c_int
    return lib


def kernel_available() -> bool:
    """Whether the C kernel builds and loads here."""
    return _load() is not None


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 add: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T (+ bias) (+ add)`` as a new tensor of ``x``'s leading shape, or ``None`` when
    the kernel does not apply. ``weight`` must be a contiguous fp32 ``[N, K]`` CPU tensor.

    Called ~60 times per decode step, so the checks are ordered for the common case (2-D rows, no
    reshape, no view): each tensor attribute costs a fraction of a microsecond, and this wrapper
    took 14 us a call before, against ~1 us of C for a small layer."""
    if x.dtype != torch.float32 or not x.is_cpu or weight.dtype != torch.float32:
        return None
    lead = x.dim() != 2
    k = x.shape[-1] if x.dim() else 0
    rows = (x.numel() // k if k else 0) if lead else x.shape[0]
    if rows == 0 or rows > MAX_ROWS or weight.dim() != 2 or weight.shape[1] != k:
        return None
    n = weight.shape[0]
    if not weight.is_contiguous() or not weight.is_cpu:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # autograd cannot see through the kernel
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    fn = _gemm_fn()
    if fn is None:
        return None
    x2 = x.reshape(rows, k) if lead else x
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    add2 = None
    if add is not None:
        if add.dtype != torch.float32 or add.numel() != rows * n:
            return None
        add2 = add.reshape(rows, n) if add.dim() != 2 else add
        if add2.stride(1) != 1 or add2.stride(0) < n:
            add2 = add2.contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    rc = fn(x2.data_ptr(), x2.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            None if add2 is None else add2.data_ptr(), 0 if add2 is None else add2.stride(0),
            out.data_ptr(), n, rows, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"small_gemm rejected its arguments (rows {rows}, out {n}, in {k})")
    return out.view(*x.shape[:-1], n) if lead else out


@lru_cache(maxsize=1)
def _gemm_fn() -> object | None:
    """The C function itself (a ctypes attribute lookup per call was measurable)."""
    lib = _load()
    return None if lib is None else lib.small_gemm
