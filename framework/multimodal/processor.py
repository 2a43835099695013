"""The multimodal processor plugin kind (``mm_processor``): prompt + images -> ids + tensors.

A processor runs where tokenization runs (the HTTP process, or the caller's process for the
in-process :class:`~framework.engine.Engine`), never in the scheduler: decoding and resizing images
is CPU work that must not stall a running batch. Processors register under the Hugging Face
``architectures`` name of the model they serve, exactly like models do, so a third-party model
package brings its own processor by registering both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from framework.multimodal.inputs import MultimodalInputs


class MultimodalProcessor(ABC):
    """Turns one prompt and its images into token ids and :class:`MultimodalInputs`.

    ``model_path`` is the checkpoint directory (its ``preprocessor_config.json`` configures the
    model's own Hugging Face image processor); ``hf_config`` the model's config; ``tokenizer`` the
    server's tokenizer; ``options`` the plugin's options dataclass (or None).
    """

    #: Text the chat template emits where an image goes (e.g. Qwen2-VL's vision start/pad/end run).
    image_placeholder: str = ""

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any, options: Any = None) -> None:
        self.model_path = model_path
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.options = options

    @abstractmethod
    def process(self, prompt: str | list[int], images: list[Any]) -> tuple[list[int], MultimodalInputs]:
        """Token ids with every image span padded by its item's ``pad_value``, and the inputs.

        ``prompt`` holds one placeholder per image (text with ``image_placeholder``, or ids with
        the model's image token); ``images`` are decoded ``PIL.Image`` objects in prompt order.
        A mismatch between placeholders and images raises ``ValueError`` with a message fit for
        an HTTP 400."""

