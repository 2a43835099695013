"""Token bitmasks of constrained decoding applied to a batch's logits.

The bitmask is int32 ``[batch, ceil(vocab / 32)]`` (bit ``j`` of word ``w``: token ``32 w + j``
allowed; see :mod:`framework.grammar.base`). Rows without a constraint are all ones. The sampler
applies it after penalties and before temperature and the filters, so greedy rows take the argmax
of the allowed tokens and sampled rows draw only among them.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def full_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask that allows every token in every row (-1 is all 32 bits set)."""
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, vocab] bool: which tokens each row allows."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``scores`` with every disallowed token at -inf (a new tensor; ``scores`` is untouched)."""
    allowed = allowed_tokens(bitmask.to(scores.device, non_blocking=True), scores.shape[-1])
    return scores.masked_fill(~allowed, float("-inf"))
