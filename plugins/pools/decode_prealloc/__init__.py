"""The ``decode_prealloc`` request pool plugin (decode side of PD disaggregation)."""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugins.pools.decode_prealloc.pool import DecodePreallocOptions, DecodePreallocRequestPool


@hookimpl
def register_memory_pools(register) -> None:
    """Register the decode pre-allocating pool."""
    register("decode_prealloc", DecodePreallocRequestPool.create, config=DecodePreallocOptions)
