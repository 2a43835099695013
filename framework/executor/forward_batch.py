"""ForwardBatch: everything one model forward needs, as device tensors plus a few CPU copies.

The scheduler builds a :class:`ForwardBatch` from its ``ScheduleBatch``; the model runner hands it
to the model, and the model hands it to the attention backend through every attention layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from framework.attention.base import AttentionBackend
    from framework.memory.kv_cache import KVCache


class ForwardMode(enum.IntEnum):
    """What kind of forward a batch runs."""

    EXTEND = 1
    """Prefill: new tokens of each request, on top of an optional cached prefix (also a chunk)."""
    DECODE = 2
    """One new token per request, attending to everything cached before it."""

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One forward's inputs.

    Token-level tensors have ``num_tokens`` rows (the requests' new tokens concatenated in batch
    order); request-level tensors have ``batch_size`` rows.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    """[num_tokens] int64 token ids of this step's new tokens."""
    positions: torch.Tensor
    """[num_tokens] int64 absolute position of each new token."""
    req_pool_indices: torch.Tensor
    """[batch_size] int64 row of each request in ``req_to_token``."""
    seq_lens: torch.Tensor
    """[batch_size] int64 length of each request after this step (prefix + new tokens)."""
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor
    """[num_tokens] int64 KV slot that receives each new token's K and V."""
    req_to_token: torch.Tensor
    """The request pool's table: ``req_to_token[row, pos]`` is the KV slot of token ``pos``."""
    kv_cache: KVCache
    attn_backend: AttentionBackend
    extend_prefix_lens_cpu: list[int] | None = None
    """EXTEND only: tokens already in the cache before this step, per request."""
    extend_seq_lens_cpu: list[int] | None = None
    """EXTEND only: new tokens this step, per request."""
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    """EXTEND only: [batch_size] offset of each request's first new token in the token tensors."""
    logits_indices: torch.Tensor | None = None
    """Rows of the hidden states whose logits are needed (default: the last token per request)."""
    attn_metadata: Any = None
    """Whatever the attention backend computed in ``init_forward_metadata`` for this batch."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
