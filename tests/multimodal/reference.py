"""transformers' own Qwen2-VL / Qwen2.5-VL as the reference the multimodal tests compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from framework.multimodal.inputs import is_pad_id

MAX_NEW = 6
"""Greedy tokens compared per request."""


class Reference:
    """transformers' model on the checkpoint, with our ids mapped back to its image token."""

    def __init__(self, path: Path) -> None:
        config = transformers.AutoConfig.from_pretrained(path)
        self.model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
        self.image_token_id = config.image_token_id
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)

    def inputs(self, padded_ids: list[int], images: list[Any]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([[self.image_token_id if is_pad_id(t) else t for t in padded_ids]])
        kwargs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                          mm_token_type_ids=(ids == self.image_token_id).to(torch.int32))
        return kwargs

    @torch.no_grad()
    def logits(self, padded_ids: list[int], images: list[Any]) -> torch.Tensor:
        return self.model(**self.inputs(padded_ids, images)).logits[0]

    @torch.no_grad()
    def greedy(self, padded_ids: list[int], images: list[Any], max_new: int = MAX_NEW) -> list[int]:
        inputs = self.inputs(padded_ids, images)
        out = self.model.generate(**inputs, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        return out[0, len(padded_ids):].tolist()

    @torch.no_grad()
    def rope_index(self, padded_ids: list[int], images: list[Any]) -> tuple[torch.Tensor, int]:
        """transformers' ``get_rope_index``: ``([3, len] positions, delta)``."""
        inputs = self.inputs(padded_ids, images)
        if not images:
            n = len(padded_ids)
            return torch.arange(n).expand(3, n), 0
        pos, delta = self.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     image_grid_thw=inputs["image_grid_thw"])
        return pos[:, 0], int(delta.reshape(-1)[0])
