"""Building blocks shared by the model plugins: RMSNorm, the gated-SiLU activation and rotary embeddings.

The numerics deliberately follow Hugging Face transformers operation by operation (fp32 norm
statistics, fp32 inverse frequencies, ``rotate_half`` application in the activation dtype), because
the tests require greedy outputs to match ``transformers`` token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.kernels.rmsnorm import rms_norm
from framework.kernels.rotary import rotary_qkv
from framework.models.onednn_rows import padded_empty


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 and cast back, as transformers' ``LlamaRMSNorm``.

    fp32 and bf16 on CPU run one C call per norm (:mod:`framework.kernels.rmsnorm`): the same
    operations and roundings except for the order of the sum of squares, so it agrees with
    transformers to a few float rounding steps (fp32) or one bf16 step where a mean lands on the
    other side of a rounding boundary, not bitwise. Elsewhere (fp16, GPU, autograd) it is
    transformers' ops exactly.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        if x.dim() == 2 and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
            # Rows a packed GEMM takes without copying them into its row bucket (onednn_rows).
            out = padded_empty(x.shape[0], x.shape[1], x.dtype)
        fused = rms_norm(x, self.weight, self.eps, out=out)
        if fused is not None:
            return fused
        # Not F.rms_norm: bitwise equal in fp32, but decode steps with it were no faster here (one A/B
        # pair even slower, within this machine's run-to-run noise), so the HF-shaped ops stay.
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        # The weight multiply happens after the cast back, in the weight's dtype: that is where HF does
        # it, and bf16 rounding differs if done before the cast.
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for a merged ``[..., 2 * d]`` gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusableSwiGLU:
    """Declares an MLP module's opt-in to the CPU packer's SwiGLU fusion
    (``framework.models.cpu_linear``): the module has ``gate_up_proj``, an ``nn.Linear`` whose
    output is ``[gate; up]``, and ``act``, a :class:`SiluAndMul` applied to it, and computes
    ``act(gate_up_proj(x))`` with nothing in between. The packer then replaces ``gate_up_proj`` by
    one fused ``silu(gate) * up`` GEMM pair and ``act`` by identity. A module that does not
    inherit this is never rewritten, whatever its attributes are called."""


# --- rotary embeddings -------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeParams:
    """The rotary-embedding settings of a model, normalised from either transformers config layout."""

    rope_theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    scaling: dict[str, Any] | None = None
    """The full rope dict (``factor``, ``low_freq_factor``, ...), for the scaled types."""


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_params_from_config(hf_config: Any) -> RopeParams:
    """Read rope settings from a transformers config.

    transformers 5 keeps everything in ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
    scaling keys); transformers 4 had ``config.rope_theta`` plus an optional ``config.rope_scaling``
    dict whose type key was ``type`` in older checkpoints and ``rope_type`` in newer ones.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {_SUPPORTED_ROPE_TYPES})")
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        # transformers fills this in from max_position_embeddings when the checkpoint omits it.
        params["original_max_position_embeddings"] = hf_config.max_position_embeddings
    return RopeParams(
        rope_theta=float(theta) if theta is not None else 10000.0,
        rope_type=rope_type,
        partial_rotary_factor=float(partial) if partial is not None else 1.0,
        scaling=params if rope_type != "default" else None,
    )


def compute_inv_freq(rotary_dim: int, params: RopeParams) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` in float32, computed with transformers' formulas."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float32) / rotary_dim
    inv_freq = 1.0 / (params.rope_theta**exponent)
    if params.rope_type == "linear":
        assert params.scaling is not None
        inv_freq = inv_freq / params.scaling["factor"]
    elif params.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params.scaling or {})
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the neox / HF rotary layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table precomputed for every position.

    The table is a non-persistent buffer, so it never appears in (or is expected from) a checkpoint;
    :meth:`reset_buffers` recomputes it after the model was materialised from the meta device.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: RopeParams) -> None:
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.params = params
        # Built on the meta device (build_model), the table is only a shape until reset_buffers:
        # computing it there would also import torch._dynamo (meta ops run through torch._refs),
        # ~0.7 s of every scheduler's start.
        on_meta = torch.get_default_device().type == "meta"
        table = torch.empty(max_position, rotary_dim, dtype=torch.float32) if on_meta else self._compute_cos_sin()
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _compute_cos_sin(self) -> torch.Tensor:
        # float32 like HF's rotary forward: freqs = position * inv_freq (an elementwise product, not a
        # matmul, so every entry is bitwise what HF computes for that position). Only half of the
        # (duplicated) angles is stored, to halve the table.
        inv_freq = compute_inv_freq(self.rotary_dim, self.params)
        positions = torch.arange(self.max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the cos/sin table in place on the module's current device (after ``to_empty``)."""
        table = self._compute_cos_sin().to(self.cos_sin_cache.device)
        self.cos_sin_cache = table.to(self.cos_sin_cache.dtype)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin``, each ``[num_tokens, 1, rotary_dim]`` in ``dtype`` (broadcast over heads)."""
        # Cast after the gather and after cos/sin in fp32, which is exactly HF's ``cos.to(x.dtype)``.
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(torch.float32).chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[n, heads * head_dim]`` and ``k`` ``[n, kv_heads * head_dim]`` (or 3-D)."""
        cos, sin = self.get_cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Apply RoPE to ``x`` (``[n, heads * head_dim]`` or ``[n, heads, head_dim]``), keeping its shape.

    Only the first ``cos.shape[-1]`` dims of each head are rotated (partial rotary); the rest pass.
    """
    shape = x.shape
    x = x.view(shape[0], -1, head_dim)
    rotary_dim = cos.shape[-1]
    if rotary_dim == head_dim:
        out = x * cos + rotate_half(x) * sin
    else:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
    return out.view(shape)


def apply_rotary_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on ``q`` and ``k`` (``[n, heads * head_dim]``, e.g. views into a merged qkv output), and
    all three returned contiguous, as attention backends take them.

    For fp32 and bf16 on CPU this is one call of a C kernel (:mod:`framework.kernels.rotary`),
    bitwise equal to :func:`apply_rotary` (same products, sums and roundings, no fused
    multiply-add); elsewhere the torch ops.
    """
    fused = rotary_qkv(q, k, v, cos, sin, head_dim)
    if fused is not None:
        return fused
    return (apply_rotary(q, cos, sin, head_dim).contiguous(), apply_rotary(k, cos, sin, head_dim).contiguous(),
            v.contiguous())


def get_rope(hf_config: Any, head_dim: int, max_position: int | None = None) -> RotaryEmbedding:
    """Build the :class:`RotaryEmbedding` a transformers config describes."""
    params = rope_params_from_config(hf_config)
    rotary_dim = int(head_dim * params.partial_rotary_factor)
    if max_position is None:
        max_position = int(hf_config.max_position_embeddings)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, params)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (M-RoPE, Qwen2-VL): the rotary half-dimensions are split into
    ``mrope_section`` = (temporal, height, width) sections, and section ``i`` takes its angle from
    position row ``i``. With ``[3, n]`` positions whose rows are equal (text) this is plain RoPE;
    1-D positions are accepted too and mean exactly that."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: RopeParams,
                 mrope_section: list[int]) -> None:
        super().__init__(head_dim, rotary_dim, max_position, params)
        if len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must be 3 sections summing to {rotary_dim // 2}")
        self.mrope_section = list(mrope_section)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().get_cos_sin(positions, dtype)
        half = self.rotary_dim // 2
        cos_parts, sin_parts = [], []
        start = 0
        for row, size in enumerate(self.mrope_section):
            table = self.cos_sin_cache.index_select(0, positions[row]).to(torch.float32)
            cos_parts.append(table[:, start : start + size])
            sin_parts.append(table[:, half + start : half + start + size])
            start += size
        cos, sin = torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos, sin


def get_mrope(hf_config: Any, head_dim: int, mrope_section: list[int]) -> MRotaryEmbedding:
    """The :class:`MRotaryEmbedding` of a text config whose rope has ``mrope_section``."""
    params = rope_params_from_config(hf_config)
    rotary_dim = int(head_dim * params.partial_rotary_factor)
    return MRotaryEmbedding(head_dim, rotary_dim, int(hf_config.max_position_embeddings), params, mrope_section)
