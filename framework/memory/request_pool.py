"""The request pool interface: the first level of KV memory, a plugin kind ("memory pool").

A request pool owns the ``req_to_token`` table: row ``slot`` belongs to one running request and
``req_to_token[slot, pos]`` is the KV slot (see ``framework.memory.kv_cache``) of that request's
token at position ``pos``. Attention backends read the table; the scheduler writes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable

import torch


class RequestPool(ABC):
    """Hands out rows of ``req_to_token`` to requests.

    ``size`` is the running-request cap; ``num_rows`` may be larger (the decode pool keeps extra
    rows for requests whose KV is still in flight).
    """

    size: int
    num_rows: int
    max_context_len: int
    req_to_token: torch.Tensor

    @abstractmethod
    def alloc(self, n: int = 1) -> list[int] | None:
        """Take ``n`` free rows; ``None`` (and nothing taken) if fewer are free."""

    @abstractmethod
    def free(self, slots: int | Iterable[int]) -> None:
        """Return rows to the pool. Freeing a row that is not in use raises ValueError."""

    @abstractmethod
    def available_size(self) -> int:
        """How many rows ``alloc`` can hand out now."""

    def write(self, index: int | torch.Tensor | tuple, values: torch.Tensor | int) -> None:
        """``req_to_token[index] = values`` (index as for tensor indexing, e.g. ``(slot, slice)``)."""
        self.req_to_token[index] = values

    def in_use(self) -> int:
        """Rows currently handed out."""
        return self.num_rows - self.available_size()


class TableRequestPool(RequestPool):
    """A ``req_to_token`` table of ``num_rows`` rows with O(1) alloc/free: the built-in pools'
    shared body (they differ only in how many rows they hold and what else they track)."""

    def __init__(self, size: int, num_rows: int, max_context_len: int, device: str | torch.device) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((num_rows, max_context_len), dtype=torch.int32, device=self.device)
        self._rows = FreeRowList(num_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        return self._rows.take(n)

    def free(self, slots: int | Iterable[int]) -> None:
        self._rows.give_back(slots)

    def available_size(self) -> int:
        return len(self._rows)


class PreallocatingRequestPool(RequestPool):
    """A pool that also hands out rows to requests that are not running yet (PD decode: their
    KV is still in flight), while at most ``size`` rows *run* at once. Register such a pool with
    ``Capabilities(preallocation=True)``: a PD decode server requires it at config resolution."""

    @abstractmethod
    def activate(self, row: int) -> bool:
        """Mark a reserved row as running; False if ``size`` rows already run."""

    @abstractmethod
    def deactivate(self, row: int) -> None:
        """The row's request stopped running (it keeps the row until freed)."""

    @abstractmethod
    def running_count(self) -> int:
        """Rows running now (at most ``size``)."""


class FreeRowList:
    """O(1) free-row bookkeeping shared by the built-in pools: a deque plus an in-use bitmap."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: deque[int] = deque(range(num_rows))
        self._used = bytearray(num_rows)

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of rows ({n})")
        if n > len(self._free):
            return None
        rows = [self._free.popleft() for _ in range(n)]
        for row in rows:
            self._used[row] = 1
        return rows

    def give_back(self, rows: int | Iterable[int]) -> None:
        rows = [rows] if isinstance(rows, int) else list(rows)
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} free the same row twice (double free?)")
        for row in rows:
            if not 0 <= row < self.num_rows:
                raise ValueError(f"row {row} is outside the pool (0..{self.num_rows - 1})")
            if not self._used[row]:
                raise ValueError(f"row {row} is not in use (double free?)")
        for row in rows:
            self._used[row] = 0
            self._free.append(row)

    def is_used(self, row: int) -> bool:
        """Whether ``row`` is handed out; a row outside the pool is a ValueError (a negative
        index must not wrap around to the last row)."""
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside the pool (0..{self.num_rows - 1})")
        return bool(self._used[row])
