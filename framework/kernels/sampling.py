"""Token draws of a sampling step on CPU in C (``sampling.c``): inverse-CDF sampling from rows of
probabilities and the greedy argmax.

Each function returns ``None`` when the kernel does not apply (not CPU, not fp32, no C compiler),
and the caller then runs the torch ops (:func:`inverse_cdf_torch`, ``Tensor.argmax``).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("sampling.c")
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fPIC", "-shared"]


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "sampling", CFLAGS, "sampling kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sample_rows_f32.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int]
    lib.sample_rows_f32.restype = ctypes.c_int
    lib.argmax_rows_f32.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.argmax_rows_f32.restype = None
    return lib


def kernel_available() -> bool:
    """Whether the C kernel builds and loads here."""
    return _load() is not None


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_cpu and x.dtype == torch.float32 and (x.shape[1] <= 1 or x.stride(1) == 1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor | None:
    """Per row of ``probs`` ([rows, V] float32, >= 0, rows need not sum to 1) the first index whose
    cumulative probability exceeds ``uniforms[row]`` (float64 in [0, 1)) times the row's total: a
    draw from the row's distribution that never picks an entry of probability 0. ``None`` when the
    kernel does not apply."""
    if not _rows_ok(probs) or probs.shape[1] == 0:
        return None
    lib = _load()
    if lib is None:
        return None
    u = uniforms.to(torch.float64).contiguous()
    if u.numel() != probs.shape[0]:
        raise ValueError(f"one uniform per row expected: {probs.shape[0]} rows, {u.numel()} uniforms")
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    if probs.shape[0] and lib.sample_rows_f32(probs.data_ptr(), probs.stride(0), probs.shape[0], probs.shape[1],
                                              u.data_ptr(), out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("sampling kernel: no memory for a row's block sums")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of 2-D float32 rows on CPU (same index: the first largest, the first NaN
    if any), or ``None`` when the kernel does not apply."""
    if not _rows_ok(x) or x.shape[1] == 0:
        return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def inverse_cdf_torch(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`sample_from_probs` in torch ops, on any device (cumulative sums in float64)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total; just under it the search still lands on an entry
    # of probability above 0 (the cumulative sum rises there).
    target = torch.minimum(uniforms.to(cdf).reshape(-1, 1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
