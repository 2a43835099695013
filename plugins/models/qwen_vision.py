"""The Qwen2-VL and Qwen2.5-VL vision towers: patch embedding, ViT blocks with 2-D rotary
embeddings, and the patch merger that turns each ``merge x merge`` block of patches into one
language-model token.

Qwen2-VL blocks are LayerNorm + quick-GELU MLP with full attention within an image; Qwen2.5-VL
blocks are RMSNorm + SwiGLU MLP and attend within windows of ``window_size`` pixels, except the
blocks listed in ``fullatt_block_indexes``. Attention never crosses images, so the tower encodes
one image at a time (:meth:`QwenVisionTower.encode`) and the result does not depend on which other
images share the batch. Parameter names follow the checkpoints (``visual.*``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.layers import RMSNorm, rotate_half


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class PatchEmbed(nn.Module):
    """A 3-D convolution whose kernel equals its stride, i.e. one linear map per flattened patch."""

    def __init__(self, cfg: Any, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Conv3d(cfg.in_channels, embed_dim, kernel_size=(t, p, p), stride=(t, p, p), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(pixels.to(weight.dtype), weight)


class VisionAttention(nn.Module):
    """Bidirectional attention over packed segments (``cu_seqlens``), 2-D rotary on q and k."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        # Rotary in float32 whatever the weights' dtype, as the reference does.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        outs = []
        for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            seg = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]  # [heads, len, head_dim]
            outs.append(F.scaled_dot_product_attention(*seg).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class QuickGeluMLP(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's ``down(act(gate(x)) * up(x))``, with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP with residuals; the norm and MLP kinds depend on the model."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms_norm: bool) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = RMSNorm(dim, eps=1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each ``merge x merge`` block (consecutive rows) and project."""

    def __init__(self, context_dim: int, out_dim: int, merge: int, rms_norm: bool) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, eps=1e-6) if rms_norm else nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class QwenVisionTower(nn.Module):
    """Patch embedding, blocks and merger; ``encode`` maps one image's pixel rows to its tokens."""

    def __init__(self, cfg: Any, qwen25: bool) -> None:
        super().__init__()
        dim = cfg.hidden_size if qwen25 else cfg.embed_dim
        out_dim = cfg.out_hidden_size if qwen25 else cfg.hidden_size
        self.merge = cfg.spatial_merge_size
        self.qwen25 = qwen25
        self.patch_size = cfg.patch_size
        self.window_size = getattr(cfg, "window_size", 0)
        self.full_attention_blocks = set(getattr(cfg, "fullatt_block_indexes", None) or [])
        self.head_dim = dim // cfg.num_heads
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32) / (self.head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / (theta**quarter), persistent=False)
        self._theta = theta
        self.patch_embed = PatchEmbed(cfg, dim)

        def mlp() -> nn.Module:
            if qwen25:
                return GatedMLP(dim, cfg.intermediate_size, cfg.hidden_act)
            return QuickGeluMLP(dim, int(dim * cfg.mlp_ratio), cfg.hidden_act)

        self.blocks = nn.ModuleList(VisionBlock(dim, cfg.num_heads, mlp(), qwen25) for _ in range(cfg.depth))
        self.merger = PatchMerger(dim, out_dim, self.merge, qwen25)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the inverse frequencies after materialisation from the meta device."""
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32) / (self.head_dim // 2)
        self.inv_freq = (1.0 / (self._theta**quarter)).to(self.inv_freq.device)

    def _rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[patches, 1, head_dim]``: the patch's row then column angles, in the
        processor's block-major patch order (each merge block's patches are consecutive)."""
        t, h, w = grid
        m = self.merge
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
        pos = torch.stack([rows, cols], dim=-1).repeat(t, 1).to(self.inv_freq.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, 2 * head_dim / 4]: rows then cols
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def _windows(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the order of merge units that groups each window's units together, and the
        windows' patch boundaries in that order."""
        t, h, w = grid
        gh, gw = h // self.merge, w // self.merge
        win = self.window_size // self.merge // self.patch_size
        unit = torch.arange(t * gh * gw).view(t, gh, gw)
        order: list[torch.Tensor] = []
        bounds = [0]
        for ti in range(t):
            for r in range(0, gh, win):
                for c in range(0, gw, win):
                    ids = unit[ti, r : r + win, c : c + win].reshape(-1)
                    order.append(ids)
                    bounds.append(bounds[-1] + ids.numel() * self.merge**2)
        return torch.cat(order), bounds

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[t * h * w / merge**2, out_hidden]`` embeddings of one image."""
        t, h, w = grid
        x = self.patch_embed(pixel_values.to(self.inv_freq.device))
        cos, sin = self._rotary(grid)
        frames = [i * h * w for i in range(t + 1)]  # full attention: within each frame
        unit = self.merge**2
        order = None
        windows = frames
        if self.qwen25:
            order, windows = self._windows(grid)
            # Permute whole merge units so each window is contiguous; the merger undoes it below.
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            cos = cos.view(-1, unit, *cos.shape[1:])[order].flatten(0, 1)
            sin = sin.view(-1, unit, *sin.shape[1:])[order].flatten(0, 1)
        for i, block in enumerate(self.blocks):
            full = not self.qwen25 or i in self.full_attention_blocks
            x = block(x, frames if full else windows, cos, sin)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged
