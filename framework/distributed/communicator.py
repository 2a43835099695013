"""The communicator plugin kind: the collectives the parallel layers call.

A tensor-parallel forward needs three collectives: an all-reduce after each row-parallel layer
(and the vocab-parallel embedding), an all-gather of the vocab-parallel logits, and a broadcast of
the scheduler's inputs from rank 0 to the others (bytes, on a CPU group). The built-in
``torch_distributed`` communicator runs them on torch.distributed process groups (gloo on CPU,
NCCL on GPU). A GPU build can register its own (``register_communicators``), e.g. a custom
all-reduce over NVLink for small tensors, and select it with ``parallel.communicator``: the layers
only ever call this interface.
"""

from __future__ import annotations

import torch


class CollectiveStats:
    """Calls and seconds spent per collective in this process (what ``bench tp`` reports)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def snapshot(self) -> dict[str, tuple[int, float]]:
        return {name: (self.calls[name], self.seconds[name]) for name in self.calls}


class Communicator:
    """Collectives over the ranks of one tensor-parallel group (see the module docstring)."""

    rank: int = 0
    size: int = 1
    stats: CollectiveStats | None = None
    """Per-collective counters, for implementations that keep them (the built-in one does)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src`` passes ``data``; every rank gets it back (the others pass None)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank got here."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop the process groups."""


class SingleRank(Communicator):
    """The communicator of a model that is not split (tp_size 1): every collective is the identity."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return data or b""

    def barrier(self) -> None:
        return None
