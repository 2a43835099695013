"""The ``mooncake`` KV transfer plugin: Mooncake's TransferEngine (TCP on CPU, RDMA selectable)."""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugins.transfer.mooncake.backend import MooncakeOptions, MooncakeTransferBackend


@hookimpl
def register_transfer_backends(register) -> None:
    """Register the Mooncake transfer backend (imports mooncake only when one is built)."""
    register("mooncake", MooncakeTransferBackend.create, config=MooncakeOptions)
