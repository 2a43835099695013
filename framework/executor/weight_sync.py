"""A torch.distributed group between a trainer and the serving engine, for pushing weights.

SGLang's ``/init_weights_update_group`` creates a process group that is not the default one (the
engine's own ranks may use that), joined by the trainer (rank 0) and the engine (``rank_offset``
and up). Here both sides call :func:`new_weight_update_group` with the same address, port, world
size and group name: rank 0 hosts the rendezvous store, the others connect to it, and the group is
a standalone gloo (CPU) or NCCL (GPU) process group. The trainer then calls
:func:`broadcast_weights` while the engine's ``/update_weights_from_distributed`` receives the same
tensors in the same order.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

#: dtype names a weight update may declare (SGLang's and torch's spellings).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> the dtype; ValueError naming the allowed ones."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[key]


class WeightUpdateGroup:
    """A standalone process group for weight broadcasts (see the module docstring). Rank 0 hosts
    the rendezvous store; construction blocks until every rank has joined or ``timeout_s`` passes."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 600.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: allowed values are gloo (CPU) and nccl (GPU)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.name, self.rank, self.world_size, self.backend = group_name, rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        # Kept: the store must outlive the group's rendezvous.
        self.store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                   timeout=timeout)
        # Prefixed, so several groups (or a retry under a new name) can share one store safely.
        prefixed = dist.PrefixStore(group_name, self.store)
        if backend == "gloo":
            self.group: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)

    def broadcast(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor from ``src``, in order: the sender passes its tensors, the
        receivers empty ones of the announced shapes and dtypes."""
        for tensor in tensors:
            self.group.broadcast(tensor, src).wait()

    def close(self) -> None:
        """Drop the group (and with it the store connection)."""
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.group = None
