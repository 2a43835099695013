"""The ``torch_memory_saver`` memory saver: SGLang's CUDA virtual-memory saver, as a plugin.

Tensors allocated inside ``region(tag)`` get CUDA virtual memory whose physical pages
``pause(tag)`` unmaps and ``resume(tag)`` maps again at the same virtual addresses, so pointers
held by CUDA graphs and by registered KV transfer buffers stay valid. Weights use the package's CPU
backup (their contents survive); the KV cache does not (it is stale after a release anyway).
Only a GPU can run this: on CPU the plugin reports itself unavailable.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from framework.memory.memory_saver import MemorySaver


@dataclass
class TorchMemorySaverOptions:
    """Options of the ``torch_memory_saver`` saver."""

    hook_mode: str = "torch"
    """How the package intercepts CUDA allocations: ``torch`` (torch's pluggable allocator, no
    environment needed) or ``preload`` (its LD_PRELOAD shim, which must then be set by the launcher)."""
    cpu_backup_weights: bool = True
    """Keep a pinned host copy of the weights while they are released, so resume restores them
    (turn off when every resume is followed by a full weight update)."""


def unavailable_reason() -> str | None:
    """Why this saver cannot run in this process, or None."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        return "the torch_memory_saver package is not installed (pip install torch_memory_saver)"
    if not torch.cuda.is_available():
        return "torch_memory_saver needs a CUDA device"
    return None


class TorchMemorySaverAdapter(MemorySaver):
    """Adapts the ``torch_memory_saver`` package to :class:`MemorySaver`."""

    name = "torch_memory_saver"
    preserves_addresses = True

    def __init__(self, options: TorchMemorySaverOptions | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"memory_saver.name=torch_memory_saver: {reason}")
        import torch_memory_saver

        self.options = options or TorchMemorySaverOptions()
        self._tms: Any = torch_memory_saver.torch_memory_saver
        self._tms.hook_mode = self.options.hook_mode  # must be set before the first region
        self._paused: set[str] = set()

    def region(self, tag: str) -> contextlib.AbstractContextManager[None]:
        backup = tag == "weights" and self.options.cpu_backup_weights
        return self._tms.region(tag=tag, enable_cpu_backup=backup)

    def track(self, tag: str, tensors: Iterable[torch.Tensor], keep_contents: bool) -> None:
        """Nothing to do: the region already tagged the allocations."""

    def pause(self, tag: str) -> None:
        if tag in self._paused:
            return
        torch.cuda.synchronize()  # nothing in flight may still read the pages being unmapped
        self._tms.pause(tag)
        self._paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag not in self._paused:
            return
        self._tms.resume(tag)
        self._paused.discard(tag)


def create(options: TorchMemorySaverOptions | None) -> TorchMemorySaverAdapter:
    """Factory registered as ``torch_memory_saver``."""
    return TorchMemorySaverAdapter(options)
