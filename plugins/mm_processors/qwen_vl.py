"""Qwen2-VL / Qwen2.5-VL: the model's own HF image processor, image token spans and M-RoPE positions.

Both models share the processor: an image becomes ``t x h x w`` patches (``pixel_values`` rows of
``C * temporal_patch * patch * patch`` values) and ``t * h * w / merge_size**2`` tokens in the
prompt, between ``<|vision_start|>`` and ``<|vision_end|>``.
"""

from __future__ import annotations

from typing import Any

from framework.multimodal.images import image_content_hash
from framework.multimodal.inputs import ImageItem, MultimodalInputs, pad_value_for
from framework.multimodal.mrope import compute_mrope_positions
from framework.multimodal.processor import MultimodalProcessor


class QwenVLProcessor(MultimodalProcessor):
    """Expands each ``<|image_pad|>`` (or run of them) to the image's token span, padded with the
    image's hash-derived id, and computes the prompt's M-RoPE positions."""

    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any, options: Any = None) -> None:
        super().__init__(model_path, hf_config, tokenizer, options)
        # The Pil class explicitly: torchvision is not installed, and AutoImageProcessor would warn
        # before falling back to it anyway.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge_size = int(hf_config.vision_config.spatial_merge_size)

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))  # as the text-only path tokenizes
        return list(prompt)

    def process(self, prompt: str | list[int], images: list[Any]) -> tuple[list[int], MultimodalInputs]:
        ids = self._token_ids(prompt)
        # A run of image tokens is one placeholder: a prompt whose spans were already expanded
        # (e.g. by HF's processor) is accepted as well as the chat template's single token.
        starts = [i for i, t in enumerate(ids) if t == self.image_token_id and (i == 0 or ids[i - 1] != t)]
        if len(starts) != len(images):
            raise ValueError(f"the prompt has {len(starts)} image placeholder(s) but {len(images)} image(s) were given")
        out: list[int] = []
        items: list[ImageItem] = []
        cursor = 0
        for start, image in zip(starts, images, strict=True):
            end = start
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            out.extend(ids[cursor:start])
            item = self._image_item(image, offset=len(out))
            out.extend([pad_value_for(item.hash)] * item.length)
            items.append(item)
            cursor = end
        out.extend(ids[cursor:])
        mm = MultimodalInputs(items=items)
        mm.mrope_positions, mm.mrope_position_delta = compute_mrope_positions(len(out), items, self.merge_size)
        return out, mm

    def _image_item(self, image: Any, offset: int) -> ImageItem:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        processed = self.image_processor(images=[rgb], return_tensors="pt")
        t, h, w = (int(x) for x in processed["image_grid_thw"][0])
        return ImageItem(
            pixel_values=processed["pixel_values"],
            grid_thw=(t, h, w),
            offset=offset,
            length=t * h * w // self.merge_size**2,
            hash=image_content_hash(image),
        )
