"""The ``nccl`` KV transfer plugin: torch.distributed point-to-point (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugins.transfer.nccl.backend import NcclOptions, NcclTransferBackend


@hookimpl
def register_transfer_backends(register) -> None:
    """Register the torch.distributed point-to-point transfer backend."""
    register("nccl", NcclTransferBackend.create, config=NcclOptions)
