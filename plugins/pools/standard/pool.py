"""The standard request pool: ``size`` rows, one per running request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from framework.memory.request_pool import FreeRowList, RequestPool


@dataclass
class StandardPoolOptions:
    """Options of the standard pool."""

    extra_rows: int = 0
    """Rows beyond the running cap (e.g. for requests parked between chunked-prefill steps)."""


class StandardRequestPool(RequestPool):
    """A ``req_to_token`` table of ``size + extra_rows`` rows with O(1) alloc and free."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device, extra_rows: int = 0
    ) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        if extra_rows < 0:
            raise ValueError(f"extra_rows must be >= 0, got {extra_rows}")
        self.size = size
        self.num_rows = size + extra_rows
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (self.num_rows, max_context_len), dtype=torch.int32, device=self.device
        )
        self._rows = FreeRowList(self.num_rows)

    @classmethod
    def create(
        cls,
        size: int,
        max_context_len: int,
        device: str | torch.device,
        options: StandardPoolOptions | None = None,
    ) -> StandardRequestPool:
        options = options or StandardPoolOptions()
        return cls(size, max_context_len, device, extra_rows=options.extra_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        return self._rows.take(n)

    def free(self, slots: int | Iterable[int]) -> None:
        self._rows.give_back(slots)

    def available_size(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        self._rows.reset()
