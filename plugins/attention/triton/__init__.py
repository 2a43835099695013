"""The built-in ``triton`` attention backend (plugserve's own Triton kernels over the paged KV cache).

Registration imports neither triton nor the kernels, so ``plugserve plugins`` lists the backend on
any machine; selecting it where it cannot run fails at start with the reason.
"""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.attention.triton.backend import TritonAttnBackend, TritonOptions

__all__ = ["TritonAttnBackend", "TritonOptions", "register_attention_backends"]


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``triton``; its factory is the backend class, ``(runner, options) -> backend``."""
    # On CPU it runs only under TRITON_INTERPRET=1 (a test aid), so auto never picks it there.
    register("triton", TritonAttnBackend, config=TritonOptions, capabilities=Capabilities(
        devices=("cuda", "cpu"), auto_priority={"cuda": 20}, cuda_graph=True,
        unavailable_reason=TritonAttnBackend.unavailable_reason))
