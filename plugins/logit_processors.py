"""Built-in logit processors that a request can name in ``custom_logit_processor``.

``disallowed_tokens``: ``custom_params: {"token_ids": [...]}`` sets those tokens' logits to -inf,
so the request never generates them (a hard ban, unlike ``logit_bias`` -100).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from framework.hookspecs import hookimpl


@dataclass
class DisallowedTokensParams:
    """``custom_params`` of ``disallowed_tokens``."""

    token_ids: list[int] = field(default_factory=list)
    """Token ids the request must never generate (ids outside the vocabulary ban nothing)."""

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.token_ids):
            raise ValueError(f"token_ids must be a list of non-negative integers, got {self.token_ids!r}")


class DisallowedTokens:
    """Sets the logits of each row's ``token_ids`` to -inf (one scatter for the whole group)."""

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any] | None],
                 output_ids: list[list[int]]) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows: list[int] = []
        cols: list[int] = []
        for row, p in enumerate(params):
            banned = {t for t in (p or {}).get("token_ids", []) if t < vocab}
            rows += [row] * len(banned)
            cols += sorted(banned)
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        return logits


def disallowed_tokens() -> DisallowedTokens:
    """The ``disallowed_tokens`` processor."""
    return DisallowedTokens()


@hookimpl
def register_logit_processors(register: Any) -> None:
    register("disallowed_tokens", disallowed_tokens, config=DisallowedTokensParams)
