"""The built-in ``cpu_paged`` attention backend (a C decode kernel over the paged KV cache, CPU)."""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.attention.cpu_paged.backend import CpuPagedAttnBackend, CpuPagedOptions

__all__ = ["CpuPagedAttnBackend", "CpuPagedOptions", "register_attention_backends"]


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``cpu_paged``; its factory is the backend class, ``(runner, options) -> backend``."""
    register("cpu_paged", CpuPagedAttnBackend, config=CpuPagedOptions, capabilities=Capabilities(
        devices=("cpu",), auto_priority={"cpu": 20}, unavailable_reason=CpuPagedAttnBackend.unavailable_reason))
