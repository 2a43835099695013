"""OpenAI's ``logit_bias``: a per-request additive bias on chosen token ids, applied batch-wide.

A request maps token ids to a bias in [-100, 100] (OpenAI's range) that is added to the raw
logits before every other sampling step (penalties, temperature, top-k/p, min-p), as vLLM does.
Applying it before the penalties keeps the min_new_tokens mask authoritative: a biased EOS stays
at -inf until the request may stop. Logprobs stay those of the raw logits (see the sampler).

+100 makes a token all but certain and -100 all but bans it, as OpenAI documents: a bias is an
addition, not a hard constraint, so a model whose logits span more than 100 can still escape it.

The batch's biases are kept sparse, as ``(row, column, value)`` triples: a request biases a
handful of tokens, and a dense ``[batch, vocab]`` bias would cost a vocabulary-sized row per
request on every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0
"""OpenAI's allowed range for one token's bias."""


def normalize_logit_bias(value: Any) -> dict[int, float] | None:
    """Token id -> bias with integer keys (clients send the ids as JSON object keys: strings).

    Raises ``ValueError`` naming ``logit_bias`` for a key that is not an integer token id or a
    value that is not a number; ranges are checked by :func:`check_logit_bias`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        text = key.strip() if isinstance(key, str) else str(key)
        if not text.lstrip("-").isdigit() or len(text) > 20:
            raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {key!r}")
        out[int(text)] = float(bias)
    return out or None


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int | None) -> None:
    """``ValueError`` naming ``logit_bias``, the token and the allowed range, for the first bad entry."""
    for token, value in (bias or {}).items():
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            upper = vocab_size if vocab_size is not None else "inf"
            raise ValueError(f"logit_bias token id {token} is out of range [0, {upper})")
        if not math.isfinite(value) or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias for token {token} must be in [{LOGIT_BIAS_MIN:g}, "
                             f"{LOGIT_BIAS_MAX:g}], got {value!r}")


@dataclass(eq=False)  # tensors inside: identity, not elementwise ==
class BatchLogitBias:
    """The biases of one batch as sparse ``(row, column, value)`` triples on the device."""

    rows: torch.Tensor
    """[nnz] int64 batch rows."""
    cols: torch.Tensor
    """[nnz] int64 token ids."""
    values: torch.Tensor
    """[nnz] float32 biases."""

    @classmethod
    def build(cls, biases: list[dict[int, float] | None], device: torch.device) -> BatchLogitBias | None:
        """The batch's biases (one entry per row, None for rows without); None when no row has one."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for row, bias in enumerate(biases):
            for token, value in (bias or {}).items():
                rows.append(row)
                cols.append(token)
                values.append(value)
        if not rows:
            return None
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            cols=torch.tensor(cols, dtype=torch.int64, device=device),
            values=torch.tensor(values, dtype=torch.float32, device=device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` plus the biases, as a new tensor (``logits`` itself is left unmodified)."""
        # Keys are unique within a row, so accumulate only matters for correctness if they were
        # not; it also makes the op well defined under duplicate indices.
        return logits.index_put((self.rows, self.cols), self.values.to(logits.dtype), accumulate=True)


def apply_logit_bias(logits: torch.Tensor, bias: BatchLogitBias | None) -> torch.Tensor:
    """``logits`` unchanged when no row of the batch has a bias, else the biased copy."""
    return logits if bias is None else bias.apply(logits)
