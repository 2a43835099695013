"""A decode step's decoder layers in one C call (``decode_layers.c``; why: ``decode_abi.h``).

This module holds the C side's structures and loader; :mod:`framework.models.fused_decode` decides
when a model's layers can run this way and fills them in. The kernels themselves stay in their own
libraries (:mod:`framework.kernels.small_gemm`, :mod:`~framework.kernels.rmsnorm`,
:mod:`~framework.kernels.rotary`), reached through function pointers, so the fused step runs the
very code (and floating-point flags) of the separate calls.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels import rmsnorm, rotary, small_gemm
from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("decode_layers.c")
CFLAGS = ["-O2", "-fPIC", "-shared"]

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class DecodeKernels(ctypes.Structure):
    """``decode_kernels``: the C functions of one dtype."""

    _fields_ = [("norm", _p), ("gemm", _p), ("swiglu", _p), ("rotary", _p)]


class DecodeLayerWeights(ctypes.Structure):
    """``decode_layer_weights``: one layer's norm weights and panel-layout linear weights."""

    _fields_ = [("input_norm", _p), ("post_norm", _p), ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("qkv", _p), ("qkv_bias", _p), ("o", _p), ("o_bias", _p), ("gate_up", _p), ("gate_up_bias", _p),
                ("down", _p), ("down_bias", _p)]


class DecodeStep(ctypes.Structure):
    """``decode_step``: shapes, this step's buffers and the backend's attention."""

    _fields_ = [("rows", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("rot", _i64), ("threads", _i64), ("bf16", _i64),
                ("x_in", _p), ("x", _p), ("x_mid", _p), ("normed", _p), ("qkv", _p), ("q", _p), ("k", _p),
                ("v", _p), ("attn", _p), ("act", _p), ("cos", _p), ("sin", _p), ("cs_stride", _i64),
                ("attention", _p), ("attention_ctx", _p)]


#: Stages of the C status word, for the error message.
STAGES = {1: "input norm", 2: "qkv projection", 3: "rotary embedding", 4: "attention", 5: "o_proj",
          6: "post-attention norm", 7: "gate/up projection", 8: "down projection"}


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "decode_layers", CFLAGS, "fused decode layers")
    if lib is None:
        return None
    lib.decode_layers.argtypes = [ctypes.POINTER(DecodeKernels), ctypes.POINTER(DecodeLayerWeights), _i64,
                                  ctypes.POINTER(DecodeStep)]
    lib.decode_layers.restype = _i64
    return lib


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


@lru_cache(maxsize=2)
def kernels(dtype: torch.dtype) -> DecodeKernels | None:
    """The kernels of ``dtype`` (fp32 or bf16) for :func:`run`, or None when one of them (or the
    fused step itself) cannot be built here."""
    libs = (_load(), small_gemm._load(), rmsnorm._load(), rotary._load())
    if any(lib is None for lib in libs) or dtype not in (torch.float32, torch.bfloat16):
        return None
    _, gemm_lib, norm_lib, rotary_lib = libs
    fp32 = dtype == torch.float32
    return DecodeKernels(
        norm=_address(norm_lib.rmsnorm_f32 if fp32 else norm_lib.rmsnorm_bf16),
        gemm=_address(gemm_lib.small_gemm if fp32 else gemm_lib.small_gemm_bf16),
        swiglu=_address(gemm_lib.small_gemm_swiglu),
        rotary=_address(rotary_lib.rotary_qkv_f32 if fp32 else rotary_lib.rotary_qkv_bf16),
    )


def run(kernel_set: DecodeKernels, layers: ctypes.Array, step: DecodeStep) -> None:
    """Run ``len(layers)`` layers (``decode_layers``); raise naming the layer and stage that failed."""
    lib = _load()
    assert lib is not None  # kernel_set came from kernels(), which needs it
    status = lib.decode_layers(ctypes.byref(kernel_set), layers, len(layers), ctypes.byref(step))
    if status:
        layer, stage, code = (status >> 8) - 1, (status >> 4) & 15, status & 15
        raise RuntimeError(f"fused decode step: the {STAGES.get(stage, stage)} kernel of layer {layer} "
                           f"failed with status {code}")
