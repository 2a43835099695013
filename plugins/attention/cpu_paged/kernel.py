"""Build (once, cached) and call the C paged-decode kernel in ``decode_kernel.c``.

Building and caching is :mod:`framework.kernels.build`'s; this module declares the signature and
checks every tensor before handing its memory to C.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from framework.attention.base import NativeDecodeAttention
from framework.kernels.build import KernelUnavailable, build_and_load, compiler

__all__ = ["KV_DTYPES", "KernelUnavailable", "compiler", "extend_amx_supported", "extend_supported",
           "kernel_threading", "load_extend_kernel", "load_kernel", "native_decode_step", "paged_decode_attention",
           "paged_extend_attention", "store_kv_rows"]

SOURCE = Path(__file__).with_name("decode_kernel.c")
EXTEND_SOURCE = Path(__file__).with_name("extend_kernel.c")
# -march=native: the build happens on the machine that runs it. Reassociation lets gcc vectorise
# the dot products (the result differs from SDPA's order by float rounding only); no -ffast-math,
# so expf and inf/nan handling stay IEEE. -pthread for the variant built without OpenMP.
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast", "-pthread"]
# The extend kernel with 512-bit vectors where the CPU has them (gcc prefers 256-bit ones on
# Sapphire Rapids and Zen 4): its auto-vectorised softmax loops then took the whole fp32 kernel to
# 0.75x the time at 13 x 128-token prompts on the Sapphire Rapids host. (The decode kernel's loops
# are written in explicit vectors, and were measured with the default.)
EXTEND_CFLAGS = [*CFLAGS, "-mprefer-vector-width=512"]


#: K/V cache element types the kernel reads.
KV_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL:
    """Build the kernel if no cached build exists, load it and declare its signature."""
    lib = build_and_load(SOURCE, "cpu_paged_decode", CFLAGS)
    fn = lib.paged_decode_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, p, i64, i64, i64, i64, ctypes.c_float, i64, i64, p, p, p, i64, i64, i64]
    fn.restype = ctypes.c_int
    lib.paged_store_kv.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.paged_store_kv.restype = ctypes.c_int
    lib.paged_decode_uses_openmp.argtypes = []
    lib.paged_decode_uses_openmp.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def load_extend_kernel() -> ctypes.CDLL:
    """Build (if not cached) and load the extend kernel of ``extend_kernel.c``."""
    lib = build_and_load(EXTEND_SOURCE, "cpu_paged_extend", EXTEND_CFLAGS)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_extend_attention.argtypes = [p, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_float, i64, i64]
    lib.paged_extend_attention.restype = ctypes.c_int
    lib.paged_extend_attention_bf16.argtypes = [p, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_float, i64]
    lib.paged_extend_attention_bf16.restype = ctypes.c_int
    lib.paged_extend_amx.argtypes = []
    lib.paged_extend_amx.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=8)
def extend_amx_supported(head_dim: int) -> bool:
    """Whether bf16 prompts of this head size run on the extend kernel's AMX tiles here: a build for
    a CPU with AMX whose OS granted the tile state, and ``head_dim`` a multiple of 32 up to 128
    (asked per layer of every prefill, hence cached)."""
    return head_dim % 32 == 0 and 0 < head_dim <= 128 and bool(load_extend_kernel().paged_extend_amx())


class PagedDecodeStep(ctypes.Structure):
    """``paged_decode_step`` of ``decode_kernel.c``: a batch's arguments of the decode kernel but
    each layer's q, k, v and output."""

    _fields_ = [("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("table_stride", ctypes.c_int64), ("rows", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("loc", ctypes.c_void_p), ("bs", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("scale", ctypes.c_float),
                ("num_threads", ctypes.c_int64), ("kv_bf16", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("bf16", ctypes.c_int64)]


def native_decode_step(caches: list[tuple[torch.Tensor, torch.Tensor]], req_to_token: torch.Tensor,
                       rows: torch.Tensor, lens: torch.Tensor, loc: torch.Tensor, num_heads: int, scale: float,
                       num_threads: int, bf16: bool) -> NativeDecodeAttention:
    """``paged_decode_layer`` and its batch context for the fused decode step: layer ``i`` reads
    and writes ``caches[i]`` (K, V ``[slots, kv_heads, head_dim]``, contiguous, one dtype), the new
    K/V go to slots ``loc``; q, k, v and the output are bf16 when ``bf16``, else fp32. The caller
    (the backend) checked the dtypes and layouts, as :func:`paged_decode_attention` does."""
    k0 = caches[0][0]
    _check((("req_to_token", req_to_token, torch.int32), ("rows", rows, torch.int64), ("lens", lens, torch.int64),
            ("loc", loc, torch.int64)))
    k_ptrs = (ctypes.c_void_p * len(caches))(*(k.data_ptr() for k, _ in caches))
    v_ptrs = (ctypes.c_void_p * len(caches))(*(v.data_ptr() for _, v in caches))
    step = PagedDecodeStep(
        ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs), req_to_token.data_ptr(), req_to_token.shape[1],
        rows.data_ptr(), lens.data_ptr(), loc.data_ptr(), rows.shape[0], num_heads, k0.shape[1], k0.shape[2],
        float(scale), num_threads, int(k0.dtype == torch.bfloat16), k0.shape[0], int(bf16))
    fn = ctypes.cast(load_kernel().paged_decode_layer, ctypes.c_void_p).value or 0
    return NativeDecodeAttention(fn, ctypes.addressof(step),
                                 (step, k_ptrs, v_ptrs, caches, req_to_token, rows, lens, loc))


def extend_supported(head_dim: int) -> bool:
    """Head sizes the extend kernel takes: multiples of 16 up to 128 (one vector of 16 floats is
    its unit, and at most 8 of them per query row stay in registers)."""
    return head_dim % 16 == 0 and 0 < head_dim <= 128


def _check(args: tuple[tuple[str, torch.Tensor, torch.dtype], ...]) -> None:
    for name, t, dtype in args:
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}")


def kernel_threading() -> str:
    """``"openmp"`` when the kernel's threads are the process's OpenMP workers (torch's, when torch
    loaded libgomp first), ``"pthreads"`` when the compiler had no OpenMP and it starts its own."""
    return "openmp" if load_kernel().paged_decode_uses_openmp() else "pthreads"



def store_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor,
                  num_threads: int) -> None:
    """Store ``k``/``v`` (``n`` rows of ``kv_heads x head_dim``, fp32 or bf16, contiguous) at slots
    ``loc`` (int64 ``[n]``) of ``k_cache``/``v_cache`` ``[slots, kv_heads, head_dim]``, converted to
    the cache's dtype: what :meth:`KVCache.store`'s index_puts write, in one threaded C call."""
    kv_dtype = k_cache.dtype if k_cache.dtype in KV_DTYPES else torch.float32
    new_dtype = k.dtype if k.dtype in KV_DTYPES else torch.float32
    _check((("k_cache", k_cache, kv_dtype), ("v_cache", v_cache, kv_dtype), ("k", k, new_dtype), ("v", v, new_dtype),
            ("loc", loc, torch.int64)))
    row_elems = k_cache.shape[1] * k_cache.shape[2]
    n = loc.numel()
    if k.numel() != n * row_elems or v.numel() != k.numel() or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv_rows: need {n} rows of {row_elems} K/V values for {n} slots")
    status = load_kernel().paged_store_kv(
        k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), loc.data_ptr(), n, row_elems,
        int(kv_dtype == torch.bfloat16), int(new_dtype == torch.bfloat16), k_cache.shape[0], num_threads)
    if status == 3:
        raise IndexError(f"store_kv_rows: a slot in loc is outside the cache's {k_cache.shape[0]} slots")

def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
                           num_threads: int,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write softmax(q k^T * scale) v of each request's first ``lens[b]`` tokens into ``out``.

    ``q``/``out`` ``[bs, heads, head_dim]``, both fp32 or both bf16 (a bf16 query is widened in the
    kernel and the output rounded back, as ``.to()`` does); ``k_cache``/``v_cache`` ``[slots, kv_heads,
    head_dim]``, both fp32 or both bf16 (read widened to fp32); ``req_to_token`` ``[rows, stride]``
    int32; ``rows``/``lens`` ``[bs]`` int64. ``new_kv``, when given, is ``(k, v, loc)``: this step's
    K and V (both fp32 or both bf16, ``bs x kv_heads x head_dim`` elements each) stored at slots
    ``loc`` (int64 ``[bs]``) before anything is read, converted to the cache's dtype, what
    :meth:`KVCache.store` would do. Every tensor must be
    contiguous on the CPU (checked: a wrong layout would read garbage).
    """
    kv_dtype = k_cache.dtype if k_cache.dtype in KV_DTYPES else torch.float32
    q_dtype = q.dtype if q.dtype in KV_DTYPES else torch.float32
    _check((("q", q, q_dtype), ("k_cache", k_cache, kv_dtype), ("v_cache", v_cache, kv_dtype),
            ("out", out, q_dtype), ("req_to_token", req_to_token, torch.int32), ("rows", rows, torch.int64),
            ("lens", lens, torch.int64)))
    bs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k_new = v_new = loc = None
    if new_kv is not None:
        k_new, v_new, loc = new_kv
        new_dtype = k_new.dtype if k_new.dtype in KV_DTYPES else torch.float32
        _check((("new k", k_new, new_dtype), ("new v", v_new, new_dtype), ("loc", loc, torch.int64)))
        if k_new.numel() != bs * kv_heads * head_dim or v_new.numel() != k_new.numel() or loc.numel() != bs:
            raise ValueError(f"new_kv: need {bs} rows of {kv_heads} x {head_dim} K/V values and {bs} slots")
    status = load_kernel().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), req_to_token.data_ptr(),
        req_to_token.shape[1], rows.data_ptr(), lens.data_ptr(), bs, num_heads, kv_heads, head_dim,
        float(scale), num_threads, int(kv_dtype == torch.bfloat16),
        None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
        None if loc is None else loc.data_ptr(), k_cache.shape[0],
        int(k_new is not None and k_new.dtype == torch.bfloat16), int(q_dtype == torch.bfloat16),
    )
    if status == 3:
        raise IndexError(f"new_kv: a slot in loc is outside the cache's {k_cache.shape[0]} slots")
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status} (out of memory or bad head counts)")


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                           q_lens: torch.Tensor, scale: float, num_threads: int) -> None:
    """Causal attention of each request's new tokens over its whole context, into ``out``.

    Request ``b``'s queries are the next ``q_lens[b]`` rows of ``q`` (requests in order); query
    ``i`` sits at position ``prefix_lens[b] + i`` and sees the keys at positions up to its own,
    read from ``k_cache``/``v_cache`` through ``req_to_token[rows[b]]`` (so the new tokens' K/V
    must be stored first). ``q``/``out`` ``[tokens, heads, head_dim]``, the caches
    ``[slots, kv_heads, head_dim]``, ``rows``/``prefix_lens``/``q_lens`` ``[bs]`` int64.

    ``q``/``out`` fp32 with an fp32 or bf16 cache: the vector kernel. ``q``/``out`` and the cache
    all bf16: the AMX kernel (scores and P V on tiles, the probabilities rounded to bf16), which
    needs :func:`extend_amx_supported`.
    """
    kv_dtype = k_cache.dtype if k_cache.dtype in KV_DTYPES else torch.float32
    amx = q.dtype == torch.bfloat16
    q_dtype = torch.bfloat16 if amx else torch.float32
    _check((("q", q, q_dtype), ("k_cache", k_cache, torch.bfloat16 if amx else kv_dtype),
            ("v_cache", v_cache, torch.bfloat16 if amx else kv_dtype), ("out", out, q_dtype),
            ("req_to_token", req_to_token, torch.int32), ("rows", rows, torch.int64),
            ("prefix_lens", prefix_lens, torch.int64), ("q_lens", q_lens, torch.int64)))
    tokens, num_heads, head_dim = q.shape
    if int(q_lens.sum()) != tokens or out.shape != q.shape:
        raise ValueError(f"q has {tokens} rows but q_lens sum to {int(q_lens.sum())} (out {tuple(out.shape)})")
    lib = load_extend_kernel()
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), req_to_token.data_ptr(),
            req_to_token.shape[1], rows.data_ptr(), prefix_lens.data_ptr(), q_lens.data_ptr(), rows.shape[0], num_heads,
            k_cache.shape[1], head_dim, float(scale), num_threads)
    if amx:
        status = lib.paged_extend_attention_bf16(*args)
        if status == 4:
            raise KernelUnavailable("the extend kernel has no AMX tiles here: bf16 queries need extend_amx_supported()")
    else:
        status = lib.paged_extend_attention(*args, int(kv_dtype == torch.bfloat16))
    if status != 0:
        raise RuntimeError(f"paged_extend_attention failed with status {status} (out of memory or bad head sizes)")
