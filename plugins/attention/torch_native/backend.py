"""The ``torch_native`` attention backend: paged-KV attention with plain PyTorch SDPA.

It runs anywhere PyTorch runs and is the reference the other backends are tested against: the
attention itself is :class:`framework.attention.paged_sdpa.PagedSDPA` (shared with other
backends' fallback paths); this backend adds CUDA-graph support for its decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.attention.base import Attention, AttentionBackend
from framework.attention.paged_sdpa import DecodeGroup, PagedSDPA, PagedSDPAOptions
from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


@dataclass
class TorchNativeOptions(PagedSDPAOptions):
    """Options of the ``torch_native`` backend (``decode_max_gather_tokens``: see PagedSDPAOptions)."""

    cuda_graph_gather_tokens: int = 1 << 20
    """CUDA graphs only: a captured decode gathers a fixed ``bucket x max_len`` padded buffer (no
    data-dependent shapes in a graph), with ``max_len = this / largest bucket`` (at most the
    longest context). Batches with a longer request run eagerly. The static gather buffers take
    ``2 x this x kv_heads x head_dim`` elements (4 GiB for 8 kv heads of 128 in bf16)."""


class TorchNativeAttnBackend(AttentionBackend):
    """Attention over the paged KV cache with ``torch.nn.functional.scaled_dot_product_attention``.

    Reads, per batch: ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu`` and ``req_to_token``;
    for extend also ``ForwardBatch.extend_lengths()``. Writes new K/V to ``kv_cache`` at
    ``out_cache_loc``.

    CUDA graphs: decode is captured as one group of fixed width ``graph_max_len`` (see
    ``cuda_graph_gather_tokens``) whose slot table and mask are refreshed in place before a replay;
    the eager path's grouping by actual lengths is data-dependent and cannot be captured.
    """


    def __init__(self, runner: Any, options: TorchNativeOptions | None = None) -> None:
        # Of the runner only the device is needed: the cache and the request table come with each
        # ForwardBatch, so one backend object serves any cache the runner hands it.
        self.device = torch.device(runner.device)
        self.options = options or TorchNativeOptions()
        self.sdpa = PagedSDPA(self.device, self.options)
        # CUDA-graph state (init_cuda_graph_state): fixed-shape slot table, mask and gather buffers.
        self._graph_max_len = 0
        self._graph_slots: torch.Tensor | None = None
        self._graph_valid: torch.Tensor | None = None
        self._graph_positions: torch.Tensor | None = None
        self._graph_gather_k: torch.Tensor | None = None
        self._graph_gather_v: torch.Tensor | None = None

    # --- per-batch metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Compute index tables once per batch; every layer reuses them."""
        if forward_batch.mode.is_decode():
            forward_batch.attn_metadata = self.sdpa.decode_metadata(forward_batch)
        else:
            forward_batch.attn_metadata = self.sdpa.extend_metadata(forward_batch)

    # --- CUDA graphs ---------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        self._graph_max_len = min(max_context_len, self.options.cuda_graph_gather_tokens // max_batch_size)
        if self._graph_max_len < 1:
            raise ConfigError(
                f"attention.options.cuda_graph_gather_tokens: {self.options.cuda_graph_gather_tokens} is "
                f"smaller than the largest CUDA-graph bucket ({max_batch_size}); raise it or lower "
                "cuda_graph.max_batch_size"
            )
        n = max_batch_size * self._graph_max_len
        self._graph_slots = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._graph_valid = torch.zeros(max_batch_size, self._graph_max_len, dtype=torch.bool, device=self.device)
        self._graph_positions = torch.arange(self._graph_max_len, device=self.device)

    def can_replay_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        return max(forward_batch.seq_lens_cpu) <= self._graph_max_len

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs, width = forward_batch.batch_size, self._graph_max_len
        assert self._graph_slots is not None and self._graph_valid is not None, "init_cuda_graph_state first"
        self._refresh_graph_tables(forward_batch)
        forward_batch.attn_metadata = [
            DecodeGroup(0, bs, width, self._graph_slots[: bs * width], self._graph_valid[:bs, None, None, :], True)
        ]

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, real_batch_size: int) -> None:
        self._refresh_graph_tables(forward_batch)

    def _refresh_graph_tables(self, fb: ForwardBatch) -> None:
        """Write the batch's slot table and mask into the static buffers (eager, before a replay)."""
        assert self._graph_slots is not None and self._graph_valid is not None and self._graph_positions is not None
        bs, width = fb.batch_size, self._graph_max_len
        valid = self._graph_positions[None, :] < fb.seq_lens[:, None]
        slots = fb.req_to_token[fb.req_pool_indices, :width].long()
        # Positions past a request's length hold stale table entries: point them at padding slot 0.
        self._graph_slots[: bs * width].copy_(torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1))
        self._graph_valid[:bs].copy_(valid)

    def _graph_gather_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Static gather buffers for captured decode, allocated once at full size (during the
        warm-up, which runs before any capture) so their address never changes."""
        if self._graph_gather_k is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("torch_native: graph gather buffers must be allocated in the warm-up run")
            assert self._graph_slots is not None
            shape = (self._graph_slots.shape[0], *like.shape[1:])
            self._graph_gather_k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._graph_gather_v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self._graph_gather_v is not None
        return self._graph_gather_k[:n], self._graph_gather_v[:n]

    # --- attention ----------------------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        return self.sdpa.extend(q, k, v, k_cache, v_cache, layer, forward_batch.attn_metadata)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_get_kv(k, v, layer, forward_batch, save_kv_cache)
        return self.sdpa.decode(q, k_cache, v_cache, layer, forward_batch.attn_metadata, self._graph_gather_buffers)
