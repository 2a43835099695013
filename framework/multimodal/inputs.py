"""What a multimodal request carries from the processor (HTTP/tokenizer process) to the model.

A processor (plugin kind ``mm_processor``, see :mod:`framework.multimodal.processor`) turns a
prompt and its images into token ids plus a :class:`MultimodalInputs`. Every token of an image's
span in ``input_ids`` is replaced by that image's ``pad_value``, an id derived from the image's
content hash and outside any vocabulary (``>= PAD_VALUE_BASE``). The radix cache keys on token ids,
so two requests with the same image share KV and different images never do (SGLang pads image
tokens the same way). The model finds its image spans through ``MultimodalInputs.items`` and puts
the vision encoder's embeddings there instead of looking the pad ids up in its embedding table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

#: Pad ids start here: far above any real vocabulary, still inside int32.
PAD_VALUE_BASE = 1 << 30


def content_hash(data: bytes) -> int:
    """A 62-bit hash of an image's decoded pixels (stable across processes and hosts)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def pad_value_for(hash_value: int) -> int:
    """The token id every position of an image's span carries in ``input_ids``."""
    return PAD_VALUE_BASE + hash_value % PAD_VALUE_BASE


def is_pad_id(token_id: int) -> bool:
    return token_id >= PAD_VALUE_BASE


@dataclass
class ImageItem:
    """One image of a request, processed and ready for the vision encoder."""

    pixel_values: torch.Tensor
    """The model's image processor output for this image alone (Qwen2-VL: [patches, C*T*P*P])."""
    grid_thw: tuple[int, int, int]
    """Patch grid (temporal, height, width) before the spatial merge."""
    offset: int
    """First position of the image's token span in the prompt."""
    length: int
    """Tokens in the span (the encoder's output rows for this image)."""
    hash: int
    """:func:`content_hash` of the decoded image."""

    @property
    def pad_value(self) -> int:
        return pad_value_for(self.hash)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultimodalInputs:
    """Everything beyond token ids that a multimodal prompt needs in the scheduler process."""

    items: list[ImageItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    """M-RoPE models: [3, prompt_len] int64 (temporal, height, width) position of each prompt token."""
    mrope_position_delta: int = 0
    """M-RoPE models: a generated token at sequence position ``p`` has position ``p + delta`` on all
    three sections. Decode needs only this (a PD decode server gets it with the KV)."""

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every image span, in prompt order."""
        return [(item.offset, item.end) for item in self.items]

    def pixels_needed_until(self) -> int:
        """End of the last image span whose pixels are absent (0 when every image has its pixels).

        A PD decode server's scheduler gets spans but no pixels: the prefill server encoded them.
        Such a request can be prefilled again (after a retraction) only from a cached prefix that
        reaches this far."""
        return max((item.end for item in self.items if item.pixel_values.numel() == 0), default=0)

    def check_ids(self, input_ids: list[int], vocab_size: int) -> str | None:
        """Why ``input_ids`` do not fit these inputs (None when they do): vocabulary ids outside
        the image spans, each span entirely its image's pad id (anything else would index a
        vocabulary-sized tensor out of range)."""
        expected: dict[int, int] = {}
        for item in self.items:
            if item.offset < 0 or item.end > len(input_ids):
                return f"image span [{item.offset}, {item.end}) is outside the prompt ({len(input_ids)} tokens)"
            expected.update((p, item.pad_value) for p in range(item.offset, item.end))
        for p, t in enumerate(input_ids):
            pad = expected.get(p)
            if (t != pad) if pad is not None else not 0 <= t < vocab_size:
                return (f"input_ids[{p}] = {t}: ids must be in [0, {vocab_size}) outside image spans and the "
                        "image's pad id inside them")
        return None

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack types (tensors as safetensors bytes, never pickle): what another
        tensor-parallel rank needs to rebuild these inputs with :meth:`from_wire`."""
        from safetensors.torch import save

        tensors = {f"pixels.{i}": item.pixel_values.detach().cpu().contiguous() for i, item in enumerate(self.items)}
        if self.mrope_positions is not None:
            tensors["mrope_positions"] = self.mrope_positions.detach().cpu().contiguous()
        return {
            "items": [[list(i.grid_thw), i.offset, i.length, i.hash] for i in self.items],
            "tensors": save(tensors),
            "delta": self.mrope_position_delta,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> MultimodalInputs:
        from safetensors.torch import load

        tensors = load(bytes(data["tensors"]))
        items = [ImageItem(tensors[f"pixels.{i}"], (int(g[0]), int(g[1]), int(g[2])), int(off), int(n), int(h))
                 for i, (g, off, n, h) in enumerate(data["items"])]
        return cls(items, tensors.get("mrope_positions"), int(data["delta"]))
