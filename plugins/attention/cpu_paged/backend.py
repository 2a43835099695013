"""The ``cpu_paged`` attention backend: decode and extend (prefill) through C kernels that read the
paged KV cache in place.

On CPU a decode step at batch 64 spent about half its time in attention, mostly copying every
request's K/V out of the paged cache into a padded buffer for SDPA. The kernel in
``decode_kernel.c`` follows each request's page table instead and reads every K/V row once (measured
~8x faster than gather + SDPA per layer at batch 64).

Extend ran one SDPA call per request and layer (plus an index_select, a cat and a mask for a request
with a cached prefix). ``extend_kernel.c`` does the whole batch in one call, every (request, kv
head) a work item on torch's OpenMP workers, reading prefix and new K/V through the page table
(measured ~2x faster than the SDPA calls for 8 prompts of 128 tokens, and more on longer ones).

The kernels compute in float32 over a float32 or bfloat16 cache (``kv_cache.dtype=bfloat16``
halves the bytes each decode step reads; a bf16 model's cache is bf16); bf16 and fp16 queries are
widened on the way in and the output rounded back. Extend takes head sizes that are multiples of 16
up to 128. Anything else (an fp16 cache, other head sizes) falls back to the SDPA reference path
(:class:`framework.attention.paged_sdpa.PagedSDPA`, what ``torch_native`` runs), so the backend is
always correct and only sometimes fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.attention.base import Attention, AttentionBackend, NativeDecodeAttention
from framework.attention.paged_sdpa import PagedSDPA, PagedSDPAOptions
from framework.errors import ConfigError
from framework.memory.kv_cache import KVCache
from framework.models.onednn_rows import padded_empty
from plugins.attention.cpu_paged.kernel import (
    KV_DTYPES,
    KernelUnavailable,
    compiler,
    extend_amx_supported,
    extend_supported,
    load_extend_kernel,
    load_kernel,
    native_decode_step,
    paged_decode_attention,
    paged_extend_attention,
    store_kv_rows,
)

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


@dataclass
class CpuPagedOptions(PagedSDPAOptions):
    """Options of the ``cpu_paged`` backend (plus the SDPA fallback path's)."""

    num_threads: int = 0
    """Threads of the decode kernel; 0: torch's intra-op thread count."""
    single_thread_below: int = 1 << 14
    """Decode batches with fewer K elements than this (``sum(seq_lens) x kv_heads x head_dim``)
    run on one thread. The kernel's threads are torch's already-running OpenMP workers, so two
    threads paid off from one request of ~40 tokens (768 K values per token) up; below that the
    fork/join is about what it saves."""


#: Query dtypes the kernels take: they compute in fp32, so 16-bit queries are widened on the way in
#: and the output rounded back (a few hundred KB per layer, against the K/V gather + SDPA of the
#: fallback, which made a bf16 model's decode 2.6x slower than an fp32 one's on an AVX512-BF16 CPU).
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp32(q: torch.Tensor, rows: int, layer: Attention) -> torch.Tensor:
    """``q`` as the contiguous fp32 ``[rows, heads, head_dim]`` the kernels read (no copy for fp32)."""
    return q.reshape(rows, layer.num_heads, layer.head_dim).to(torch.float32).contiguous()


def _kernel_store(cache: Any, k: torch.Tensor, v: torch.Tensor,
                  loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(k, v, loc)`` for the decode kernel to store itself, or None when :meth:`KVCache.store`
    must: a pool that overrides ``store`` (a plugin's may track or transform writes), or K/V that
    are not contiguous fp32 or bf16, or slots that are not int64. Storing in the kernel call saves
    the two index_puts per layer that cost ~35 us at a batch-1 decode step (of ~90 us of attention)."""
    if not _kernel_may_store(cache, loc):
        return None
    if k.dtype not in KV_DTYPES or v.dtype != k.dtype or not (k.is_contiguous() and v.is_contiguous()):
        return None
    return k, v, loc


def _kernel_may_store(cache: Any, loc: torch.Tensor) -> bool:
    """The pool leaves ``store`` as :class:`KVCache`'s and the slots are contiguous int64."""
    return type(cache).store is KVCache.store and loc.dtype == torch.int64 and loc.is_contiguous()


@dataclass
class _DecodeMeta:
    rows: torch.Tensor
    """``[bs]`` int64 request rows, contiguous (the kernel reads the raw memory)."""
    lens: torch.Tensor
    """``[bs]`` int64 context lengths."""
    total_tokens: int
    fallback: Any
    """The SDPA path's decode metadata, built lazily only if a layer needs the fallback."""


@dataclass
class _ExtendMeta:
    rows: torch.Tensor
    """``[bs]`` int64 request rows, contiguous."""
    prefix_lens: torch.Tensor
    """``[bs]`` int64 tokens already in the cache before this batch (cached prefix, earlier chunks)."""
    q_lens: torch.Tensor
    """``[bs]`` int64 new tokens of each request in this batch."""
    fallback: Any
    """The SDPA path's extend metadata, built lazily only if a layer needs the fallback."""
    decode_tail: _DecodeMeta | None = None
    """The batch's trailing one-token requests (a mixed step's decode rows), which the decode
    kernel takes; the fields above then describe only the requests before them."""


def _one_token_tail(q_lens: Sequence[int]) -> int:
    """How many requests at the end of an extend batch add one token each.

    A mixed step puts the running requests' decode rows last. The extend kernel works in blocks of
    query rows (4 at head_dim 64), so a one-token request computes a whole block and transposes its
    keys first; the decode kernel reads them once as they lie. Measured on the Zen 4 host with
    llama-120m at 64 decode rows beside 192 prompt tokens: attention 50 ms of a 283 ms mixed step,
    against 25 ms for the same rows in a decode step.
    """
    tail = 0
    for n in reversed(q_lens):
        if n != 1:
            break
        tail += 1
    return tail


class CpuPagedAttnBackend(AttentionBackend):
    """C decode and extend kernels over the paged KV cache (CPU; fp32 math), with the SDPA
    reference path for what the kernels do not take."""

    @staticmethod
    def unavailable_reason() -> str | None:
        """Needs a C compiler to build its kernel (once; the build is cached)."""
        return None if compiler() is not None else "no C compiler found to build its decode kernel"

    def __init__(self, runner: Any, options: CpuPagedOptions | None = None) -> None:
        self.device = torch.device(runner.device)
        self.options = options or CpuPagedOptions()
        self.sdpa = PagedSDPA(self.device, self.options)
        if self.device.type != "cpu":
            raise ConfigError(f"attention.backend: cpu_paged runs on CPU only (device is {self.device}); "
                              "use flashinfer, triton or torch_native")
        try:
            load_kernel()  # build now: fail at start, not at the first request
            load_extend_kernel()
        except KernelUnavailable as exc:
            raise ConfigError(f"attention.backend: cpu_paged cannot build its kernel: {exc}") from None
        self.num_threads = self.options.num_threads or torch.get_num_threads()
        self.single_thread_below = self.options.single_thread_below

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """The request rows and lengths as contiguous int64 tensors (what the kernels read)."""
        if not forward_batch.mode.is_decode():
            prefix, q_lens = forward_batch.extend_lengths()
            rows = forward_batch.req_pool_indices.to(torch.int64)
            head = len(q_lens) - _one_token_tail(q_lens)
            tail = None
            if head < len(q_lens):
                lens = [p + 1 for p in prefix[head:]]
                tail = _DecodeMeta(rows[head:].contiguous(), torch.tensor(lens, dtype=torch.int64), sum(lens), None)
            forward_batch.attn_metadata = _ExtendMeta(rows[:head].contiguous(),
                                                      torch.tensor(prefix[:head], dtype=torch.int64),
                                                      torch.tensor(q_lens[:head], dtype=torch.int64), None, tail)
            return
        rows = forward_batch.req_pool_indices.to(torch.int64).contiguous()
        lens = forward_batch.seq_lens.to(torch.int64).contiguous()
        forward_batch.attn_metadata = _DecodeMeta(rows, lens, int(sum(forward_batch.seq_lens_cpu)), None)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta: _ExtendMeta = forward_batch.attn_metadata
        kv_dtype = getattr(forward_batch.kv_cache, "dtype", None)
        if (not save_kv_cache or q.dtype not in QUERY_DTYPES or kv_dtype not in KV_DTYPES
                or forward_batch.req_to_token.dtype != torch.int32 or not extend_supported(layer.head_dim)):
            # The per-request SDPA path (it also covers K/V that are not stored: the kernel reads
            # every key through the cache).
            if meta.fallback is None:
                meta.fallback = self.sdpa.extend_metadata(forward_batch)
            k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
            return self.sdpa.extend(q, k, v, k_cache, v_cache, layer, meta.fallback)
        cache = forward_batch.kv_cache
        new_kv = _kernel_store(cache, k, v, forward_batch.out_cache_loc)
        if new_kv is None:  # a pool with its own store, or K/V the C store cannot take as they are
            k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        else:
            k_cache, v_cache = cache.get_kv(layer.layer_id)
            store_kv_rows(k_cache, v_cache, *new_kv, self.num_threads)
        num_tokens = q.shape[0]
        # bf16 queries over a bf16 cache stay bf16 on the AMX kernel (both kernels take bf16 rows);
        # everything else is widened to fp32 for the vector kernel and rounded back.
        amx = q.dtype == kv_dtype == torch.bfloat16 and extend_amx_supported(layer.head_dim)
        io_dtype = torch.bfloat16 if amx else torch.float32
        rows = q.reshape(num_tokens, layer.num_heads, layer.head_dim).to(io_dtype).contiguous()
        # Allocated as the leading rows of o_proj's row bucket, so its packed GEMM takes them as they are.
        out = padded_empty(num_tokens, layer.num_heads * layer.head_dim, io_dtype).view(
            num_tokens, layer.num_heads, layer.head_dim)
        tail = meta.decode_tail
        split = num_tokens - (0 if tail is None else tail.rows.shape[0])
        table = forward_batch.req_to_token
        if split:
            paged_extend_attention(rows[:split], k_cache, v_cache, out[:split], table, meta.rows, meta.prefix_lens,
                                   meta.q_lens, layer.scaling, self.num_threads)
        if tail is not None:  # the one-token requests' K/V are stored above, as a decode step's would be
            paged_decode_attention(rows[split:], k_cache, v_cache, out[split:], table, tail.rows, tail.lens,
                                   layer.scaling, self._decode_threads(tail, layer))
        return out.view(num_tokens, layer.num_heads * layer.head_dim).to(q.dtype)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta: _DecodeMeta = forward_batch.attn_metadata
        table = forward_batch.req_to_token
        cache = forward_batch.kv_cache
        k_cache, v_cache = cache.get_kv(layer.layer_id)
        if q.dtype not in QUERY_DTYPES or k_cache.dtype not in KV_DTYPES or table.dtype != torch.int32:
            # The gather + SDPA path; its metadata is built once per batch, on first need.
            k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
            if meta.fallback is None:
                meta.fallback = self.sdpa.decode_metadata(forward_batch)
            return self.sdpa.decode(q, k_cache, v_cache, layer, meta.fallback)
        new_kv = None
        if save_kv_cache:
            new_kv = _kernel_store(cache, k, v, forward_batch.out_cache_loc)
            if new_kv is None:  # a pool with its own store, or K/V the kernel cannot take as they are
                k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        bs = q.shape[0]
        # A bf16 query goes in as it is (the kernel widens it and rounds the output back); fp16 is
        # widened here.
        q_in = (q.reshape(bs, layer.num_heads, layer.head_dim).contiguous() if q.dtype == torch.bfloat16
                else _fp32(q, bs, layer))
        out = torch.empty(bs, layer.num_heads, layer.head_dim, dtype=q_in.dtype)
        threads = self._decode_threads(meta, layer)
        paged_decode_attention(q_in, k_cache, v_cache, out, table, meta.rows, meta.lens, layer.scaling, threads, new_kv)
        return out.view(bs, layer.num_heads * layer.head_dim).to(q.dtype)

    def native_decode(self, forward_batch: ForwardBatch, layers: Sequence[Attention],
                      dtype: torch.dtype) -> NativeDecodeAttention | None:
        """The decode kernel as ``paged_decode_layer`` (``decode_kernel.c``), when every layer
        would take the kernel path of :meth:`forward_decode` with the kernel storing K/V itself:
        fp32 or bf16 rows, a fp32 or bf16 cache in a pool without its own ``store``, int32 page
        table and int64 slots, layers of one shape and scale."""
        meta = forward_batch.attn_metadata
        cache, table, loc = forward_batch.kv_cache, forward_batch.req_to_token, forward_batch.out_cache_loc
        if not isinstance(meta, _DecodeMeta) or dtype not in (torch.float32, torch.bfloat16) or not layers:
            return None
        if not _kernel_may_store(cache, loc) or table.dtype != torch.int32 or not table.is_contiguous():
            return None
        first = layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
        if any((a.num_heads, a.num_kv_heads, a.head_dim, a.scaling) != shape for a in layers):
            return None
        caches = [cache.get_kv(a.layer_id) for a in layers]
        kv_dtype = caches[0][0].dtype
        if kv_dtype not in KV_DTYPES or any(k.dtype != kv_dtype or v.dtype != kv_dtype or not (k.is_contiguous()
                                            and v.is_contiguous()) for k, v in caches):
            return None
        return native_decode_step(caches, table, meta.rows, meta.lens, loc, first.num_heads, first.scaling,
                                  self._decode_threads(meta, first), bf16=dtype == torch.bfloat16)

    def _decode_threads(self, meta: _DecodeMeta, layer: Attention) -> int:
        """One thread for a batch with little K/V to read (see ``single_thread_below``), else all."""
        work = meta.total_tokens * layer.num_kv_heads * layer.head_dim
        return 1 if work < self.single_thread_below else self.num_threads
