"""Qwen2: the Llama network with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from plugins.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """Llama attention whose merged qkv projection has a bias."""

    @classmethod
    def projection_biases(cls, config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM (sliding-window layers are not supported and rejected)."""

    attention_cls = Qwen2Attention

    def __init__(self, hf_config: Any, options: Any = None) -> None:
        # Qwen2 checkpoints carry use_sliding_window=False in practice; when it is on, some layers
        # attend to a window only, which no attention backend here implements.
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        super().__init__(hf_config, options)
