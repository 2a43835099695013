"""Built-in multimodal processors, registered under their model's Hugging Face architecture name."""

from __future__ import annotations

from framework.hookspecs import Register, hookimpl
from plugins.mm_processors.qwen_vl import QwenVLProcessor

PROCESSORS = {
    "Qwen2VLForConditionalGeneration": QwenVLProcessor,
    "Qwen2_5_VLForConditionalGeneration": QwenVLProcessor,
}


@hookimpl
def register_mm_processors(register: Register) -> None:
    """Register the Qwen2-VL and Qwen2.5-VL image processors."""
    for name, cls in PROCESSORS.items():
        register(name, cls, config=None)
