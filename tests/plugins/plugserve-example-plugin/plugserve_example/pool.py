"""A last-in-first-out request pool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from framework.memory.request_pool import RequestPool


@dataclass
class LifoPoolOptions:
    """Options of the LIFO pool."""

    zero_on_free: bool = False
    """Zero a row's table entries when it is freed (helps debugging stale indices)."""


class LifoRequestPool(RequestPool):
    """Rows handed out most-recently-freed first."""

    def __init__(self, size: int, max_context_len: int, device: str, zero_on_free: bool) -> None:
        self.size = self.num_rows = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._stack = list(range(size - 1, -1, -1))
        self._in_use: set[int] = set()
        self.zero_on_free = zero_on_free

    @classmethod
    def create(cls, size: int, max_context_len: int, device: str, options: LifoPoolOptions | None = None):
        options = options or LifoPoolOptions()
        return cls(size, max_context_len, device, options.zero_on_free)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._stack):
            return None
        rows = [self._stack.pop() for _ in range(n)]
        self._in_use.update(rows)
        return rows

    def free(self, slots: int | Iterable[int]) -> None:
        rows = [slots] if isinstance(slots, int) else list(slots)
        if len(set(rows)) != len(rows):  # else the row went onto the stack twice: handed out twice
            raise ValueError(f"rows {rows} free the same row twice")
        for row in rows:
            if row not in self._in_use:
                raise ValueError(f"row {row} is not in use")
        for row in rows:
            self._in_use.discard(row)
            if self.zero_on_free:
                self.req_to_token[row].zero_()
            self._stack.append(row)

    def available_size(self) -> int:
        return len(self._stack)

    def clear(self) -> None:
        self._stack = list(range(self.size - 1, -1, -1))
        self._in_use.clear()
