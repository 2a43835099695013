"""Llama-family decoder (Llama 2/3, Mistral), the base that the Qwen models parametrise.

Projections are merged for speed on CPU (one GEMM instead of three, one instead of two):
``qkv_proj`` holds ``[q; k; v]`` and ``gate_up_proj`` holds ``[gate; up]``; :meth:`load_weights`
fills them from the Hugging Face names. Attention goes only through
:class:`framework.attention.base.Attention`, i.e. through the configured backend.

Tensor parallelism comes from the layers (``framework.models.parallel``): heads, MLP columns and
vocabulary are split over ``parallel.tp_size`` ranks, and each rank loads only its shards.

Not implemented: sliding-window attention (Mistral v0.1 declares a 4096-token window; contexts
longer than the window are computed with full attention) and rope types other than default, linear
and llama3 (building such a model fails with a clear error).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.attention.base import Attention
from framework.models.cpu_linear import float_linear, linear_add
from framework.models.fused_decode import FusableDecoderLayer, FusableDecoderStack
from framework.models.layers import (
    FusableSwiGLU,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    apply_rotary_qkv,
    get_rope,
)
from framework.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_parallel_weight,
)

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


def config_head_dim(config: Any) -> int:
    """``config.head_dim`` when set (Qwen3, Mistral-Nemo), else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention with grouped-query heads, a merged qkv projection and rotary embeddings.

    Subclasses change :meth:`projection_biases` (Qwen2) or override :meth:`qk_transform` (Qwen3's
    per-head norms) instead of copying the module.
    """

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")
        self.head_dim = config_head_dim(config)
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                          qkv_bias)
        # From here on, head counts and sizes are this tensor-parallel rank's.
        self.num_heads, self.num_kv_heads = self.qkv_proj.local_heads, self.qkv_proj.local_kv_heads
        self.qkv_sizes = list(self.qkv_proj.local_sizes)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id=layer_id)

    @classmethod
    def projection_biases(cls, config: Any) -> tuple[bool, bool]:
        """``(qkv_bias, o_proj_bias)``: Llama's ``attention_bias`` covers both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to q and k before RoPE; identity for Llama."""
        return q, k

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output projected back to the hidden size, plus ``residual`` when given
        (the add rides on the output GEMM where the linear layer can fuse it). With ``keep_rows``
        only those rows come out: every row's K and V still reach the cache, but the projection
        runs on the kept rows alone (see :meth:`LlamaModel.run_layers`)."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_transform(q, k)
        q, k, v = apply_rotary_qkv(q, k, v, *cos_sin, self.head_dim)
        out = self.attn(q, k, v, forward_batch)
        if keep_rows is not None:
            if keep_rows.numel() == 0:
                return hidden_states[:0]  # no row needs logits: a prefill chunk that does not end its prompt
            out = out.index_select(0, keep_rows)
            residual = None if residual is None else residual.index_select(0, keep_rows)
        return linear_add(self.o_proj, out, residual)


class LlamaMLP(nn.Module, FusableSwiGLU):
    """SwiGLU feed-forward with a merged gate/up projection (the CPU packer may fuse it)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias=bias)
        self.gate_up_sizes = list(self.gate_up_proj.local_sizes)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``down(silu(gate) * up)``, plus ``residual`` when given (fused like the attention's)."""
        return linear_add(self.down_proj, self.act(self.gate_up_proj(x)), residual)


class LlamaDecoderLayer(nn.Module, FusableDecoderLayer):
    """Pre-norm attention block then pre-norm MLP block, each with a residual add (a fused decode
    step may run it in C: :mod:`framework.models.fused_decode`)."""

    def __init__(self, config: Any, layer_id: int, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output rows: all of them, or those ``keep_rows`` names (in its order)."""
        # Residual adds in the activation dtype, one rounding each as in transformers (so bf16
        # matches it step for step); on CPU fp32 they are post-ops of the o_proj / down_proj GEMMs.
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos_sin, forward_batch, hidden_states,
                                       keep_rows)
        if hidden_states.shape[0] == 0:
            return hidden_states
        return self.mlp(self.post_attention_layernorm(hidden_states), hidden_states)

    def fused_decode_supported(self) -> bool:
        """Not when the attention transforms q and k before RoPE (Qwen3's per-head norms)."""
        return type(self.self_attn).qk_transform is LlamaAttention.qk_transform


class LlamaModel(nn.Module, FusableDecoderStack):
    """Embedding, decoder layers and final norm (the HF ``model.`` prefix)."""

    def __init__(self, config: Any, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # One table for all layers: cos/sin are gathered once per forward, not once per layer.
        self.rotary_emb: RotaryEmbedding = get_rope(config, config_head_dim(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.get_cos_sin(positions, hidden_states.dtype)
        return self.norm(self.run_layers(hidden_states, cos_sin, forward_batch))

    def run_layers(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   forward_batch: ForwardBatch) -> torch.Tensor:
        """The decoder layers: in one C call at a decode step the fused decoder takes, else module
        by module. Returns the rows ``forward_batch.logits_indices`` names when it is set, all rows
        otherwise.

        Why: only those rows reach the LM head (a prefill's last token per request), and after the
        last layer's attention no row depends on another, so that layer's output projection and
        MLP run on them alone: a 128-token prompt skips 127 rows of them, ~1/16 of its GEMM work
        for a llama-120m shape; a prefill chunk that does not end its prompt skips all of them.
        """
        if self.fused_decoder is not None:
            fused = self.fused_decoder.run(self.layers, hidden_states, cos_sin, forward_batch)
            if fused is not None:
                return select_rows(fused, forward_batch.logits_indices)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = forward_batch.logits_indices if i == last else None
            hidden_states = layer(hidden_states, cos_sin, forward_batch, keep)
        if last < 0:
            hidden_states = select_rows(hidden_states, forward_batch.logits_indices)
        return hidden_states


def select_rows(hidden_states: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``hidden_states[rows]`` (all of it when ``rows`` is None)."""
    return hidden_states if rows is None else hidden_states.index_select(0, rows)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over :class:`LlamaModel`; the plugin interface the model runner calls."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    selects_logits_rows = True
    """``forward`` returns only the rows ``forward_batch.logits_indices`` names (when set)."""

    # HF checkpoint name fragment -> (our merged parameter fragment, shard index).
    stacked_params: tuple[tuple[str, str, int], ...] = (
        ("q_proj", "qkv_proj", 0),
        ("k_proj", "qkv_proj", 1),
        ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, hf_config: Any, options: Any = None) -> None:
        super().__init__()
        self.config = hf_config
        self.options = options
        self.model = LlamaModel(hf_config, self.attention_cls)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm: the rows ``forward_batch.logits_indices`` names
        when it is set, else ``[num_tokens, hidden]``."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` for the given rows of hidden states (gathered from every
        tensor-parallel rank, so each rank samples from the full row)."""
        return float_linear(self.lm_head, hidden_states)

    def _shard_slices(self, merged: str) -> list[tuple[int, int]]:
        """Row ranges of each shard inside this rank's merged parameter (q, k, v or gate, up)."""
        layer = self.model.layers[0]  # read from the blocks: the projections may be packed (CPU)
        sizes = layer.self_attn.qkv_sizes if merged == "qkv_proj" else layer.mlp.gate_up_sizes
        bounds, start = [], 0
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        return bounds

    def hf_weight_location(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Where an HF-named tensor lives here: the parameter's name and, for a shard of a merged
        parameter (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``), its row range."""
        target, shard = self._target(name)
        return target, None if shard is None else self._shard_slices(target.split(".")[-2])[shard]

    def _target(self, name: str) -> tuple[str, int | None]:
        for hf_part, ours, shard in self.stacked_params:
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{ours}."), shard
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this module (casting to the parameter's dtype and device).

        Returns the names of the parameters written to (a merged parameter is listed once any of its
        shards was written; :func:`framework.models.loader.build_model` checks completeness). Unknown
        names raise, because a silent skip would hide a checkpoint that does not match the model.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # some old checkpoints saved HF's computed buffer; we compute our own
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the tied lm_head is the embedding itself
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}")
            module_name, _, param_name = target.rpartition(".")
            try:  # this rank's slice of the tensor, or all of it for replicated parameters
                load_parallel_weight(self.get_submodule(module_name), param_name, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"weight {name!r}: {exc}") from None
            loaded.add(target)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama network (its sliding window is not applied: see the module notes)."""

    attention_cls = LlamaAttention
