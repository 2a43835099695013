"""M-RoPE positions (Qwen2-VL family): three position rows (temporal, height, width) per token.

Text tokens advance all three rows together, so a text-only prompt gets ``[p, p, p]`` at every
position ``p``: exactly the plain 1-D positions. An image span of ``t x h x w`` merged patches
takes its temporal/height/width grid coordinates, offset by the position the span starts at; the
text after it resumes one past the largest position the image used. Because an image occupies
fewer positions than tokens, every token after the prompt is shifted by a constant
``delta = max position + 1 - prompt length``: decode needs only ``p + delta``.
"""

from __future__ import annotations

import torch

from framework.multimodal.inputs import ImageItem, MultimodalInputs


def image_positions(item: ImageItem, start: int, spatial_merge_size: int) -> torch.Tensor:
    """``[3, item.length]`` positions of one image span whose first position is ``start``; rows
    in the encoder's output order (temporal-major, then height, then width)."""
    t, h, w = item.grid_thw
    h, w = h // spatial_merge_size, w // spatial_merge_size
    if t * h * w != item.length:
        raise ValueError(f"image grid {item.grid_thw} gives {t * h * w} tokens, its span has {item.length}")
    grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
    return grid.reshape(3, -1) + start


def compute_mrope_positions(prompt_len: int, items: list[ImageItem],
                            spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """``([3, prompt_len] int64 positions, delta)`` of a prompt whose image spans are ``items``
    (in prompt order, not overlapping)."""
    pieces: list[torch.Tensor] = []
    cursor = 0  # next prompt index to place
    next_pos = 0  # position the next token gets
    for item in sorted(items, key=lambda i: i.offset):
        if item.offset < cursor or item.end > prompt_len:
            raise ValueError(f"image span [{item.offset}, {item.end}) overlaps another or leaves the prompt")
        text = item.offset - cursor
        pieces.append(torch.arange(next_pos, next_pos + text).expand(3, text))
        next_pos += text
        pos = image_positions(item, next_pos, spatial_merge_size)
        pieces.append(pos)
        next_pos = int(pos.max()) + 1
        cursor = item.end
    tail = prompt_len - cursor
    pieces.append(torch.arange(next_pos, next_pos + tail).expand(3, tail))
    positions = torch.cat(pieces, dim=1).to(torch.int64)
    delta = (next_pos + tail) - prompt_len
    return positions, delta


def chunk_positions(mm: MultimodalInputs | None, start: int, end: int, prompt_len: int) -> torch.Tensor:
    """``[3, end - start]`` positions of sequence positions ``[start, end)`` of a request: prompt
    rows from its M-RoPE table, later rows (its output tokens, also when a retracted request
    re-prefills them) ``p + delta`` on all three sections. Without an M-RoPE table: ``p``."""
    delta = mm.mrope_position_delta if mm is not None else 0
    table = mm.mrope_positions if mm is not None else None
    parts: list[torch.Tensor] = []
    split = min(end, prompt_len) if table is not None else start
    if table is not None and split > start:
        parts.append(table[:, start:split])
    lo = max(start, split)
    if end > lo:
        parts.append((torch.arange(lo, end, dtype=torch.int64) + delta).expand(3, end - lo))
    if not parts:
        return torch.empty(3, 0, dtype=torch.int64)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
