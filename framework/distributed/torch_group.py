"""A tensor-parallel group on torch.distributed process groups, without the global default group.

Each rank joins a TCP store at ``addr:port`` (rank 0 hosts it) and builds two standalone process
groups: the device group (gloo on CPU, NCCL on GPU) for activations, and a gloo group for the
scheduler's bytes (NCCL cannot carry host objects). Standalone groups leave
``torch.distributed``'s default group alone, so an in-process Engine with tp_size > 1 can live in a
trainer that has its own.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from framework.distributed.communicator import CollectiveStats, Communicator


class TorchGroupCommunicator(Communicator):
    """The built-in ``torch_distributed`` communicator."""

    def __init__(self, addr: str, port: int, rank: int, size: int, device: torch.device,
                 timeout_s: float, name: str = "tp") -> None:
        self.rank, self.size, self.device = rank, size, device
        self.stats = CollectiveStats()
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, int(port), size, is_master=rank == 0, timeout=timeout)
        cpu_store = dist.PrefixStore(f"{name}/cpu", self.store)
        self.cpu_group: Any = dist.ProcessGroupGloo(cpu_store, rank, size, timeout)
        if device.type == "cuda":
            self.device_group: Any = dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}/dev", self.store), rank, size)
        else:
            self.device_group = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/dev", self.store), rank, size,
                                                      timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.device_group.allreduce([tensor]).wait()
        self.stats.add("all_reduce", time.perf_counter() - start)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        start = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.device_group.allgather([parts], [tensor]).wait()
        self.stats.add("all_gather", time.perf_counter() - start)
        return torch.cat(parts, dim=dim)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        start = time.perf_counter()
        out = self._broadcast_bytes(data, src)
        self.stats.add("broadcast_bytes", time.perf_counter() - start)
        return out

    def _broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        length = torch.tensor([len(data) if self.rank == src and data is not None else 0], dtype=torch.int64)
        self.cpu_group.broadcast(length, src).wait()
        n = int(length.item())
        if n == 0:
            return b""
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data or b""), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        self.cpu_group.broadcast(buf, src).wait()
        return data if self.rank == src and data is not None else bytes(buf.numpy())

    def barrier(self) -> None:
        self.cpu_group.broadcast(torch.zeros(1), 0).wait()

    def close(self) -> None:
        for group in (self.device_group, self.cpu_group):
            shutdown = getattr(group, "shutdown", None)
            if callable(shutdown):
                shutdown()
