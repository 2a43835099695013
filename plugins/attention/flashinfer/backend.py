"""The ``flashinfer`` attention backend: flashinfer's paged-KV prefill and decode wrappers.

The framework's cache is one ``[(num_pages + 1) * page_size, kv_heads, head_dim]`` buffer per layer
with page ``i`` at slots ``i * page_size ..``; viewed as ``[num_pages + 1, page_size, kv_heads,
head_dim]`` it is exactly flashinfer's ``NHD`` paged layout, so the kernels read it in place. The
page table flashinfer wants (CSR: ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) is derived
once per batch from ``req_to_token``: the slot of every ``page_size``-th position divided by
``page_size`` is the page index. The wrappers are planned lazily at the first layer of a batch,
because the head counts and the softmax scale come with the layer, not the batch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.attention.base import Attention, AttentionBackend
from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashInferOptions:
    """Options of the ``flashinfer`` backend."""

    workspace_mb: int = 128
    """Size of the workspace buffer flashinfer's planner splits work into (shared by both wrappers)."""
    decode_tensor_cores_min_group: int = 4
    """Decode uses flashinfer's tensor-core (prefill) kernel when ``num_heads / num_kv_heads`` is at
    least this; below it, the CUDA-core decode kernel is faster. 0 always uses tensor cores."""


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ConfigError(
            "attention.backend=flashinfer needs the flashinfer package, which is not importable here "
            f"({exc}); install it (pip install 'plugserve[flashinfer]') or choose attention.backend=triton "
            "or torch_native"
        ) from None
    return flashinfer


@dataclass
class _Plan:
    """One batch's page table in flashinfer's CSR form (plus the query offsets for extend)."""

    decode: bool
    qo_indptr: torch.Tensor | None
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    planned_for: tuple | None = None
    """The layer shape the wrapper was last planned for; a layer of another shape re-plans."""
    graph_batch_size: int | None = None
    """CUDA graphs: the bucket this plan captures (decode only); ``None`` for eager batches."""
    replan: tuple[Any, tuple[int, ...], dict[str, Any]] | None = None
    """CUDA graphs: the wrapper and the ``plan`` arguments other than the page table, recorded at
    the warm-up run, so a replay can re-plan for the new page table before the graph runs."""


def paged_kv_csr(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's page table for a batch: ``(kv_indptr, kv_indices, kv_last_page_len)``, int32.

    Request ``i`` owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, in position order; the
    last holds ``kv_last_page_len[i]`` of its tokens. A page's index is the slot of its first
    position divided by ``page_size`` (the allocator hands out whole, aligned pages).
    """
    device = req_to_token.device
    seq_lens = seq_lens.to(device, torch.int32)
    num_pages = (seq_lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(num_pages, 0)
    max_pages = (max_seq_len + page_size - 1) // page_size
    first_slots = req_to_token[req_pool_indices.to(device)][:, torch.arange(max_pages, device=device) * page_size]
    live = torch.arange(max_pages, device=device)[None, :] < num_pages[:, None]
    kv_indices = (first_slots[live] // page_size).to(torch.int32)
    last_page_len = ((seq_lens - 1) % page_size + 1).to(torch.int32)
    return kv_indptr, kv_indices, last_page_len


class FlashInferAttnBackend(AttentionBackend):
    """Attention over the paged KV cache with ``BatchPrefillWithPagedKVCacheWrapper`` (extend) and
    ``BatchDecodeWithPagedKVCacheWrapper`` (decode). fp16/bf16 only, CUDA only.

    CUDA graphs: each captured bucket gets its own decode wrapper created with
    ``use_cuda_graph=True`` over slices of pre-allocated ``kv_indptr`` / ``kv_indices`` /
    ``kv_last_page_len`` buffers (flashinfer fixes a graph wrapper's batch size). ``plan`` runs on
    the host, so it is never captured: the warm-up run plans (and records the layer shape), and
    each replay re-plans, which copies the new page table into those buffers in place. All layers
    must share one attention shape (one plan per forward).
    """


    def __init__(self, runner: Any, options: FlashInferOptions | None = None) -> None:
        self.device = torch.device(runner.device)
        if self.device.type != "cuda":
            raise ConfigError(
                f"attention.backend=flashinfer runs only on CUDA GPUs, but the device is {self.device.type!r}; "
                "use attention.backend=torch_native (or auto) on this machine"
            )
        if not torch.cuda.is_available():
            raise ConfigError("attention.backend=flashinfer needs CUDA, but torch.cuda.is_available() is False")
        dtype = getattr(runner, "dtype", None)
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"attention.backend=flashinfer computes in float16/bfloat16, but the model dtype is {dtype}; "
                "set model.dtype=float16 or bfloat16, or choose attention.backend=triton"
            )
        self.flashinfer = _import_flashinfer()
        self.options = options or FlashInferOptions()
        self.workspace = torch.empty(self.options.workspace_mb << 20, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode_wrappers: dict[bool, Any] = {}
        # CUDA-graph state (init_cuda_graph_state): the page-table buffers the graph wrappers read.
        self._graph_kv_indptr: torch.Tensor | None = None
        self._graph_kv_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_wrappers: dict[tuple[int, bool], Any] = {}

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run in this process (``None`` if it can), without importing
        flashinfer: what an ``auto`` backend choice should consult before picking it."""
        if not torch.cuda.is_available():
            return "no CUDA device"
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer package is not installed"
        return None

    def _decode_wrapper(self, use_tensor_cores: bool) -> Any:
        if use_tensor_cores not in self._decode_wrappers:
            self._decode_wrappers[use_tensor_cores] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=use_tensor_cores
            )
        return self._decode_wrappers[use_tensor_cores]

    # --- CUDA graphs ---------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        dev = self.device
        self._graph_kv_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev)
        # Enough page indices for max_batch_size requests of max_context_len tokens at page size 1
        # (int32: 4 bytes x buckets x context, tens of MB at most).
        self._graph_kv_indices = torch.zeros(max_batch_size * max_context_len, dtype=torch.int32, device=dev)
        self._graph_last_page_len = torch.ones(max_batch_size, dtype=torch.int32, device=dev)

    def _graph_wrapper(self, batch_size: int, use_tensor_cores: bool) -> Any:
        key = (batch_size, use_tensor_cores)
        if key not in self._graph_wrappers:
            assert self._graph_kv_indptr is not None and self._graph_kv_indices is not None
            assert self._graph_last_page_len is not None, "init_cuda_graph_state first"
            # Buckets share the buffers (slices of one allocation): only one graph runs at a time,
            # and every replay re-plans, which rewrites them.
            self._graph_wrappers[key] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_kv_indptr[: batch_size + 1],
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:batch_size],
            )
        return self._graph_wrappers[key]

    def _page_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return paged_kv_csr(
            fb.req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu), fb.kv_cache.page_size
        )

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        kv_indptr, kv_indices, last_page_len = self._page_table(forward_batch)
        forward_batch.attn_metadata = _Plan(
            True, None, kv_indptr, kv_indices, last_page_len, graph_batch_size=forward_batch.batch_size
        )

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, real_batch_size: int) -> None:
        plan: _Plan = forward_batch.attn_metadata
        if plan.replan is None:
            return  # the model has no attention layer that planned during warm-up
        kv_indptr, kv_indices, last_page_len = self._page_table(forward_batch)
        wrapper, args, kwargs = plan.replan
        wrapper.plan(kv_indptr, kv_indices, last_page_len, *args, **kwargs)

    # --- per-batch metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        kv_indptr, kv_indices, last_page_len = paged_kv_csr(
            fb.req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu), fb.kv_cache.page_size
        )
        qo_indptr = None
        if fb.mode.is_extend():
            _, q_lens = fb.extend_lengths()
            qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
            qo_indptr = qo_indptr.to(self.device)
        fb.attn_metadata = _Plan(fb.mode.is_decode(), qo_indptr, kv_indptr, kv_indices, last_page_len)

    def _check_dtype(self, q: torch.Tensor, kv: torch.Tensor) -> None:
        if q.dtype not in SUPPORTED_DTYPES or kv.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"attention.backend=flashinfer computes in float16/bfloat16, got q {q.dtype} and KV cache "
                f"{kv.dtype}; set model.dtype (and kv_cache.dtype) to float16 or bfloat16"
            )

    def _paged(self, layer: Attention, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        shape = (-1, fb.kv_cache.page_size, layer.num_kv_heads, layer.head_dim)
        return k_buf.view(shape), v_buf.view(shape)

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
        cache, plan = forward_batch.kv_cache, forward_batch.attn_metadata
        self._check_dtype(q, cache.get_kv(layer.layer_id)[0])
        if save_kv_cache:
            cache.store(layer.layer_id, forward_batch.out_cache_loc, k, v)
        shape = ("extend", layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling, q.dtype)
        if plan.planned_for != shape:
            self.prefill_wrapper.plan(
                plan.qo_indptr,
                plan.kv_indptr,
                plan.kv_indices,
                plan.kv_last_page_len,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                cache.page_size,
                causal=True,  # flashinfer aligns the causal mask to the end of each request's KV
                sm_scale=layer.scaling,
                q_data_type=q.dtype,
                kv_data_type=cache.dtype,
            )
            plan.planned_for = shape
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = self.prefill_wrapper.run(q, self._paged(layer, forward_batch))
        return out.view(-1, layer.num_heads * layer.head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        cache, plan = forward_batch.kv_cache, forward_batch.attn_metadata
        self._check_dtype(q, cache.get_kv(layer.layer_id)[0])
        if save_kv_cache:
            cache.store(layer.layer_id, forward_batch.out_cache_loc, k, v)
        group = layer.num_heads // layer.num_kv_heads
        use_tensor_cores = group >= self.options.decode_tensor_cores_min_group
        if plan.graph_batch_size is not None:
            wrapper = self._graph_wrapper(plan.graph_batch_size, use_tensor_cores)
        else:
            wrapper = self._decode_wrapper(use_tensor_cores)
        shape = ("decode", id(wrapper), layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling, q.dtype)
        if plan.planned_for != shape:
            if plan.graph_batch_size is not None and plan.planned_for is not None:
                raise RuntimeError(
                    "flashinfer: CUDA graphs need every attention layer to have the same shape "
                    f"(heads, kv heads, head dim, scale); got {plan.planned_for[2:]} and {shape[2:]}. "
                    "Set cuda_graph.enabled=false for this model"
                )
            # Positional as flashinfer documents them: (page table, num_qo_heads, num_kv_heads,
            # head_dim, page_size).
            args = (layer.num_heads, layer.num_kv_heads, layer.head_dim, cache.page_size)
            kwargs: dict[str, Any] = dict(
                pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=cache.dtype, sm_scale=layer.scaling
            )
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, *args, **kwargs)
            plan.planned_for = shape
            if plan.graph_batch_size is not None:
                plan.replan = (wrapper, args, kwargs)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = wrapper.run(q, self._paged(layer, forward_batch))
        return out.view(-1, layer.num_heads * layer.head_dim)
