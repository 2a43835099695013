"""Fused rotary embedding for fp32 and bf16 q/k on CPU (``rotary.c``), bitwise equal to the torch form.

:func:`rotary_qkv` is what the models call through :func:`framework.models.layers.apply_rotary_qkv`;
it returns ``None`` when the kernel does not apply (not fp32 or bf16, not CPU, a layout it does not
take, no C compiler), and the caller then runs the torch ops. In bf16 the torch form was ~13 small
ops per layer (a bf16 decode step at batch 1 spent more time in them than in its attention).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("rotary.c")
# -ffp-contract=off: no fused multiply-add; every product and sum must round on its own, as in torch (bitwise equality).
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off"]


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "rotary", CFLAGS, "fused rotary kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.rotary_qkv_f32, lib.rotary_qkv_bf16):
        fn.argtypes = [p, i64, p, i64, p, i64, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64]
        fn.restype = ctypes.c_int
    return lib


def kernel_available() -> bool:
    """Whether the C kernel builds and loads here."""
    return _load() is not None


_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A 2-D CPU tensor of ``dtype`` whose rows have contiguous elements (any row stride)."""
    return t.dim() == 2 and t.dtype == dtype and t.is_cpu and t.stride(1) == 1


def rotary_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rotated ``q`` and ``k`` and a copy of ``v``, all new contiguous ``[n, heads * head_dim]``
    tensors; ``None`` when the kernel does not apply. ``q``/``k``/``v`` are ``[n, heads * head_dim]``
    (row strides free: views into a merged qkv output are fine); ``cos``/``sin`` ``[n, 1, rot]``."""
    n, dtype = q.shape[0], q.dtype
    if dtype not in _DTYPES:
        return None
    if not (_rows(q, dtype) and _rows(k, dtype) and _rows(v, dtype)):
        return None
    if k.shape[1] != v.shape[1] or n != k.shape[0] or n != v.shape[0]:
        return None
    if q.shape[1] % head_dim or k.shape[1] % head_dim:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # autograd cannot see through the kernel
    # [n, 1, rot] rows are already what the kernel reads: take their stride instead of reshaping
    # (two reshapes were ~4 us of the ~30 us this wrapper cost per layer and step).
    if cos.dim() == 3 and cos.shape[1] == 1 and cos.dtype == dtype and cos.is_cpu and cos.stride(2) == 1:
        cos2, sin2 = cos, sin
        if sin.shape != cos.shape or sin.stride() != cos.stride() or sin.dtype != dtype or not sin.is_cpu:
            return None
        rot = cos.shape[2]
    else:
        cos2, sin2 = cos.reshape(n, -1), sin.reshape(n, -1)
        if not (_rows(cos2, dtype) and _rows(sin2, dtype)):
            return None
        if cos2.stride(0) != sin2.stride(0) or cos2.shape != sin2.shape:
            return None
        rot = cos2.shape[1]
    lib = _load()
    if lib is None:
        return None
    # Plain int sizes: torch.empty parses a torch.Size argument ~2 us slower.
    q_out = torch.empty(n, q.shape[1], dtype=dtype)
    k_out = torch.empty(n, k.shape[1], dtype=dtype)
    v_out = torch.empty(n, v.shape[1], dtype=dtype)
    fn = lib.rotary_qkv_f32 if dtype is torch.float32 else lib.rotary_qkv_bf16
    status = fn(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos2.data_ptr(),
        sin2.data_ptr(), cos2.stride(0), q_out.data_ptr(), k_out.data_ptr(), v_out.data_ptr(), n,
        q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim, rot, torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"rotary_qkv: rotary dim {rot} must be even and at most head_dim {head_dim}")
    return q_out, k_out, v_out
