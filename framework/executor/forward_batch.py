"""ForwardBatch: everything one model forward needs, as device tensors plus a few CPU copies.

The scheduler builds a :class:`ForwardBatch` from the requests it scheduled
(``framework.scheduler.batch_builder``); the model runner hands it to the model, and the model
hands it to the attention backend through every attention layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from framework.attention.base import AttentionBackend
    from framework.memory.kv_cache import KVCache
    from framework.multimodal.inputs import MultimodalInputs


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
    """[num_tokens] int64 absolute position of each new token; ``[3, num_tokens]`` (temporal,
    height, width) for a model with ``uses_mrope`` (see :mod:`framework.multimodal.mrope`)."""
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
    """EXTEND only: tokens already in the cache before this step (cached prefix, earlier chunks),
    per request. Give it or ``extend_seq_lens_cpu``: the other is derived once, here."""
    extend_seq_lens_cpu: list[int] | None = None
    """EXTEND only: new tokens this step, per request."""
    logits_indices: torch.Tensor | None = None
    """Rows of the hidden states whose logits are needed (default: the last token per request)."""
    attn_metadata: Any = None
    """Whatever the attention backend computed in ``init_forward_metadata`` for this batch."""
    mm_inputs: list[MultimodalInputs | None] | None = None
    """Per request (batch order): its images, or None; None altogether when no request has any.
    The model encodes the images whose spans overlap this step's tokens."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.mode.is_extend():
            return
        seq = [int(n) for n in self.seq_lens_cpu]
        if self.extend_seq_lens_cpu is None and self.extend_prefix_lens_cpu is None:
            raise ValueError("an EXTEND batch needs extend_prefix_lens_cpu or extend_seq_lens_cpu")
        if self.extend_seq_lens_cpu is None:
            self.extend_seq_lens_cpu = [s - int(p) for s, p in zip(seq, self.extend_prefix_lens_cpu, strict=True)]
        elif self.extend_prefix_lens_cpu is None:
            self.extend_prefix_lens_cpu = [s - int(n) for s, n in zip(seq, self.extend_seq_lens_cpu, strict=True)]

    def extend_lengths(self) -> tuple[list[int], list[int]]:
        """``(prefix_lens, q_lens)`` of an EXTEND batch: the tokens each request already has in
        the cache and its new tokens in this batch (what every attention backend reads)."""
        assert self.extend_prefix_lens_cpu is not None and self.extend_seq_lens_cpu is not None, "not an EXTEND batch"
        return self.extend_prefix_lens_cpu, self.extend_seq_lens_cpu

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
