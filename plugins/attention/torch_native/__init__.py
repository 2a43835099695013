"""The built-in ``torch_native`` attention backend (plain PyTorch SDPA over the paged KV cache)."""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.attention.torch_native.backend import TorchNativeAttnBackend, TorchNativeOptions

__all__ = ["TorchNativeAttnBackend", "TorchNativeOptions", "register_attention_backends"]


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``torch_native``; its factory is the backend class, ``(runner, options) -> backend``."""
    # The reference: runs anywhere, chosen by auto only when nothing faster can run.
    register("torch_native", TorchNativeAttnBackend, config=TorchNativeOptions, capabilities=Capabilities(
        auto_priority={"cpu": 10, "cuda": 10}, cuda_graph=True))
