"""Qwen2-VL and Qwen2.5-VL: a vision tower whose image embeddings replace the image spans of the
prompt, and the Qwen2 language model with M-RoPE.

The scheduler hands the model each request's :class:`~framework.multimodal.inputs.MultimodalInputs`
(``forward_batch.mm_inputs``) and ``[3, num_tokens]`` positions (``uses_mrope``). In a prefill
chunk, every image whose span overlaps the chunk is encoded and its rows inside the chunk are
written over the token embeddings, so a chunk may start or end inside an image. Encoder outputs are
kept in a small LRU keyed by the image's content hash, so later chunks of the same image (and
other requests with it) do not encode it again.

Image spans hold pad ids (``>= 2**30``), which never reach the embedding table. Under tensor
parallelism the language model is split like Qwen2's and every rank runs the (small, replicated)
vision tower on the images it was sent, so no collective is added.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.models.layers import get_mrope
from framework.multimodal.inputs import ImageItem
from plugins.models.llama import config_head_dim
from plugins.models.qwen2 import Qwen2ForCausalLM
from plugins.models.qwen_vision import QwenVisionTower

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch

# Checkpoint name prefixes as transformers' in-memory modules name them -> as saved on disk.
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _checkpoint_name(name: str) -> str:
    """A weight's name as saved checkpoints spell it (``model.language_model.x`` -> ``model.x``)."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass
class QwenVLOptions:
    """``model.options`` of the Qwen VL models."""

    encoder_cache_images: int = 8
    """Images whose vision-encoder output is kept (LRU, by content hash): chunks of one image and
    requests that repeat it reuse the embeddings. 0 disables the cache."""


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: vision tower + patch merger + Qwen2 decoder with M-RoPE."""

    uses_mrope = True
    """The model reads ``[3, num_tokens]`` M-RoPE positions (the batch builder provides them)."""
    accepts_mm_inputs = True
    """Requests may carry images (``forward_batch.mm_inputs``)."""
    qwen25 = False

    def __init__(self, hf_config: Any, options: QwenVLOptions | None = None) -> None:
        text = copy.copy(hf_config.get_text_config())
        # Older checkpoints declare tying at the top level only.
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        super().__init__(text, options or QwenVLOptions())
        self.config = hf_config
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        if "mrope_section" not in rope:
            raise ValueError("the text config's rope parameters have no mrope_section")
        self.model.rotary_emb = get_mrope(text, config_head_dim(text), list(rope["mrope_section"]))
        self.visual = QwenVisionTower(hf_config.vision_config, self.qwen25)
        self.vocab_size = int(text.vocab_size)
        self._encoded: OrderedDict[tuple[int, tuple[int, int, int]], torch.Tensor] = OrderedDict()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        # Pad ids are out of the vocabulary: look up row 0 there; the image rows replace them.
        ids = torch.where(input_ids < self.vocab_size, input_ids, torch.zeros_like(input_ids))
        hidden = self.model.embed_tokens(ids)
        if forward_batch.mm_inputs is not None and forward_batch.mode.is_extend():
            self._place_images(hidden, forward_batch)
        cos_sin = self.model.rotary_emb.get_cos_sin(positions, hidden.dtype)
        return self.model.norm(self.model.run_layers(hidden, cos_sin, forward_batch))

    def _place_images(self, hidden: torch.Tensor, fb: ForwardBatch) -> None:
        """Write each image's embedding rows that fall in this step's tokens over ``hidden``."""
        prefix_lens, new_lens = fb.extend_lengths()
        row = 0  # first row of the request in this batch
        for mm, start, n in zip(fb.mm_inputs or [], prefix_lens, new_lens, strict=True):
            end = start + n
            for item in mm.items if mm is not None else []:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    emb = self._encode(item)
                    hidden[row + lo - start : row + hi - start] = emb[lo - item.offset : hi - item.offset]
            row += n

    def _encode(self, item: ImageItem) -> torch.Tensor:
        key = (item.hash, item.grid_thw)
        if key in self._encoded:
            self._encoded.move_to_end(key)
            return self._encoded[key]
        emb = self.visual.encode(item.pixel_values, item.grid_thw).to(self.model.embed_tokens.weight.dtype)
        if emb.shape[0] != item.length:
            raise ValueError(f"image grid {item.grid_thw} encodes to {emb.shape[0]} rows, its span has {item.length}")
        limit = self.options.encoder_cache_images if self.options is not None else 0
        if limit > 0:
            self._encoded[key] = emb
            while len(self._encoded) > limit:
                self._encoded.popitem(last=False)
        return emb

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's weights through Qwen2's loader, the vision tower's copied as they are."""
        self._encoded.clear()  # new weights: cached embeddings are stale
        visual = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _checkpoint_name(name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                param = visual.get(name[len("visual."):])
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}")
                full = tensor.full() if hasattr(tensor, "full") else tensor
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(full.shape)}")
                param.copy_(full.to(param.dtype))
                loaded.add(name)

        text_loaded = super().load_weights(text_weights())  # runs the generator, filling ``loaded``
        return loaded | text_loaded

    def hf_weight_location(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Like the text model's, with the vision tower's names (never merged) as they are."""
        name = _checkpoint_name(name)
        return (name, None) if name.startswith("visual.") else super().hf_weight_location(name)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the vision tower with window attention, RMSNorm and a SwiGLU MLP."""

    qwen25 = True
