"""A naive attention backend: per request, gather its K/V, mask, softmax, matmul."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.attention.base import AttentionBackend


@dataclass
class NaiveOptions:
    """Options of the naive backend."""

    softmax_in_fp32: bool = True
    """Compute scores and softmax in fp32 whatever the KV dtype."""


class NaiveAttnBackend(AttentionBackend):
    """Readable, slow attention over the paged KV cache."""

    def __init__(self, options: NaiveOptions) -> None:
        self.options = options

    @classmethod
    def create(cls, runner, options: NaiveOptions | None = None) -> NaiveAttnBackend:
        return cls(options or NaiveOptions())

    def init_forward_metadata(self, forward_batch) -> None:
        pass

    def _attend(self, q, layer, forward_batch, starts, new_lens, prefix_lens) -> torch.Tensor:
        k_buf, v_buf = forward_batch.kv_cache.get_kv(layer.layer_id)
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        group = layer.num_heads // layer.num_kv_heads
        compute = torch.float32 if self.options.softmax_in_fp32 else q.dtype
        for i in range(forward_batch.batch_size):
            row = int(forward_batch.req_pool_indices[i])
            total = prefix_lens[i] + new_lens[i]
            slots = forward_batch.req_to_token[row, :total].long()
            k = k_buf[slots].to(compute).repeat_interleave(group, dim=1)  # [L, H, D]
            v = v_buf[slots].to(compute).repeat_interleave(group, dim=1)
            qi = q[starts[i] : starts[i] + new_lens[i]].view(-1, layer.num_heads, layer.head_dim)
            scores = torch.einsum("qhd,khd->hqk", qi.to(compute), k) * layer.scaling
            q_pos = torch.arange(prefix_lens[i], total, device=q.device)[:, None]
            k_pos = torch.arange(total, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            res = torch.einsum("hqk,khd->qhd", probs, v)
            out[starts[i] : starts[i] + new_lens[i]] = res.reshape(new_lens[i], -1).to(q.dtype)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            forward_batch.kv_cache.store(layer.layer_id, forward_batch.out_cache_loc, k, v)
        new_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
        return self._attend(q, layer, forward_batch, starts, new_lens, prefix_lens)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            forward_batch.kv_cache.store(layer.layer_id, forward_batch.out_cache_loc, k, v)
        bs = forward_batch.batch_size
        seq_lens = forward_batch.seq_lens_cpu
        return self._attend(
            q, layer, forward_batch, list(range(bs)), [1] * bs, [s - 1 for s in seq_lens]
        )
