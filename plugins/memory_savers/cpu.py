"""The ``cpu`` memory saver: frees tensors' storage so the process's resident memory really drops.

A release resizes each tracked storage to zero bytes (the tensors, their views and every module
that holds them stay valid objects) and asks glibc to hand freed heap pages back to the OS
(``malloc_trim``: small tensors live in the heap, not in their own mappings). Contents that must
survive (weights) are first written to an unlinked temporary file, so they leave RAM too, and are
read back on resume. Addresses change on resume: that is why a PD server refuses releases.
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

import torch

from framework.memory.heap import trim_heap
from framework.memory.memory_saver import MemorySaver, unique_storages

logger = logging.getLogger(__name__)


@dataclass
class CpuMemorySaverOptions:
    """Options of the ``cpu`` memory saver."""

    backup_dir: str | None = None
    """Where released weights are kept until resume (a file, deleted on creation so it never
    outlives the process); null: the system temporary directory. Use a disk, not tmpfs: a tmpfs
    file is RAM again."""


def _raw(t: torch.Tensor) -> ctypes.Array:
    """The whole storage of ``t`` as a ctypes buffer (file I/O without a copy). Not through numpy:
    torch marks a storage that numpy has seen as not resizable."""
    storage = t.untyped_storage()
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


class _Tag:
    def __init__(self, tensors: list[torch.Tensor], keep_contents: bool) -> None:
        self.tensors = tensors
        self.sizes = [t.untyped_storage().nbytes() for t in tensors]
        self.keep_contents = keep_contents
        self.paused = False
        self.backup: IO[bytes] | None = None


class CpuMemorySaver(MemorySaver):
    """Storage-level release for CPU tensors (see the module docstring)."""

    name = "cpu"
    preserves_addresses = False

    def __init__(self, options: CpuMemorySaverOptions | None = None) -> None:
        self.options = options or CpuMemorySaverOptions()
        self._tags: dict[str, _Tag] = {}

    def track(self, tag: str, tensors: Iterable[torch.Tensor], keep_contents: bool) -> None:
        old = self._tags.get(tag)
        if old is not None and old.paused:
            raise RuntimeError(f"memory tag {tag!r} is released; resume it before tracking new tensors")
        dense = [t for t in unique_storages(tensors) if t.device.type == "cpu"]
        self._tags[tag] = _Tag(dense, keep_contents)

    def tracked_bytes(self, tag: str) -> int:
        """Bytes a release of ``tag`` frees (0 if nothing is tracked under it)."""
        entry = self._tags.get(tag)
        return sum(entry.sizes) if entry else 0

    def is_paused(self, tag: str) -> bool:
        entry = self._tags.get(tag)
        return bool(entry and entry.paused)

    def pause(self, tag: str) -> None:
        entry = self._tags.get(tag)
        if entry is None or entry.paused:
            return
        if entry.keep_contents:
            # Unlinked at once: the data lives as long as the handle, never as a stray file.
            entry.backup = tempfile.TemporaryFile(dir=self.options.backup_dir)
            for t in entry.tensors:
                entry.backup.write(_raw(t))
            entry.backup.flush()
        for t in entry.tensors:
            t.untyped_storage().resize_(0)
        entry.paused = True
        trim_heap()
        logger.info("memory saver: released %s (%.1f MiB)", tag, sum(entry.sizes) / 2**20)

    def resume(self, tag: str) -> None:
        entry = self._tags.get(tag)
        if entry is None or not entry.paused:
            return
        if entry.backup is not None:
            entry.backup.seek(0)
        for t, size in zip(entry.tensors, entry.sizes, strict=True):
            storage = t.untyped_storage()
            storage.resize_(size)
            if entry.backup is not None:
                read = entry.backup.readinto(_raw(t))
                if read != size:
                    raise RuntimeError(f"memory saver: the backup of {tag!r} is short ({read} of {size} bytes)")
            else:
                storage.fill_(0)  # so stale-looking garbage can never be read as KV
        if entry.backup is not None:
            entry.backup.close()
            entry.backup = None
        entry.paused = False
        logger.info("memory saver: resumed %s", tag)

    def close(self) -> None:
        for entry in self._tags.values():
            if entry.backup is not None:
                entry.backup.close()
                entry.backup = None


def create(options: CpuMemorySaverOptions | None) -> CpuMemorySaver:
    """Factory registered as ``cpu``."""
    return CpuMemorySaver(options)


