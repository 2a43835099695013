"""The built-in ``flashinfer`` attention backend (flashinfer's paged prefill/decode kernels; CUDA only).

Registration never imports flashinfer, so ``plugserve plugins`` lists the backend on any machine;
selecting it without CUDA or without the ``flashinfer`` package fails at start with the reason.
"""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.attention.flashinfer.backend import FlashInferAttnBackend, FlashInferOptions

__all__ = ["FlashInferAttnBackend", "FlashInferOptions", "register_attention_backends"]


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``flashinfer``; its factory is the backend class, ``(runner, options) -> backend``."""
    register("flashinfer", FlashInferAttnBackend, config=FlashInferOptions, capabilities=Capabilities(
        devices=("cuda",), auto_priority={"cuda": 30}, cuda_graph=True,
        unavailable_reason=FlashInferAttnBackend.unavailable_reason))
