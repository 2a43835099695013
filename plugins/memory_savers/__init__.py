"""Built-in memory savers: ``cpu`` (storage-level release on CPU), ``torch_memory_saver`` (CUDA
virtual memory, GPU only) and ``none``."""

from __future__ import annotations

from framework.hookspecs import Capabilities, Register, hookimpl
from framework.memory.memory_saver import NoMemorySaver
from plugins.memory_savers import cpu, torch_memory_saver


def _none(options: None) -> NoMemorySaver:
    return NoMemorySaver()


@hookimpl
def register_memory_savers(register: Register) -> None:
    register("cpu", cpu.create, config=cpu.CpuMemorySaverOptions,
             capabilities=Capabilities(devices=("cpu",), auto_priority={"cpu": 10}))
    register("torch_memory_saver", torch_memory_saver.create, config=torch_memory_saver.TorchMemorySaverOptions,
             capabilities=Capabilities(devices=("cuda",), auto_priority={"cuda": 10},
                                       unavailable_reason=torch_memory_saver.unavailable_reason))
    register("none", _none, capabilities=Capabilities(auto_priority={"cpu": 0, "cuda": 0}))
