"""Which multimodal processor serves a loaded model (kept apart from the processor base class,
which plugins import, because this module reads the plugin registry)."""

from __future__ import annotations

from typing import Any

from framework.multimodal.processor import MultimodalProcessor
from framework.plugins import get_registry


def build_processor(model_path: str, hf_config: Any, tokenizer: Any, architecture: str | None = None,
                    options: Any = None) -> MultimodalProcessor | None:
    """The registered ``mm_processor`` for a loaded model, or None for a text-only model.

    ``architecture`` defaults to the config's first ``architectures`` entry (what
    ``model.architecture`` overrides); ``options`` is the processor's options mapping (defaults
    when None)."""
    arch = architecture or (getattr(hf_config, "architectures", None) or [None])[0]
    registry = get_registry()
    if arch is None or not registry.has("mm_processor", arch):
        return None
    comp = registry.get("mm_processor", arch)
    return comp.factory(model_path, hf_config, tokenizer, comp.make_options(options))
