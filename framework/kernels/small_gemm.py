"""Linear layers at a decode step's few rows, in one C call (``small_gemm.c``).

At up to :func:`max_rows` rows a linear layer reads every weight once and does little arithmetic
with it (up to ~10 rows in fp32 the arithmetic still fits under the weight stream), so its speed
is the rate the cores stream the weight at. The C kernel walks its own copy of the weight
(:func:`pack_weight`: panels of 32 output columns, each one sequential stream, the 32 weights of
each k side by side) in per-thread chunks of panels, as a GEMM micro-kernel: each k's weights are
loaded once and multiplied into every input row's accumulators. On the Zen 4 host (AVX-512,
AVX512-BF16) it streamed llama-120m's weights ~1.5x faster than oneDNN's GEMV at one row, and was
faster than oneDNN's blocked GEMM up to 32 rows in fp32 and 24 in bf16 (on the Sapphire Rapids
host, with bf16 on its AMX tiles, up to 64 in both). On AVX2 the full-panel tile holds 2 rows, so
fp32 calls of 3 rows or more run half-panel tiles of 6 rows x 16 columns, each tile also fetching
its share of the next panel (past 56 rows its first 128 KB) and from 24 rows reading a block-wise,
k-major copy of the input, which reach ~160 GFLOP/s on the 2-core
AVX2 Zen 3 host (bf16, with no native dot product on such CPUs, keeps 8 rows). Hence the
per-build, per-dtype limit (docs/benchmarks.md).

:func:`small_linear` returns ``None`` when the kernel does not apply (not fp32 or bf16 CPU tensors,
too many rows, autograd on, no C compiler) and the caller runs its usual GEMM.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from framework.kernels.build import load_optional

SOURCE = Path(__file__).with_name("small_gemm.c")
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it GCC keeps
# exp_nonpositive's floorf scalar (so the SwiGLU epilogue's SiLU would not vectorise); values are
# the same either way (unlike -ffast-math, it permits no reassociation). -mprefer-vector-width=512:
# GCC vectorises those loops 256 bits wide on Intel cores otherwise; the SwiGLU call at 64-256 rows
# measured 5% faster with 512 (Sapphire Rapids host); a no-op without AVX-512.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-mprefer-vector-width=512", "-fPIC", "-shared"]

_DTYPES = (torch.float32, torch.bfloat16)

#: The most rows the kernel takes on any build (``MAX_ROWS_ANY`` in the C); the build for this CPU
#: takes at most that (:func:`max_rows`: all of it in fp32 where the kernel has AMX tiles, fewer
#: elsewhere): above its limit oneDNN's blocked GEMM measured faster.
MAX_ROWS = 128


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "small_gemm", CFLAGS, "small-GEMM kernel")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.small_gemm, lib.small_gemm_bf16):
        fn.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.small_gemm_swiglu.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.small_gemm_swiglu.restype = ctypes.c_int
    lib.small_gemm_bf16_f32out.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int]
    lib.small_gemm_bf16_f32out.restype = ctypes.c_int
    for fn in (lib.small_gemm_max_rows, lib.small_gemm_fused_max_rows):
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.small_gemm_amx.argtypes = []
    lib.small_gemm_amx.restype = ctypes.c_int
    geometry = (lib.small_gemm_panel_cols(), lib.small_gemm_k_align(), lib.small_gemm_max_rows_any())
    if geometry != (PANEL_COLS, K_ALIGN, MAX_ROWS):
        raise RuntimeError("small_gemm.c and small_gemm.py disagree on the panel layout")
    return lib


def kernel_available() -> bool:
    """Whether the C kernel builds and loads here."""
    return _load() is not None


def kernel_uses_amx() -> bool:
    """Whether the kernel's bf16 calls run on AMX tiles here (a build for a CPU with AMX, and the OS
    granted the tile state)."""
    lib = _load()
    return lib is not None and bool(lib.small_gemm_amx())


def _row_limit(c_function: str, dtype: torch.dtype, amx_cap: int | None = None) -> int:
    """One of the C side's per-build row limits for ``dtype``, at most :data:`MAX_ROWS` (and at most
    ``amx_cap`` for bf16 where oneDNN has AMX and this kernel does not use it); 0 without the kernel."""
    lib = _load()
    if lib is None:
        return 0
    limit = min(MAX_ROWS, int(getattr(lib, c_function)(int(dtype == torch.bfloat16))))
    capped = amx_cap is not None and dtype == torch.bfloat16 and amx_available() and not kernel_uses_amx()
    return min(limit, amx_cap) if capped else limit


#: bf16 row limits where the CPU has AMX but this kernel's build does not use it (a compiler without
#: AMX support, or tiles the OS refused; where the kernel has them it beats oneDNN at every row
#: count, see ``small_gemm_max_rows`` in the C). oneDNN then multiplies bf16 on AMX tiles, and its
#: GEMM overtakes this kernel's AVX512-BF16 tiles after a few rows. Sapphire Rapids host, llama-120m's 48
#: decode GEMMs (12 layers), this kernel / oneDNN: 1 row 0.74, 4 rows 0.85, 8 rows 1.11, 16 rows
#: 1.52, 32 rows 2.41, 64 rows 3.86. Whole bf16 decode steps, fused step / module path on oneDNN
#: (alternating): 1 row 0.58, 8 rows 0.79, 12 rows 0.88, 14 rows 0.99, 16 rows 1.02, 24 rows 1.21,
#: 32 rows 1.38. The builds' own limits (24 and 48 in bf16) were measured on a Zen 4 without AMX.
AMX_BF16_MAX_ROWS, AMX_BF16_FUSED_MAX_ROWS = 4, 14


@lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether torch (oneDNN) can use AMX tiles on this CPU (its own probe, which also asks the OS)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


@lru_cache(maxsize=2)
def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """The most rows :func:`small_linear` takes here for ``dtype`` weights (``small_gemm_max_rows``
    of this CPU's build: with AVX2 64 in fp32 and 8 in bf16; with AVX-512 32 in fp32 and 24 in
    bf16; where the kernel has AMX tiles (an Intel core) 128 in fp32 and in bf16; 4 in bf16
    where only oneDNN has AMX: :data:`AMX_BF16_MAX_ROWS`); 0 when the kernel is unavailable."""
    return _row_limit("small_gemm_max_rows", dtype, AMX_BF16_MAX_ROWS)


@lru_cache(maxsize=2)
def fused_max_rows(dtype: torch.dtype = torch.float32) -> int:
    """The most rows a fused decode step (:mod:`framework.models.fused_decode`) runs through the
    kernel here (``small_gemm_fused_max_rows``: with AVX-512 64 in fp32 and 48 in bf16, 64 in bf16
    on the kernel's AMX tiles, 14 in bf16 where only oneDNN has AMX
    (:data:`AMX_BF16_FUSED_MAX_ROWS`), more than :func:`max_rows` because the fused step
    also saves the module path's per-layer calls; with AVX2 :func:`max_rows` capped at 64); 0 when
    the kernel is unavailable."""
    return _row_limit("small_gemm_fused_max_rows", dtype, AMX_BF16_FUSED_MAX_ROWS)


#: Output columns (weight rows) per panel of the kernel's weight layout (``small_gemm.c``), and
#: what the input length is padded to (bf16 keeps k in pairs).
PANEL_COLS, K_ALIGN = 32, 8


def k_group(dtype: torch.dtype) -> int:
    """Inputs (k) kept together per output in a panel: 2 for bf16 (AVX512-BF16 multiplies pairs), 1
    for fp32."""
    return 2 if dtype == torch.bfloat16 else 1


@dataclass(frozen=True, eq=False)
class PanelWeight:
    """A linear weight ``[out_features, in_features]`` in the kernel's column-panel layout (see
    ``small_gemm.c``), zero-padded to whole panels and to a multiple of :data:`K_ALIGN` columns:
    ``data`` is ``[panels, K / g, 32, g]`` with ``g`` from :func:`k_group` (fp32: each k's 32
    weights side by side; bf16: each output's pair of k side by side), so each panel is one
    sequential stream. Made by :func:`pack_weight`; :meth:`dense` gives the plain weight back, bit
    for bit."""

    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dense(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight this was packed from (a new tensor)."""
        full = self.data.permute(0, 2, 1, 3).reshape(self.data.shape[0] * PANEL_COLS, -1)
        return full[: self.out_features, : self.in_features].contiguous()


def pack_weight(weight: torch.Tensor) -> PanelWeight:
    """``weight`` (``[N, K]``, fp32 or bf16) copied into the kernel's column-panel layout."""
    n, k = weight.shape
    rows, cols = -(-n // PANEL_COLS) * PANEL_COLS, -(-k // K_ALIGN) * K_ALIGN
    padded = weight.detach().contiguous()
    if (rows, cols) != (n, k):
        padded = weight.new_zeros(rows, cols)
        padded[:n, :k] = weight.detach()
    group = k_group(weight.dtype)
    data = padded.view(rows // PANEL_COLS, PANEL_COLS, cols // group, group).permute(0, 2, 1, 3).contiguous()
    return PanelWeight(data, n, k)


def small_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None,
                 add: torch.Tensor | None = None, swiglu: bool = False, float_out: bool = False) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ add)`` as a new tensor of ``x``'s leading shape, or ``None`` when the
    kernel does not apply. ``weight`` is ``W`` from :func:`pack_weight`, fp32 or bf16, of ``x``'s
    dtype (as ``bias`` and ``add``). bf16 accumulates in fp32 and rounds the output, then rounds
    again after ``add``, as ``add + F.linear(x, W, bias)`` does.

    ``swiglu``: ``W`` is a merged ``[gate; up]`` weight and the result is ``F.silu(gate) * up``
    (half as wide; bf16 rounds the GEMM, the SiLU and the product, as those torch ops do), in the
    same call; ``None`` also when half of ``W``'s rows is not a multiple of :data:`PANEL_COLS`.

    ``float_out`` (bf16, no ``add`` or ``swiglu``): the result in float32, bitwise ``.float()`` of
    the bf16 result, written by the kernel itself (the LM head: see :func:`float_linear`).

    Called ~60 times per decode step, so the checks are ordered for the common case (2-D rows, no
    reshape, no view): each tensor attribute costs a fraction of a microsecond, and this wrapper
    took 14 us a call before, against ~1 us of C for a small layer."""
    dtype = x.dtype
    if weight.dtype != dtype or dtype not in _DTYPES or not x.is_cpu:
        return None
    lead = x.dim() != 2
    k = x.shape[-1] if x.dim() else 0
    rows = (x.numel() // k if k else 0) if lead else x.shape[0]
    if rows == 0 or rows > max_rows(dtype) or weight.in_features != k:
        return None
    n = weight.out_features
    if swiglu and (add is not None or n % (2 * PANEL_COLS)):
        return None
    if float_out and (dtype is not torch.bfloat16 or add is not None or swiglu):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None  # autograd cannot see through the kernel
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or not bias.is_contiguous()):
        return None
    fn = _gemm_fn(dtype is torch.float32)
    if fn is None:
        return None
    x2 = x.reshape(rows, k) if lead else x
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    add2 = None
    if add is not None:
        if add.dtype != dtype or add.numel() != rows * n:
            return None
        add2 = add.reshape(rows, n) if add.dim() != 2 else add
        if add2.stride(1) != 1 or add2.stride(0) < n:
            add2 = add2.contiguous()
    width = n // 2 if swiglu else n
    out = torch.empty(rows, width, dtype=torch.float32 if float_out else dtype)
    if float_out:
        rc = _float_out_fn()(x2.data_ptr(), x2.stride(0), weight.data.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
                             torch.get_num_threads())
    elif swiglu:
        rc = _swiglu_fn()(x2.data_ptr(), x2.stride(0), weight.data.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), width, rows, n, k,
                          torch.get_num_threads(), dtype is torch.bfloat16)
    else:
        rc = fn(x2.data_ptr(), x2.stride(0), weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
                None if add2 is None else add2.data_ptr(), 0 if add2 is None else add2.stride(0),
                out.data_ptr(), n, rows, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"small_gemm rejected its arguments (rows {rows}, out {n}, in {k})")
    return out.view(*x.shape[:-1], width) if lead else out


@lru_cache(maxsize=2)
def _gemm_fn(fp32: bool) -> object | None:
    """The C function for fp32 or bf16 itself (a ctypes attribute lookup per call was measurable)."""
    lib = _load()
    return None if lib is None else (lib.small_gemm if fp32 else lib.small_gemm_bf16)


@lru_cache(maxsize=1)
def _float_out_fn() -> object | None:
    """The C function of ``small_linear(..., float_out=True)`` (bf16)."""
    lib = _load()
    return None if lib is None else lib.small_gemm_bf16_f32out


@lru_cache(maxsize=1)
def _swiglu_fn() -> object | None:
    """The C function of ``small_linear(..., swiglu=True)`` (fp32 and bf16 alike)."""
    lib = _load()
    return None if lib is None else lib.small_gemm_swiglu
