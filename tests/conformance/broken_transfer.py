"""Transfer backends for the transfer kit's own tests, importable by its peer processes (a factory
the kit is given is rebuilt in each child from its module and qualified name)."""

from __future__ import annotations

from plugins.transfer.nccl.backend import NcclTransferBackend


class CorruptingBackend(NcclTransferBackend):
    """The nccl backend whose receiver flips one bit of the first page it receives for a room."""

    def _receive_pages(self, runs: list[list[int]], into_kv: bool) -> None:
        super()._receive_pages(runs, into_kv)
        if into_kv and runs:
            _src, dst, _n = runs[0]
            buf = self.layout.buffers[1]  # layer 0's V
            buf[dst * self.layout.bytes_per_page + 5] ^= 0x10


class BlindBackend(NcclTransferBackend):
    """The nccl backend with ``link_error`` never answering: it cannot tell a dead peer."""

    def link_error(self) -> str | None:
        return None


class DeclaredBlindBackend(BlindBackend):
    """The same, declaring it: the kit then reports the link checks without failing the run."""

    conformance_optional = frozenset({"link_error_sender", "link_error_receiver"})
