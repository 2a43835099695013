"""The attention backend interface.

Models never compute attention themselves: each attention layer (:class:`Attention`) calls the
backend selected in the config with the layer's q, k and v. The backend stores the new k and v
into the paged KV cache at ``forward_batch.out_cache_loc`` and attends over the request's whole
context, which it finds through ``forward_batch.req_to_token``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


@dataclass
class NativeDecodeAttention:
    """A backend's decode attention as a C function, for a fused decode step that runs every
    layer in one C call (:mod:`framework.models.fused_decode`).

    ``function`` is the address of a ``plugserve_decode_attention_fn``
    (``framework/kernels/decode_abi.h``): ``fn(ctx, layer, q, k, v, out)`` stores layer ``layer``'s
    new K/V (``layer`` indexes the ``layers`` given to :meth:`AttentionBackend.native_decode`) and
    writes its attention output, exactly what :meth:`AttentionBackend.forward_decode` would for
    contiguous ``q``/``k``/``v`` of the model's dtype, returning 0 or a non-zero status. ``context``
    is the address of what ``fn`` reads as ``ctx``; ``keepalive`` holds every object that memory
    belongs to until the step is over."""

    function: int
    context: int
    keepalive: Any = None


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache for one forward batch.

    Lifecycle per forward: ``init_forward_metadata(batch)`` once, then ``forward(...)`` once per
    layer. Backends that declare ``Capabilities(cuda_graph=True)`` when they register also
    implement the ``*_cuda_graph_*`` methods. Devices, ``auto`` priority and an
    ``unavailable_reason`` check are declared in the registration too
    (:class:`framework.registry.Capabilities`), not probed on the class.
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-batch metadata (index tables, masks) shared by all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch to :meth:`forward_extend` or :meth:`forward_decode`.

        ``q``: [num_tokens, num_heads * head_dim]; ``k``, ``v``: [num_tokens, num_kv_heads *
        head_dim]. Returns [num_tokens, num_heads * head_dim].
        """
        if forward_batch.mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @staticmethod
    def store_and_get_kv(
        k: torch.Tensor, v: torch.Tensor, layer: Attention, forward_batch: ForwardBatch, save_kv_cache: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V at ``out_cache_loc`` (unless ``save_kv_cache`` is False) and
        return the layer's whole K and V buffers ``[slots, kv_heads, head_dim]``: the first thing a
        backend that reads the cache with torch ops does in every forward."""
        cache = forward_batch.kv_cache
        if save_kv_cache:
            cache.store(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return cache.get_kv(layer.layer_id)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """New tokens attend to the cached prefix and causally to each other."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """One new token per request attends to its whole context."""

    def native_decode(self, forward_batch: ForwardBatch, layers: Sequence[Attention],
                      dtype: torch.dtype) -> NativeDecodeAttention | None:
        """This decode batch's attention over ``layers`` (in order) as a C function, or None (the
        default) when the backend has none or cannot take this batch: the model then calls
        :meth:`forward` per layer as usual. Called after :meth:`init_forward_metadata`, once per
        step, only for decode batches on CPU whose q, k, v are contiguous ``dtype`` rows. A
        backend that returns one must store K/V and attend exactly as :meth:`forward_decode`
        does, bit for bit: the fused step is an optimisation, never a different result."""
        return None

    # --- CUDA-graph hooks ---------------------------------------------------------------------
    # Used by framework.executor.cuda_graph_runner, only for a backend registered with
    # ``Capabilities(cuda_graph=True)``. The runner captures one graph per decode batch-size
    # bucket; a captured graph re-launches the same kernels on the same memory, so everything a
    # decode forward reads (index tables, lengths) must live in buffers allocated once here and
    # refreshed *in place* before each replay, and the decode path must make no host syncs or
    # data-dependent shapes while it is being captured.

    def init_cuda_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        """Allocate the static buffers captured graphs read their metadata from.

        Called once, before any capture. ``max_batch_size`` is the largest captured bucket and
        ``max_context_len`` the width of ``req_to_token`` (no request is longer). The default
        refuses: a backend that does not override the hooks does not support CUDA graphs.
        """
        raise NotImplementedError(self._no_cuda_graph_message())

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Set ``forward_batch.attn_metadata`` for capturing bucket ``forward_batch.batch_size``.

        ``forward_batch`` is the runner's static batch of that bucket: its tensors are the static
        input buffers (padding values at capture time), and the same object is passed to
        :meth:`init_forward_metadata_replay_cuda_graph` for every replay of the bucket. The
        metadata must point into the buffers of :meth:`init_cuda_graph_state`. The runner then
        runs the forward eagerly a few times (warm-up: lazy planning, kernel compilation) and
        once under capture.
        """
        raise NotImplementedError(self._no_cuda_graph_message())

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, real_batch_size: int) -> None:
        """Refresh the static metadata buffers in place before a replay (eagerly, outside the graph).

        ``forward_batch`` is the static batch of the bucket, already holding the real batch's
        ``real_batch_size`` rows followed by padding rows (request row 0, sequence length
        :meth:`get_cuda_graph_seq_len_fill_value`, KV slot 0 = the padding page);
        ``forward_batch.seq_lens_cpu`` holds the padded lengths too.
        """
        raise NotImplementedError(self._no_cuda_graph_message())

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length given to padding rows. 1 (one token, the padding slot) suits backends
        that divide by or index with the length; a backend that can attend to nothing may use 0."""
        return 1

    def can_replay_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether this decode batch (already known to fit a bucket) may replay a graph, or must
        run eagerly. Default True; a backend whose graph buffers bound the context says no for
        longer batches."""
        return True

    def _no_cuda_graph_message(self) -> str:
        return (
            f"attention backend {type(self).__name__} does not support CUDA graphs; "
            "set cuda_graph.enabled=false or choose a backend that supports them"
        )


class Attention(nn.Module):
    """The attention layer models use: holds the layer's shape and forwards to the backend."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
