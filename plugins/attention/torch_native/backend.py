"""The ``torch_native`` attention backend: paged-KV attention with plain PyTorch SDPA.

It runs anywhere PyTorch runs and is the reference the other backends are tested against, so it
favours obviously-correct index arithmetic. Decode is batched (one gather of every request's K/V
into a padded buffer plus one SDPA call per group of requests) because decode is what a CPU server
spends its time on; extend loops over requests, since each request's prefill is compute-bound anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from framework.attention.base import Attention, AttentionBackend
from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch

# ``enable_gqa`` arrived in torch 2.5; the project allows torch 2.4, which needs repeated kv heads.
_SDPA_HAS_GQA = torch.__version__ >= "2.5"


@dataclass
class TorchNativeOptions:
    """Options of the ``torch_native`` backend."""

    decode_max_gather_tokens: int = 65536
    """Cap on ``requests x longest context`` gathered into one padded decode buffer. A decode batch
    over the cap is split into groups of requests under it, which bounds the reused gather buffers
    at ``2 x cap x kv_heads x head_dim`` elements (512 MiB for 8 kv heads of 128 in fp32). One
    group (64 requests of 1k tokens fit) is the fast case."""
    cuda_graph_gather_tokens: int = 1 << 20
    """CUDA graphs only: a captured decode gathers a fixed ``bucket x max_len`` padded buffer (no
    data-dependent shapes in a graph), with ``max_len = this / largest bucket`` (at most the
    longest context). Batches with a longer request run eagerly. The static gather buffers take
    ``2 x this x kv_heads x head_dim`` elements (4 GiB for 8 kv heads of 128 in bf16)."""


@dataclass
class _ExtendRequest:
    q_start: int
    q_len: int
    prefix_slots: torch.Tensor | None
    """KV slots of the cached prefix; ``None`` when there is none (then SDPA runs ``is_causal``)."""
    mask: torch.Tensor | None
    """``[q_len, prefix_len + q_len]`` bool, True = attend; ``None`` when there is no prefix."""


@dataclass
class _DecodeGroup:
    start: int
    """First request (= first row of q) of the group."""
    size: int
    max_len: int
    slots: torch.Tensor
    """``[size * max_len]`` KV slots, padded positions pointing at slot 0 (the padding page)."""
    mask: torch.Tensor
    """``[size, 1, 1, max_len]`` bool, True where a position is inside the request's context."""
    graph: bool = False
    """Built for a CUDA graph: gathers into the static graph buffers (never reallocated)."""


def extend_lengths(fb: ForwardBatch) -> tuple[list[int], list[int]]:
    """``(prefix_lens, q_lens)`` of an EXTEND batch: tokens each request already has in the cache
    (cached prefix, earlier chunks) and new tokens in this batch, from whichever of
    ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu`` the batch carries (and ``seq_lens_cpu``)."""
    seq_lens = [int(n) for n in fb.seq_lens_cpu]
    if fb.extend_seq_lens_cpu is not None:
        q_lens = [int(n) for n in fb.extend_seq_lens_cpu]
        if fb.extend_prefix_lens_cpu is not None:
            return [int(p) for p in fb.extend_prefix_lens_cpu], q_lens
        return [s - n for s, n in zip(seq_lens, q_lens, strict=True)], q_lens
    if fb.extend_prefix_lens_cpu is not None:
        prefix_lens = [int(p) for p in fb.extend_prefix_lens_cpu]
        return prefix_lens, [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
    raise ValueError("an EXTEND batch needs extend_seq_lens_cpu or extend_prefix_lens_cpu")


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """SDPA over ``[..., heads, len, dim]`` where k/v may have fewer (grouped) heads than q."""
    if q.dim() == 3:
        # torch's CPU flash kernel only takes 4-D inputs; 3-D ones fall back to the unfused math
        # path (measured 2.3x slower for a 128-token prefill, and it materialises the scores).
        return _sdpa(q[None], k[None], v[None], None if mask is None else mask[None], is_causal, scale)[0]
    group = q.shape[-3] // k.shape[-3]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


class TorchNativeAttnBackend(AttentionBackend):
    """Attention over the paged KV cache with ``torch.nn.functional.scaled_dot_product_attention``.

    Reads, per batch: ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu`` and ``req_to_token``;
    for extend also ``extend_seq_lens_cpu`` or ``extend_prefix_lens_cpu`` (one is derived from the
    other and ``seq_lens_cpu``). Writes new K/V to ``kv_cache`` at ``out_cache_loc``.

    CUDA graphs: decode is captured as one group of fixed width ``graph_max_len`` (see
    ``cuda_graph_gather_tokens``) whose slot table and mask are refreshed in place before a replay;
    the eager path's grouping by actual lengths is data-dependent and cannot be captured.
    """


    def __init__(self, runner: Any, options: TorchNativeOptions | None = None) -> None:
        # Of the runner only the device is needed: the cache and the request table come with each
        # ForwardBatch, so one backend object serves any cache the runner hands it.
        self.device = torch.device(runner.device)
        self.options = options or TorchNativeOptions()
        # Reused gather buffers: fresh multi-MB allocations each layer cost page faults that showed
        # up as ~2x slower decode on CPU.
        self._gather_k: torch.Tensor | None = None
        self._gather_v: torch.Tensor | None = None
        # CUDA-graph state (init_cuda_graph_state): fixed-shape slot table, mask and gather buffers.
        self._graph_max_len = 0
        self._graph_slots: torch.Tensor | None = None
        self._graph_valid: torch.Tensor | None = None
        self._graph_positions: torch.Tensor | None = None
        self._graph_gather_k: torch.Tensor | None = None
        self._graph_gather_v: torch.Tensor | None = None

    # --- per-batch metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Compute index tables once per batch; every layer reuses them."""
        if forward_batch.mode.is_decode():
            forward_batch.attn_metadata = self._decode_metadata(forward_batch)
        else:
            forward_batch.attn_metadata = self._extend_metadata(forward_batch)

    def _extend_metadata(self, fb: ForwardBatch) -> list[_ExtendRequest]:
        prefix_lens, q_lens = extend_lengths(fb)
        max_prefix = max(prefix_lens, default=0)
        rows = fb.req_to_token[fb.req_pool_indices, :max_prefix].long() if max_prefix else None
        requests, q_start = [], 0
        for i, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
            if p == 0 or rows is None:
                requests.append(_ExtendRequest(q_start, n, None, None))
            else:
                # Query j sits at absolute position p + j and may see keys 0 .. p + j.
                key_pos = torch.arange(p + n, device=self.device)
                query_pos = torch.arange(p, p + n, device=self.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                requests.append(_ExtendRequest(q_start, n, rows[i, :p], mask))
            q_start += n
        return requests

    def _decode_metadata(self, fb: ForwardBatch) -> list[_DecodeGroup]:
        seq_lens = list(fb.seq_lens_cpu)
        cap = self.options.decode_max_gather_tokens
        groups: list[_DecodeGroup] = []
        start = 0
        while start < len(seq_lens):
            # Grow the group while the padded buffer (requests x longest context) stays under the cap.
            end, max_len = start + 1, seq_lens[start]
            while end < len(seq_lens) and (end + 1 - start) * max(max_len, seq_lens[end]) <= cap:
                max_len = max(max_len, seq_lens[end])
                end += 1
            groups.append(self._decode_group(fb, start, end, max_len))
            start = end
        return groups

    def _decode_group(self, fb: ForwardBatch, start: int, end: int, max_len: int) -> _DecodeGroup:
        pool_rows = fb.req_pool_indices[start:end]
        lens = fb.seq_lens[start:end].to(self.device)
        positions = torch.arange(max_len, device=self.device)
        valid = positions[None, :] < lens[:, None]
        slots = fb.req_to_token[pool_rows, :max_len].long()
        # Entries past a request's length are whatever the pool row held before; point them at the
        # padding slot so the gather never reads out of range.
        slots = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
        return _DecodeGroup(start, end - start, max_len, slots, valid[:, None, None, :])

    # --- CUDA graphs ---------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        self._graph_max_len = min(max_context_len, self.options.cuda_graph_gather_tokens // max_batch_size)
        if self._graph_max_len < 1:
            raise ConfigError(
                f"attention.options.cuda_graph_gather_tokens: {self.options.cuda_graph_gather_tokens} is "
                f"smaller than the largest CUDA-graph bucket ({max_batch_size}); raise it or lower "
                "cuda_graph.max_batch_size"
            )
        n = max_batch_size * self._graph_max_len
        self._graph_slots = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._graph_valid = torch.zeros(max_batch_size, self._graph_max_len, dtype=torch.bool, device=self.device)
        self._graph_positions = torch.arange(self._graph_max_len, device=self.device)

    def can_replay_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        return max(forward_batch.seq_lens_cpu) <= self._graph_max_len

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs, width = forward_batch.batch_size, self._graph_max_len
        assert self._graph_slots is not None and self._graph_valid is not None, "init_cuda_graph_state first"
        self._refresh_graph_tables(forward_batch)
        forward_batch.attn_metadata = [
            _DecodeGroup(0, bs, width, self._graph_slots[: bs * width], self._graph_valid[:bs, None, None, :], True)
        ]

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, real_batch_size: int) -> None:
        self._refresh_graph_tables(forward_batch)

    def _refresh_graph_tables(self, fb: ForwardBatch) -> None:
        """Write the batch's slot table and mask into the static buffers (eager, before a replay)."""
        assert self._graph_slots is not None and self._graph_valid is not None and self._graph_positions is not None
        bs, width = fb.batch_size, self._graph_max_len
        valid = self._graph_positions[None, :] < fb.seq_lens[:, None]
        slots = fb.req_to_token[fb.req_pool_indices, :width].long()
        # Positions past a request's length hold stale table entries: point them at padding slot 0.
        self._graph_slots[: bs * width].copy_(torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1))
        self._graph_valid[:bs].copy_(valid)

    def _graph_gather_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Static gather buffers for captured decode, allocated once at full size (during the
        warm-up, which runs before any capture) so their address never changes."""
        if self._graph_gather_k is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("torch_native: graph gather buffers must be allocated in the warm-up run")
            assert self._graph_slots is not None
            shape = (self._graph_slots.shape[0], *like.shape[1:])
            self._graph_gather_k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._graph_gather_v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self._graph_gather_v is not None
        return self._graph_gather_k[:n], self._graph_gather_v[:n]

    # --- attention ----------------------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        if k_cache.dtype != q.dtype:
            # Round the new tokens' K/V through the cache dtype, as decode (which reads the cache)
            # will see them; keeps chunked and unchunked prefill consistent.
            k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
        out = q.new_empty(num_tokens, layer.num_heads, layer.head_dim)
        for req in forward_batch.attn_metadata:
            if req.q_len == 0:
                continue
            sl = slice(req.q_start, req.q_start + req.q_len)
            qi = q[sl].transpose(0, 1)
            ki, vi = k[sl], v[sl]
            if req.prefix_slots is not None:
                ki = torch.cat((k_cache.index_select(0, req.prefix_slots).to(q.dtype), ki))
                vi = torch.cat((v_cache.index_select(0, req.prefix_slots).to(q.dtype), vi))
            o = _sdpa(
                qi,
                ki.transpose(0, 1),
                vi.transpose(0, 1),
                mask=req.mask,
                is_causal=req.mask is None,
                scale=layer.scaling,
            )
            out[sl] = o.transpose(0, 1)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def _gather_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gather_k is None or self._gather_k.shape[0] < n or self._gather_k.dtype != like.dtype:
            shape = (n, *like.shape[1:])
            self._gather_k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._gather_v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self._gather_v is not None
        return self._gather_k[:n], self._gather_v[:n]

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        return self._decode_gathered(q, k_cache, v_cache, layer, forward_batch.attn_metadata)

    def _decode_gathered(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention,
                         groups: list[_DecodeGroup]) -> torch.Tensor:
        """Decode attention by groups: gather each group's K/V into a padded buffer, then one SDPA."""
        bs = q.shape[0]
        kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        # One query per request: view its heads as [kv_heads, group] so that each kv head meets its
        # `group` query heads as `group` query rows; GQA without repeating K/V, on any torch.
        q = q.view(bs, kv_heads, group, head_dim)
        out = q.new_empty(bs, kv_heads, group, head_dim)
        for g in groups:
            n = g.size * g.max_len
            kb, vb = self._graph_gather_buffers(n, k_cache) if g.graph else self._gather_buffers(n, k_cache)
            torch.index_select(k_cache, 0, g.slots, out=kb)
            torch.index_select(v_cache, 0, g.slots, out=vb)
            kg = kb.view(g.size, g.max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            vg = vb.view(g.size, g.max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            rows = slice(g.start, g.start + g.size)
            out[rows] = F.scaled_dot_product_attention(q[rows], kg, vg, attn_mask=g.mask, scale=layer.scaling)
        return out.view(bs, layer.num_heads * head_dim)
