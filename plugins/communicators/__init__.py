"""Built-in communicator ``torch_distributed``: torch.distributed process groups (gloo on CPU, NCCL
on GPU) for the tensor-parallel collectives."""

from __future__ import annotations

from typing import Any

import torch

from framework.distributed.communicator import Communicator
from framework.distributed.torch_group import TorchGroupCommunicator
from framework.hookspecs import Capabilities, Register, hookimpl


def _torch_distributed(addr: str, port: int, rank: int, size: int, device: torch.device, timeout_s: float,
                       options: Any) -> Communicator:
    return TorchGroupCommunicator(addr, port, rank, size, device, timeout_s)


@hookimpl
def register_communicators(register: Register) -> None:
    register("torch_distributed", _torch_distributed,
             capabilities=Capabilities(auto_priority={"cpu": 10, "cuda": 10}))
