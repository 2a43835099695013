"""Attention over the paged KV cache with plain PyTorch SDPA: the reference path backends share.

``torch_native`` is this and nothing else (plus CUDA-graph buffers); ``cpu_paged`` falls back to
it for what its kernels do not take. It favours obviously-correct index arithmetic. Decode is
batched (one gather of every request's K/V into a padded buffer plus one SDPA call per group of
requests) because decode is what a CPU server spends its time on; extend loops over requests,
since each request's prefill is compute-bound anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from framework.attention.base import Attention
    from framework.executor.forward_batch import ForwardBatch

# ``enable_gqa`` arrived in torch 2.5; the project allows torch 2.4, which needs repeated kv heads.
_SDPA_HAS_GQA = torch.__version__ >= "2.5"


@dataclass
class PagedSDPAOptions:
    """Options of the SDPA path (a backend's options dataclass extends this one)."""

    decode_max_gather_tokens: int = 65536
    """Cap on ``requests x longest context`` gathered into one padded decode buffer. A decode batch
    over the cap is split into groups of requests under it, which bounds the reused gather buffers
    at ``2 x cap x kv_heads x head_dim`` elements (512 MiB for 8 kv heads of 128 in fp32). One
    group (64 requests of 1k tokens fit) is the fast case."""


@dataclass
class ExtendRequest:
    """One request of an extend batch, as the SDPA path sees it."""

    q_start: int
    q_len: int
    prefix_slots: torch.Tensor | None
    """KV slots of the cached prefix; ``None`` when there is none (then SDPA runs ``is_causal``)."""
    mask: torch.Tensor | None
    """``[q_len, prefix_len + q_len]`` bool, True = attend; ``None`` when there is no prefix."""


@dataclass
class DecodeGroup:
    """Requests of a decode batch gathered into one padded buffer."""

    start: int
    """First request (= first row of q) of the group."""
    size: int
    max_len: int
    slots: torch.Tensor
    """``[size * max_len]`` KV slots, padded positions pointing at slot 0 (the padding page)."""
    mask: torch.Tensor
    """``[size, 1, 1, max_len]`` bool, True where a position is inside the request's context."""
    graph: bool = False
    """Built for a CUDA graph: gathers into static buffers (never reallocated)."""


GatherBuffers = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(elements, like) -> (k_buffer, v_buffer)``: where a decode group gathers its K/V."""


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
         scale: float) -> torch.Tensor:
    """SDPA over ``[..., heads, len, dim]`` where k/v may have fewer (grouped) heads than q."""
    if q.dim() == 3:
        # torch's CPU flash kernel only takes 4-D inputs; 3-D ones fall back to the unfused math
        # path (measured 2.3x slower for a 128-token prefill, and it materialises the scores).
        return sdpa(q[None], k[None], v[None], None if mask is None else mask[None], is_causal, scale)[0]
    group = q.shape[-3] // k.shape[-3]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


class PagedSDPA:
    """Extend and decode attention over the paged cache through SDPA; owns its gather buffers."""

    def __init__(self, device: torch.device, options: PagedSDPAOptions) -> None:
        self.device = device
        self.options = options
        # Reused gather buffers: fresh multi-MB allocations each layer cost page faults that showed
        # up as ~2x slower decode on CPU.
        self._gather_k: torch.Tensor | None = None
        self._gather_v: torch.Tensor | None = None

    # --- per-batch metadata ---------------------------------------------------------------------

    def extend_metadata(self, fb: ForwardBatch) -> list[ExtendRequest]:
        """Each request's new-token range, cached-prefix slots and mask (once per batch)."""
        prefix_lens, q_lens = fb.extend_lengths()
        max_prefix = max(prefix_lens, default=0)
        rows = fb.req_to_token[fb.req_pool_indices, :max_prefix].long() if max_prefix else None
        requests, q_start = [], 0
        for i, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
            if p == 0 or rows is None:
                requests.append(ExtendRequest(q_start, n, None, None))
            else:
                # Query j sits at absolute position p + j and may see keys 0 .. p + j.
                key_pos = torch.arange(p + n, device=self.device)
                query_pos = torch.arange(p, p + n, device=self.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                requests.append(ExtendRequest(q_start, n, rows[i, :p], mask))
            q_start += n
        return requests

    def decode_metadata(self, fb: ForwardBatch) -> list[DecodeGroup]:
        """The batch split into groups whose padded gather stays under the cap (once per batch)."""
        seq_lens = list(fb.seq_lens_cpu)
        cap = self.options.decode_max_gather_tokens
        groups: list[DecodeGroup] = []
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

    def _decode_group(self, fb: ForwardBatch, start: int, end: int, max_len: int) -> DecodeGroup:
        pool_rows = fb.req_pool_indices[start:end]
        lens = fb.seq_lens[start:end].to(self.device)
        positions = torch.arange(max_len, device=self.device)
        valid = positions[None, :] < lens[:, None]
        slots = fb.req_to_token[pool_rows, :max_len].long()
        # Entries past a request's length are whatever the pool row held before; point them at the
        # padding slot so the gather never reads out of range.
        slots = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
        return DecodeGroup(start, end - start, max_len, slots, valid[:, None, None, :])

    # --- attention ----------------------------------------------------------------------------

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, layer: Attention, requests: list[ExtendRequest]) -> torch.Tensor:
        """Prefill attention: each request's new tokens over its cached prefix and themselves."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        if k_cache.dtype != q.dtype:
            # Round the new tokens' K/V through the cache dtype, as decode (which reads the cache)
            # will see them; keeps chunked and unchunked prefill consistent.
            k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
        out = q.new_empty(num_tokens, layer.num_heads, layer.head_dim)
        for req in requests:
            if req.q_len == 0:
                continue
            sl = slice(req.q_start, req.q_start + req.q_len)
            qi = q[sl].transpose(0, 1)
            ki, vi = k[sl], v[sl]
            if req.prefix_slots is not None:
                ki = torch.cat((k_cache.index_select(0, req.prefix_slots).to(q.dtype), ki))
                vi = torch.cat((v_cache.index_select(0, req.prefix_slots).to(q.dtype), vi))
            o = sdpa(qi, ki.transpose(0, 1), vi.transpose(0, 1), mask=req.mask, is_causal=req.mask is None,
                     scale=layer.scaling)
            out[sl] = o.transpose(0, 1)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention,
               groups: list[DecodeGroup], graph_buffers: GatherBuffers | None = None) -> torch.Tensor:
        """Decode attention by groups: gather each group's K/V into a padded buffer, then one SDPA
        (``graph_buffers`` serves the groups built for a CUDA graph)."""
        bs = q.shape[0]
        kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        # One query per request: view its heads as [kv_heads, group] so that each kv head meets its
        # `group` query heads as `group` query rows; GQA without repeating K/V, on any torch.
        q = q.view(bs, kv_heads, group, head_dim)
        out = q.new_empty(bs, kv_heads, group, head_dim)
        for g in groups:
            n = g.size * g.max_len
            buffers = graph_buffers if g.graph and graph_buffers is not None else self._gather_buffers
            kb, vb = buffers(n, k_cache)
            torch.index_select(k_cache, 0, g.slots, out=kb)
            torch.index_select(v_cache, 0, g.slots, out=vb)
            kg = kb.view(g.size, g.max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            vg = vb.view(g.size, g.max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            rows = slice(g.start, g.start + g.size)
            out[rows] = F.scaled_dot_product_attention(q[rows], kg, vg, attn_mask=g.mask, scale=layer.scaling)
        return out.view(bs, layer.num_heads * head_dim)

    def _gather_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gather_k is None or self._gather_k.shape[0] < n or self._gather_k.dtype != like.dtype:
            shape = (n, *like.shape[1:])
            self._gather_k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._gather_v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self._gather_v is not None
        return self._gather_k[:n], self._gather_v[:n]
