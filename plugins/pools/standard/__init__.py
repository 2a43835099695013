"""The ``standard`` request pool plugin."""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugins.pools.standard.pool import StandardPoolOptions, StandardRequestPool


@hookimpl
def register_memory_pools(register) -> None:
    """Register the standard pool."""
    register("standard", StandardRequestPool.create, config=StandardPoolOptions)
