"""The ``nixl`` KV transfer plugin: NIXL agents over UCX (DRAM on CPU, VRAM on GPU)."""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugins.transfer.nixl.backend import NixlOptions, NixlTransferBackend


@hookimpl
def register_transfer_backends(register) -> None:
    """Register the NIXL transfer backend (imports nixl only when one is built)."""
    register("nixl", NixlTransferBackend.create, config=NixlOptions)
