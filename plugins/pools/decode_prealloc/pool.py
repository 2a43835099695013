"""The decode-side pre-allocating request pool of prefill/decode disaggregation.

A decode server must reserve a request row (and KV pages) for every request whose KV is still
being transferred from a prefill server. Those requests are not running yet, so the pool holds
``size + pre_alloc_size`` rows: any row can be reserved, but at most ``size`` rows are *running*
(``activate``) at once, so the running batch stays capped at ``size`` (SGLang PR 6980's
DecodeReqToTokenPool, with the pre-allocation size a config field instead of a hard-coded rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from framework.memory.request_pool import PreallocatingRequestPool, TableRequestPool


@dataclass
class DecodePreallocOptions:
    """Options of the decode pre-allocating pool."""

    pre_alloc_size: Optional[int] = None
    """Rows beyond the running cap for in-flight requests; takes precedence over the ratio."""
    pre_alloc_ratio: float = 1.0
    """Rows beyond the running cap as a multiple of it (used when pre_alloc_size is null):
    1.0 lets as many requests be in flight as can run, so a full batch's successors are ready."""


def resolve_pre_alloc_size(size: int, options: DecodePreallocOptions) -> int:
    """How many extra rows the options ask for, given the running cap ``size``."""
    if options.pre_alloc_size is not None:
        if options.pre_alloc_size < 0:
            raise ValueError(
                f"memory_pool.options.pre_alloc_size must be >= 0, got {options.pre_alloc_size}"
            )
        return options.pre_alloc_size
    if options.pre_alloc_ratio < 0:
        raise ValueError(
            f"memory_pool.options.pre_alloc_ratio must be >= 0, got {options.pre_alloc_ratio}"
        )
    return int(size * options.pre_alloc_ratio)


class DecodePreallocRequestPool(TableRequestPool, PreallocatingRequestPool):
    """``size`` running rows plus ``pre_alloc_size`` rows for requests whose KV is in flight."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device, pre_alloc_size: int
    ) -> None:
        if pre_alloc_size < 0:
            raise ValueError(f"pre_alloc_size must be >= 0, got {pre_alloc_size}")
        super().__init__(size, size + pre_alloc_size, max_context_len, device)
        self.pre_alloc_size = pre_alloc_size
        self._running: set[int] = set()

    @classmethod
    def create(
        cls,
        size: int,
        max_context_len: int,
        device: str | torch.device,
        options: DecodePreallocOptions | None = None,
    ) -> DecodePreallocRequestPool:
        options = options or DecodePreallocOptions()
        return cls(size, max_context_len, device, resolve_pre_alloc_size(size, options))

    def free(self, slots: int | Iterable[int]) -> None:
        rows = [slots] if isinstance(slots, int) else list(slots)
        super().free(rows)
        self._running.difference_update(rows)

    # -- the running cap ------------------------------------------------------------------

    def running_count(self) -> int:
        return len(self._running)

    def running_capacity_left(self) -> int:
        return self.size - len(self._running)

    def activate(self, slot: int) -> bool:
        """Mark a reserved row as running; ``False`` if ``size`` rows already run."""
        if not self._rows.is_used(slot):
            raise ValueError(f"row {slot} is not reserved")
        if slot in self._running:
            return True
        if len(self._running) >= self.size:
            return False
        self._running.add(slot)
        return True

    def deactivate(self, slot: int) -> None:
        """The request in this row stopped running (it keeps its reservation until freed)."""
        self._running.discard(slot)

    def is_running(self, slot: int) -> bool:
        return slot in self._running
