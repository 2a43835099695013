"""``ExampleLlama``: a third-party model plugin for Llama checkpoints, written with plugserve's
tensor-parallel layers (``framework.models.parallel``), so it runs on any ``parallel.tp_size``
without code of its own for it: a QKV layer (query heads split, KV heads split or replicated),
separate gate and up column-parallel layers, row-parallel output projections, a vocab-parallel
embedding and head. It loads each rank's shards with ``load_parallel_weight``. Select it with
``model.architecture=ExampleLlamaForCausalLM`` on a Llama checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from framework.attention.base import Attention
from framework.models.layers import RMSNorm, apply_rotary_qkv, get_rope
from framework.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_parallel_weight,
)

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


class _Block(nn.Module):
    def __init__(self, cfg: Any, layer_id: int) -> None:
        super().__init__()
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // heads
        # q, k and v in one layer (the HF tensors load into its shards 0, 1, 2): the layer splits the
        # query heads and splits, or replicates, the KV heads for this rank.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, heads, kv, bias=False)
        self.sizes = list(self.qkv_proj.local_sizes)
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size)
        # gate and up kept apart (no merge): two column-parallel layers.
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size])
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size])
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        local_heads, local_kv = self.qkv_proj.local_heads, self.qkv_proj.local_kv_heads
        self.attn = Attention(local_heads, self.head_dim, self.head_dim**-0.5, local_kv, layer_id=layer_id)

    def forward(self, x: torch.Tensor, cos_sin: tuple, batch: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(self.sizes, dim=-1)
        q, k, v = apply_rotary_qkv(q, k, v, *cos_sin, self.head_dim)
        x = x + self.o_proj(self.attn(q, k, v, batch))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class ExampleLlamaForCausalLM(nn.Module):
    """The plugin interface: ``forward``, ``compute_logits``, ``load_weights``."""

    def __init__(self, hf_config: Any, options: Any = None) -> None:
        super().__init__()
        self.config = hf_config
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(_Block(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.rotary_emb = get_rope(hf_config, hf_config.hidden_size // hf_config.num_attention_heads)
        self.lm_head = ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.get_cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, batch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names map one to one (minus the ``model.`` prefix); each rank takes its shard."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            ours = name.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")
            shard = None
            for hf_part, index in _QKV.items():
                if f".{hf_part}." in ours:
                    ours, shard = ours.replace(hf_part, "qkv_proj"), index
            if ours not in params:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter")
            module, _, param = ours.rpartition(".")
            load_parallel_weight(self.get_submodule(module), param, tensor, shard)
            loaded.add(ours)
        return loaded
