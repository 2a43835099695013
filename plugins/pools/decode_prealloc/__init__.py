"""The ``decode_prealloc`` request pool plugin (decode side of PD disaggregation)."""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.pools.decode_prealloc.pool import DecodePreallocOptions, DecodePreallocRequestPool


@hookimpl
def register_memory_pools(register: Register) -> None:
    """Register the decode pre-allocating pool (what ``auto`` picks on a PD decode server)."""
    register("decode_prealloc", DecodePreallocRequestPool.create, config=DecodePreallocOptions,
             capabilities=Capabilities(auto_priority={"cpu": 0, "cuda": 0}, preallocation=True))
