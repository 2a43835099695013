"""Qwen3: the Llama network plus a per-head RMSNorm on q and k before RoPE.

Its ``head_dim`` comes from the config and may differ from ``hidden_size // num_attention_heads``
(Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128); the shared Llama modules already honour it.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.models.layers import RMSNorm
from plugins.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama attention with ``q_norm`` / ``k_norm`` over each head's ``head_dim`` values."""

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        return q.view(n, self.q_size), k.view(n, self.kv_size)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM (``attention_bias`` is honoured as in Llama; Qwen3 ships it off)."""

    attention_cls = Qwen3Attention

    def __init__(self, hf_config: Any, options: Any = None) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=True is not supported")
        super().__init__(hf_config, options)
