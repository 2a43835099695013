"""The standard request pool: ``size`` rows, one per running request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.memory.request_pool import TableRequestPool


@dataclass
class StandardPoolOptions:
    """Options of the standard pool."""

    extra_rows: int = 0
    """Rows beyond the running cap (e.g. for requests parked between chunked-prefill steps)."""


class StandardRequestPool(TableRequestPool):
    """A ``req_to_token`` table of ``size + extra_rows`` rows with O(1) alloc and free."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device, extra_rows: int = 0
    ) -> None:
        if extra_rows < 0:
            raise ValueError(f"extra_rows must be >= 0, got {extra_rows}")
        super().__init__(size, size + extra_rows, max_context_len, device)

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
