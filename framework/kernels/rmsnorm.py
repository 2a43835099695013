"""RMSNorm of fp32 or bf16 rows on CPU in one C call (``rmsnorm.c``).

:func:`rms_norm` returns ``None`` when the kernel does not apply (another dtype, not CPU, autograd
on, rows that are not contiguous, no C compiler), and the caller then runs the torch ops.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("rmsnorm.c")
# -ffp-contract=off: every square, product and sum rounds on its own, as in the torch ops.
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off"]


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "rmsnorm", CFLAGS, "RMSNorm kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.rmsnorm_f32, lib.rmsnorm_bf16):
        fn.argtypes = [p, i64, p, p, i64, i64, ctypes.c_float, i64]
        fn.restype = ctypes.c_int
    return lib


def kernel_available() -> bool:
    """Whether the C kernel builds and loads here."""
    return _load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over the last dim as a new contiguous tensor
    (written into ``out`` when given: contiguous, ``x``'s shape and dtype), or ``None`` when the
    kernel does not apply. fp32, or bf16 ``x`` and ``weight`` (math in fp32, rounded to bf16 where
    transformers rounds)."""
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype or not x.is_cpu:
        return None
    dims = x.dim()
    if dims < 1:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # autograd cannot see through the kernel
    d = x.shape[-1]
    if d == 0 or weight.dim() != 1 or weight.shape[0] != d or not weight.is_contiguous() or not weight.is_cpu:
        return None
    rows = x.reshape(-1, d) if dims != 2 else x
    if rows.stride(1) != 1 and d > 1:
        return None
    fn = _norm_fn(x.dtype == torch.float32)
    if fn is None:
        return None
    if out is None:
        out = torch.empty(rows.shape, dtype=x.dtype)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"rms_norm: out must be a contiguous CPU {x.dtype} tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    else:
        out = out.view(rows.shape)
    n = rows.shape[0]
    if n:
        fn(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), n, d, float(eps),
           torch.get_num_threads())
    return out.view(x.shape) if dims != 2 else out


@lru_cache(maxsize=2)
def _norm_fn(fp32: bool) -> object | None:
    """The C function for fp32 or bf16 (looked up once: this runs twice per layer per step)."""
    lib = _load()
    if lib is None:
        return None
    return lib.rmsnorm_f32 if fp32 else lib.rmsnorm_bf16
