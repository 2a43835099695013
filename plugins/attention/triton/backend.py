"""The ``triton`` attention backend: plugserve's own Triton kernels over the paged KV cache.

On a GPU the kernels are compiled; on CPU they only run under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check them on machines without a GPU. It is very
slow and meant for tests, so the backend refuses a CPU device unless the interpreter is on.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.attention.base import Attention, AttentionBackend
from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


@dataclass
class TritonOptions:
    """Options of the ``triton`` backend (tile sizes of the attention kernel)."""

    block_rows: int = 32
    """Query rows per program: ``block_rows // group`` queries times the ``group`` query heads that
    share a KV head. A power of two, at least 16 (``tl.dot``) and at least the GQA group size."""
    block_kv: int = 64
    """Keys per step of the inner loop. A power of two, at least 16."""
    store_block_tokens: int = 16
    """Tokens per program of the KV-store kernel."""


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _load_kernels() -> Any:
    try:
        from plugins.attention.triton import kernels
    except ImportError as exc:
        raise ConfigError(
            f"attention.backend=triton needs the triton package, which is not importable here ({exc}); "
            "install it (pip install 'plugserve[triton]') or choose attention.backend=torch_native"
        ) from None
    return kernels


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@dataclass
class _Meta:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    q_starts: torch.Tensor
    max_q_len: int


class TritonAttnBackend(AttentionBackend):
    """Paged attention with :mod:`plugins.attention.triton.kernels`; fp32, fp16 and bf16; any page
    size; GQA; head dims that are powers of two (64, 128, ...).

    CUDA graphs: the kernels read lengths and request rows from device memory and their grids
    depend only on the batch size (decode: one query per request), so a captured decode needs
    nothing but static length buffers, refreshed in place before a replay.
    """


    def __init__(self, runner: Any, options: TritonOptions | None = None) -> None:
        self.device = torch.device(runner.device)
        self.options = options or TritonOptions()
        if self.device.type == "cpu" and not interpreter_on():
            raise ConfigError(
                "attention.backend=triton needs a GPU; on CPU it runs only under the Triton interpreter "
                "(TRITON_INTERPRET=1, for tests, very slow). Use attention.backend=cpu_paged or torch_native on CPU"
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"attention.backend=triton supports cuda devices, not {self.device.type!r}")
        for name in ("block_rows", "block_kv"):
            value = getattr(self.options, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"attention.options.{name}: {value} must be a power of two >= 16")
        self.kernels = _load_kernels()
        # CUDA-graph state (init_cuda_graph_state): int32 lengths read by the captured kernels.
        self._graph_seq_lens: torch.Tensor | None = None
        self._graph_prefix_lens: torch.Tensor | None = None
        self._graph_q_starts: torch.Tensor | None = None

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run in this process (``None`` if it can), without importing triton."""
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if not torch.cuda.is_available() and not interpreter_on():
            return "no CUDA device (and TRITON_INTERPRET is not set)"
        return None

    # --- per-batch metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb, dev = forward_batch, self.device
        seq_lens = list(fb.seq_lens_cpu)
        if fb.mode.is_decode():
            prefix_lens, q_lens = [s - 1 for s in seq_lens], [1] * len(seq_lens)
        else:
            prefix_lens, q_lens = fb.extend_lengths()
        q_starts = [sum(q_lens[:i]) for i in range(len(q_lens))]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        fb.attn_metadata = _Meta(
            fb.req_pool_indices.to(dev),
            t(seq_lens),
            t(prefix_lens),
            t(q_starts),
            max(q_lens, default=0),
        )

    # --- CUDA graphs ---------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        def buf() -> torch.Tensor:
            return torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)

        self._graph_seq_lens, self._graph_prefix_lens = buf(), buf()
        # Decode: request i's query is row i of q.
        self._graph_q_starts = torch.arange(max_batch_size, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        assert self._graph_seq_lens is not None and self._graph_prefix_lens is not None, "init_cuda_graph_state first"
        assert self._graph_q_starts is not None
        bs = forward_batch.batch_size
        self.init_forward_metadata_replay_cuda_graph(forward_batch, bs)
        forward_batch.attn_metadata = _Meta(
            forward_batch.req_pool_indices,  # the runner's static buffer already
            self._graph_seq_lens[:bs],
            self._graph_prefix_lens[:bs],
            self._graph_q_starts[:bs],
            1,
        )

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, real_batch_size: int) -> None:
        assert self._graph_seq_lens is not None and self._graph_prefix_lens is not None
        bs = forward_batch.batch_size
        self._graph_seq_lens[:bs].copy_(forward_batch.seq_lens)
        torch.sub(self._graph_seq_lens[:bs], 1, out=self._graph_prefix_lens[:bs])

    # --- kernels ------------------------------------------------------------------------------

    def _store(self, layer: Attention, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        row = layer.num_kv_heads * layer.head_dim
        k, v = k.reshape(-1, row), v.reshape(-1, row)
        if k.stride(1) != 1:
            k = k.contiguous()
        if v.stride(1) != 1:
            v = v.contiguous()
        n, block_t = k.shape[0], self.options.store_block_tokens
        if n == 0:
            return
        self.kernels.store_kv_kernel[(triton_cdiv(n, block_t),)](
            k, v, k_buf, v_buf, fb.out_cache_loc, n, k.stride(0), v.stride(0),
            ROW=row, BLOCK_T=block_t, BLOCK_ROW=_pow2_at_least(row, 16),
        )  # fmt: skip

    def _attend(self, q: torch.Tensor, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        meta: _Meta = fb.attn_metadata
        if layer.head_dim < 16 or layer.head_dim & (layer.head_dim - 1):
            raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {layer.head_dim}")
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        group = layer.num_heads // layer.num_kv_heads
        q = q.reshape(-1, layer.num_heads * layer.head_dim)
        if q.stride(1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        block_rows = max(self.options.block_rows, _pow2_at_least(group, 16))
        queries_per_block = block_rows // group
        grid = (fb.batch_size, layer.num_kv_heads, triton_cdiv(meta.max_q_len, queries_per_block))
        # tf32 products (10-bit mantissa) are within what fp16/bf16 outputs can hold; fp32 models get
        # exact fp32 products, as the conformance kit's fp32 tolerance demands.
        precision = "ieee" if q.dtype == torch.float32 or k_buf.dtype == torch.float32 else "tf32"
        self.kernels.paged_attention_kernel[grid](
            q, k_buf, v_buf, out,
            fb.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.prefix_lens, meta.q_starts,
            q.stride(0), out.stride(0), fb.req_to_token.stride(0), layer.scaling,
            GROUP=group, NUM_KV_HEADS=layer.num_kv_heads, HEAD_DIM=layer.head_dim,
            BLOCK_R=block_rows, BLOCK_N=self.options.block_kv, PRECISION=precision,
        )  # fmt: skip
        return out

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            self._store(layer, forward_batch, k, v)
        return self._attend(q, layer, forward_batch)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            self._store(layer, forward_batch, k, v)
        return self._attend(q, layer, forward_batch)


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))
