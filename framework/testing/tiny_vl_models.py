"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints with a local tokenizer and image processor, for tests.

Nothing is downloaded: the tokenizer is :func:`framework.testing.tiny_models.build_tokenizer`'s BPE
plus Qwen's vision special tokens and a chat template that places one
``<|vision_start|><|image_pad|><|vision_end|>`` per image part; the image processor is
transformers' Qwen2-VL one with small pixel bounds, so an image is a handful of patches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.testing.tiny_models import SPECIAL_TOKENS, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}" + IMAGE_PLACEHOLDER + "{% endif %}"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 4 * (PATCH_SIZE * MERGE_SIZE) ** 2
"""Smallest image: 2 x 2 merged tokens."""
MAX_PIXELS = 16 * (PATCH_SIZE * MERGE_SIZE) ** 2
"""Largest image: 16 merged tokens (64 patches), so tests stay cheap."""


def build_vl_tokenizer() -> Any:
    """The tiny BPE tokenizer with Qwen's vision tokens and a multimodal chat template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:] + VISION_TOKENS})
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def tiny_vl_config(architecture: str, tokenizer: Any, **text_overrides: Any) -> Any:
    """A transformers config of ``architecture`` small enough for CPU tests."""
    import transformers

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(
        ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"), VISION_TOKENS,
        strict=True)}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    text.update(text_overrides)
    common = dict(depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
                  in_channels=3)
    if architecture == "Qwen2VLForConditionalGeneration":
        vision = dict(common, embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2)
        cls = transformers.Qwen2VLConfig
    elif architecture == "Qwen2_5_VLForConditionalGeneration":
        # Windows of 2 x 2 merged tokens, block 1 attends to the whole image: both paths run.
        vision = dict(common, hidden_size=32, intermediate_size=48, out_hidden_size=text["hidden_size"],
                      window_size=PATCH_SIZE * MERGE_SIZE * 2, fullatt_block_indexes=[1])
        cls = transformers.Qwen2_5_VLConfig
    else:
        raise ValueError(f"no tiny VL config for {architecture!r}")
    config = cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.architectures = [architecture]
    return config


def save_tiny_vl_model(path: str | Path, architecture: str = "Qwen2VLForConditionalGeneration", seed: int = 0,
                       init_std: float = 0.2, **text_overrides: Any) -> Path:
    """Build, randomly initialise (``init_std``, so outputs are not flat) and save a tiny VL model
    with its tokenizer and image processor config; ``text_overrides`` change the text config."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    tokenizer = build_vl_tokenizer()
    config = tiny_vl_config(architecture, tokenizer, **text_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():  # the default init is too small to give varied tokens
            if param.dim() > 1:
                param.normal_(0.0, init_std)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                         merge_size=MERGE_SIZE, temporal_patch_size=2)
    processor.save_pretrained(path)
    return path


def make_image(width: int, height: int, seed: int = 0) -> Any:
    """A deterministic random RGB ``PIL.Image``."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), mode="RGB")
