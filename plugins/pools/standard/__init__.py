"""The ``standard`` request pool plugin."""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from plugins.pools.standard.pool import StandardPoolOptions, StandardRequestPool


@hookimpl
def register_memory_pools(register: Register) -> None:
    """Register the standard pool (what ``auto`` picks unless a server needs pre-allocation)."""
    register("standard", StandardRequestPool.create, config=StandardPoolOptions,
             capabilities=Capabilities(auto_priority={"cpu": 10, "cuda": 10}))
