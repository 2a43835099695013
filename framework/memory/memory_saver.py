"""Memory savers: release the memory of tagged tensors and bring it back, without a restart.

RL frameworks use the serving engine for rollouts and then need its memory for training: the
engine releases its weights and KV cache, the trainer runs, the engine resumes (and receives new
weights). A saver is a plugin (``register_memory_savers``), chosen by ``memory_saver.name``.

Tags name what is released together, as in SGLang: ``weights``, ``kv_cache`` and ``cuda_graph``.
The model runner allocates each kind inside ``saver.region(tag)`` (a saver that hooks the
allocator, like torch-memory-saver on CUDA, tags the allocations there) and then hands the tensors
to ``saver.track(tag, tensors, keep_contents)`` (a saver that works on tensors, like the CPU one,
remembers them there). ``keep_contents`` is True for weights (they must come back as they were)
and False for the KV cache (its contents are stale after a release; the prefix cache is flushed).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
"""Every tag a release or resume may name; an empty or missing ``tags`` list means all of them."""


class MemorySaver:
    """Releases and restores the memory of tagged tensors (see the module docstring).

    Subclasses implement :meth:`pause` and :meth:`resume`; :meth:`region` and :meth:`track` are
    no-ops unless the saver needs them. ``preserves_addresses`` tells the core whether tensors keep
    their addresses across a release: CUDA graphs and registered KV transfer buffers need that.
    """

    name: str = "?"
    releases_memory: bool = True
    """False for the ``none`` saver: a release request is then refused with the reason."""
    preserves_addresses: bool = False

    def region(self, tag: str) -> contextlib.AbstractContextManager[None]:
        """Context in which allocations belong to ``tag`` (allocator-hooking savers)."""
        return contextlib.nullcontext()

    def track(self, tag: str, tensors: Iterable[torch.Tensor], keep_contents: bool) -> None:
        """Tensors that make up ``tag``; replaces what was tracked under it before (weights are
        re-tracked after an update repacks them)."""

    def pause(self, tag: str) -> None:
        """Release the memory of ``tag`` (idempotent: pausing a paused tag does nothing)."""
        raise NotImplementedError

    def resume(self, tag: str) -> None:
        """Bring ``tag`` back: same tensors, same shapes, contents restored if kept."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop backups and files (the process is ending)."""


class NoMemorySaver(MemorySaver):
    """``memory_saver.name: none``: memory is never released (release requests get a 400)."""

    name = "none"
    releases_memory = False

    def pause(self, tag: str) -> None:
        raise RuntimeError("memory_saver.name is 'none': this server cannot release memory")

    def resume(self, tag: str) -> None:
        raise RuntimeError("memory_saver.name is 'none': this server cannot release memory")


def unique_storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """One tensor per distinct storage (tied weights and views share one), dense tensors only."""
    seen: set[int] = set()
    for t in tensors:
        if t is None or t.layout != torch.strided or t.is_meta:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        yield t


def available_memory_bytes() -> int:
    """Memory the host can still give this process: ``MemAvailable`` from ``/proc/meminfo`` (free
    plus reclaimable caches), else the physical memory (off Linux, as a best guess)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
