"""Build oneDNN's GEMM primitives for every row bucket before the first request needs them.

Why: oneDNN JIT-compiles a primitive the first time a packed GEMM runs at a new row count
(:func:`~framework.models.onednn_rows.bucket_rows` bounds those counts, it does not remove the
first build). On the Sapphire Rapids host that first call cost 2-4 ms more per weight shape, so a
step whose rows reach a new bucket took ~25-30 ms longer than the next step of that size (a bf16
llama-120m prefill of 3 x 128 tokens: 88 ms the first time, 59 after; 4 x 128: 111 against 78).
Served, those first steps are some user's TTFT: the first wave of a new concurrency paid them. This
is the CPU counterpart of capturing CUDA graphs at start-up (vLLM and SGLang pay that too): one
call per distinct layer shape and bucket, with zero inputs, before the server says it is ready.

The calls mirror how the model calls each layer, which the layer declares (``gemm_call`` on
:class:`~framework.models.parallel.ParallelLinear`): ``plain`` (``linear(x)``), ``add`` (its
output plus the residual, :func:`~framework.models.cpu_linear.linear_add`: oneDNN builds another
primitive for the fused add) or ``logits`` (the LM head, :func:`~framework.models.cpu_linear.float_linear`,
which only ever sees the rows that sample). A plain ``nn.Linear`` counts as ``plain``. Layers of the
same kind, shape, dtype and paths share primitives, so one of each is called.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from framework.kernels import small_gemm
from framework.models.cpu_linear import BLAS_MIN_ROWS, PackedLinear, PackedSwiGLU
from framework.models.onednn_rows import bucket_rows

logger = logging.getLogger(__name__)

GEMM_CALLS = ("plain", "add", "logits")
"""How a model calls a linear layer (its ``gemm_call``); see the module docstring."""


@dataclass(frozen=True)
class GemmWarmup:
    """What :func:`warm_packed_gemms` did: distinct layers, calls made, the largest row count it
    warmed, whether it got through every bucket within its time budget, and the seconds it took."""

    layers: int
    calls: int
    max_rows: int
    complete: bool
    seconds: float


def row_buckets(max_rows: int) -> list[int]:
    """Every row count a packed GEMM of 1..``max_rows`` rows runs at (ascending)."""
    return sorted({bucket_rows(rows) for rows in range(1, max_rows + 1)})


def _call_of(module: PackedLinear) -> str:
    call = getattr(module.source, "gemm_call", "plain")
    if call not in GEMM_CALLS:
        raise ValueError(f"{type(module.source).__name__}.gemm_call is {call!r}; allowed: {', '.join(GEMM_CALLS)}")
    return call


def _key(module: nn.Module, call: str) -> tuple:
    """Layers with equal keys run the same oneDNN primitives (and the same kernel paths)."""
    if isinstance(module, PackedSwiGLU):
        return ("swiglu", module.in_features, module.out_features, module.gate.dtype, module.gate_bias is None,
                module.small_weight is None, module.small_swiglu, module.panel, module.blas_gate is None,
                module.post_ops)
    return (call, module.in_features, module.out_features, module.packed_weight.dtype, module.bias is None,
            module.small_weight is None, module.panel, module.blas_weight is None)


def distinct_layers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """One packed layer per distinct key, with how the model calls it."""
    seen: dict[tuple, tuple[nn.Module, str]] = {}
    for module in model.modules():
        if isinstance(module, PackedSwiGLU):
            call = "plain"
        elif isinstance(module, PackedLinear):
            call = _call_of(module)
        else:
            continue
        seen.setdefault(_key(module, call), (module, call))
    return list(seen.values())


@contextmanager
def _local_only(module: nn.Module) -> Iterator[None]:
    """The layer's own GEMM without its tensor-parallel collective: every rank warms on its own,
    so none may wait for the others."""
    op = getattr(module, "output_op", None)
    if op is None:
        yield
        return
    module.output_op = None
    try:
        yield
    finally:
        module.output_op = op


def _call(module: nn.Module, call: str, rows: int) -> None:
    dtype = module.gate.dtype if isinstance(module, PackedSwiGLU) else module.packed_weight.dtype
    x = torch.zeros(rows, module.in_features, dtype=dtype)
    if call == "add":
        module.forward_add(x, torch.zeros(rows, module.out_features, dtype=dtype))
    elif call == "logits":
        module.forward_float(x)
    else:
        module(x)


def reaches_onednn(module: nn.Module, rows: int) -> bool:
    """Whether a call of ``rows`` rows runs oneDNN's packed GEMM, by the same dispatch as the
    layer's ``forward``: the small-GEMM kernel takes calls of up to ``small_gemm.max_rows`` rows, the
    panel GEMM every call past them, ``F.linear`` those of ``BLAS_MIN_ROWS`` rows and more on a
    dense copy; no primitive is built for those, so they are not warmed (on a large model they would
    be seconds of compute for nothing)."""
    swiglu = isinstance(module, PackedSwiGLU)
    dtype = module.gate.dtype if swiglu else module.packed_weight.dtype
    small = module.small_weight is not None
    if small and rows <= small_gemm.max_rows(dtype):
        return False
    if module.panel:
        return False
    dense = module.blas_gate if swiglu else module.blas_weight
    return dense is None or rows < BLAS_MIN_ROWS


@torch.inference_mode()
def warm_packed_gemms(model: nn.Module, max_rows: int, max_logits_rows: int,
                      max_seconds: float = math.inf) -> GemmWarmup:
    """Call each distinct packed layer of ``model`` once at every row bucket where it runs oneDNN:
    up to ``max_rows`` (a step's most tokens), and up to ``max_logits_rows`` for LM heads (a step's
    most sampling rows). Smaller buckets first (the commoner steps), and no bucket is started
    after ``max_seconds``: a large model's GEMMs are seconds each, and there a first call's few
    milliseconds of compiling matter little. Results are discarded; nothing in the model changes."""
    start = time.perf_counter()
    layers = distinct_layers(model)
    calls = reached = 0
    complete = True
    steps, heads = set(row_buckets(max_rows)), set(row_buckets(max_logits_rows))
    for rows in row_buckets(max(max_rows, max_logits_rows, 1)):
        if time.perf_counter() - start > max_seconds:
            complete = False
            break
        for module, call in layers:
            if rows in (heads if call == "logits" else steps) and reaches_onednn(module, rows):
                with _local_only(module):
                    _call(module, call, rows)
                calls += 1
        reached = rows
    done = GemmWarmup(layers=len(layers), calls=calls, max_rows=reached, complete=complete,
                      seconds=time.perf_counter() - start)
    if calls:
        logger.info("warmed oneDNN GEMMs: %d layer kinds, %d calls up to %d rows%s, %.2fs", done.layers, done.calls,
                    reached, "" if complete else f" (of {max_rows}: time budget spent)", done.seconds)
    return done
