"""CUDA graphs for decode: capture one graph per batch-size bucket at start, replay them.

A decode step of a small model on a GPU is dominated by kernel-launch overhead (hundreds of small
kernels per step). A captured ``torch.cuda.CUDAGraph`` replays the whole forward (embedding, layers,
attention, LM head) with one launch. A graph is fixed to the addresses and shapes it was captured
with, so:

- inputs live in static buffers sized for the largest bucket; a replay copies the batch's input
  ids, positions, request rows, sequence lengths and KV slots into them;
- a batch of ``n`` requests replays the graph of the smallest bucket ``>= n``; the padding rows
  point at request row 0 with sequence length ``get_cuda_graph_seq_len_fill_value()`` (they only
  *read* a valid KV slot) and write their K/V to slot 0, the KV cache's padding page, which is
  never read as real context; their logits are dropped;
- the attention backend keeps its per-batch metadata in buffers it allocated once
  (``init_cuda_graph_state``) and refreshes them in place before each replay (the hooks in
  :class:`framework.attention.base.AttentionBackend`);
- every graph allocates from one shared memory pool; buckets are captured largest first so the
  smaller ones reuse the pool's blocks (graphs never run concurrently).

Decode batches beyond the largest bucket, extend (prefill) batches, and batches the backend turns
down (``can_replay_cuda_graph``) run eagerly. Sampling stays outside the graph: it has
data-dependent control flow (top-k/top-p, penalties, per-request seeds).

Status: this has not run on a GPU yet. On CPU the tests cover bucket choice, padding, config
resolution, the backends' graph paths (simulated replays) and the whole runner with
:class:`CudaGraphOps` replaced by a simulation; the tests marked ``gpu`` in
tests/engine/test_cuda_graph.py capture and replay real graphs.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import torch

from framework.config.auto import resolve_cuda_graph_enabled
from framework.errors import ConfigError
from framework.executor.forward_batch import ForwardBatch, ForwardMode
from framework.plugins import get_registry

if TYPE_CHECKING:
    from framework.attention.base import AttentionBackend
    from framework.config.schema import CudaGraphConfig

logger = logging.getLogger(__name__)

#: Padding rows write their K/V here: slot 0 is on the KV cache's reserved padding page.
PADDING_KV_SLOT = 0
#: Padding rows read request row 0 (any row holds valid slot numbers; nothing is written to it).
PADDING_REQ_ROW = 0


# --- pure helpers (no CUDA needed) ----------------------------------------------------------------


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every 8 up to ``max_batch_size`` (and ``max_batch_size`` itself): fine steps
    where small batches are common, padding waste under 8 rows beyond."""
    sizes = {b for b in (1, 2, 4) if b <= max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def capture_batch_sizes(configured: list[int] | None, max_batch_size: int, max_running_requests: int) -> list[int]:
    """The buckets to capture, ascending: the configured list (or the default one), without sizes
    above ``max_batch_size`` or the running-request cap. When the cap cut a bucket off, the cap
    becomes a bucket, so that every batch the scheduler can form still replays a graph."""
    sizes = sorted(set(configured)) if configured else default_batch_sizes(max_batch_size)
    limit = min(max_batch_size, max_running_requests)
    kept = [b for b in sizes if b <= limit]
    if any(b > limit for b in sizes) and (not kept or kept[-1] < limit):
        kept.append(limit)
    return kept


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``batch_size`` rows (``sizes`` ascending); ``None`` beyond
    the largest one (that batch runs eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def padded_seq_lens(seq_lens: list[int], bucket: int, fill_value: int) -> list[int]:
    """``seq_lens`` followed by ``fill_value`` up to ``bucket`` rows."""
    if len(seq_lens) > bucket:
        raise ValueError(f"a batch of {len(seq_lens)} does not fit bucket {bucket}")
    return list(seq_lens) + [fill_value] * (bucket - len(seq_lens))


# --- static inputs (device-agnostic, so the padding is testable on CPU) ---------------------------


class DecodeGraphInputs:
    """The static input buffers of every captured graph (one set, sized for the largest bucket;
    bucket ``bs`` uses the first ``bs`` rows) and the static :class:`ForwardBatch` of each bucket."""

    def __init__(
        self,
        max_batch_size: int,
        device: torch.device,
        seq_len_fill_value: int,
        req_to_token: torch.Tensor,
        kv_cache: Any,
        attn_backend: AttentionBackend,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.fill = seq_len_fill_value
        self.req_to_token, self.kv_cache, self.attn_backend = req_to_token, kv_cache, attn_backend

        def buf(value: int) -> torch.Tensor:
            return torch.full((max_batch_size,), value, dtype=torch.int64, device=device)

        self.input_ids = buf(0)
        self.positions = buf(max(seq_len_fill_value - 1, 0))
        self.req_pool_indices = buf(PADDING_REQ_ROW)
        self.seq_lens = buf(seq_len_fill_value)
        self.out_cache_loc = buf(PADDING_KV_SLOT)
        self.batches: dict[int, ForwardBatch] = {}

    def batch(self, bs: int) -> ForwardBatch:
        """The static batch of bucket ``bs``: views of the first ``bs`` rows of every buffer. The
        same object serves the capture and every replay (backends hang their metadata on it)."""
        if bs not in self.batches:
            self.batches[bs] = ForwardBatch(
                mode=ForwardMode.DECODE,
                batch_size=bs,
                input_ids=self.input_ids[:bs],
                positions=self.positions[:bs],
                req_pool_indices=self.req_pool_indices[:bs],
                seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=[self.fill] * bs,
                out_cache_loc=self.out_cache_loc[:bs],
                req_to_token=self.req_to_token,
                kv_cache=self.kv_cache,
                attn_backend=self.attn_backend,
            )
        return self.batches[bs]

    def load(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """Copy ``batch`` into the first rows of bucket ``bs`` and reset the rest to padding."""
        n = batch.batch_size
        fb = self.batch(bs)
        # copy_ keeps the buffers' addresses (what the graph recorded) and casts any int dtype.
        fb.input_ids[:n].copy_(batch.input_ids)
        fb.positions[:n].copy_(batch.positions)
        fb.req_pool_indices[:n].copy_(batch.req_pool_indices)
        fb.seq_lens[:n].copy_(batch.seq_lens)
        fb.out_cache_loc[:n].copy_(batch.out_cache_loc)
        if n < bs:
            # A previous, larger batch left real rows here: padding must not write into its KV.
            fb.input_ids[n:].fill_(0)
            fb.positions[n:].fill_(max(self.fill - 1, 0))
            fb.req_pool_indices[n:].fill_(PADDING_REQ_ROW)
            fb.seq_lens[n:].fill_(self.fill)
            fb.out_cache_loc[n:].fill_(PADDING_KV_SLOT)
        fb.seq_lens_cpu = padded_seq_lens(batch.seq_lens_cpu, bs, self.fill)
        return fb


# --- the runner (CUDA only) -----------------------------------------------------------------------


class CudaGraphOps:
    """The CUDA calls of capture and replay, kept in one place so that a test can substitute a
    simulation (replay = run the captured function again) and drive the whole runner on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture run on one side stream: capture cannot use the default stream, and
        # warming up on the same stream keeps lazily created per-stream state (cuBLAS workspaces)
        # the same in warm-up and capture.
        self.stream = torch.cuda.Stream(device=device)

    def free_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def capture(self, fn: Any, num_warmup_runs: int) -> tuple[Any, torch.Tensor]:
        """Run ``fn`` eagerly ``num_warmup_runs`` times, then capture it; ``(graph, its output)``.
        All graphs share one memory pool."""
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(num_warmup_runs):
                fn()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return graph, out


class CudaGraphRunner:
    """Captures the decode forward of ``runner`` once per bucket and replays it.

    ``runner`` is the :class:`framework.executor.model_runner.ModelRunner` (its model, KV cache,
    request table and attention backend). Construction captures every bucket.
    """

    def __init__(
        self, runner: Any, batch_sizes: list[int], num_warmup_runs: int, ops: CudaGraphOps | None = None
    ) -> None:
        if not batch_sizes:
            raise ValueError("CudaGraphRunner needs at least one batch size")
        if ops is None:
            if runner.device.type != "cuda":
                raise ConfigError(f"cuda_graph.enabled: CUDA graphs need a CUDA device, not {runner.device.type!r}")
            ops = CudaGraphOps(runner.device)
        self.ops = ops
        self.runner = runner
        self.model = runner.model
        self.backend: AttentionBackend = runner.attn_backend
        self.sizes = sorted(batch_sizes)
        self.max_batch_size = self.sizes[-1]
        self.num_warmup_runs = num_warmup_runs
        self.replay_count = 0
        """Decode steps served by a graph replay (the tests check that replays really happen)."""

        self.backend.init_cuda_graph_state(self.max_batch_size, int(runner.req_to_token.shape[1]))
        self.inputs = DecodeGraphInputs(
            self.max_batch_size,
            runner.device,
            self.backend.get_cuda_graph_seq_len_fill_value(),
            runner.req_to_token,
            runner.kv_cache,
            self.backend,
        )
        self.graphs: dict[int, Any] = {}
        """Bucket -> its ``torch.cuda.CUDAGraph``."""
        self.outputs: dict[int, torch.Tensor] = {}
        """Bucket -> the logits tensor its graph writes."""
        self._capture_all()

    # -- capture -----------------------------------------------------------------------------

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The captured region: model forward plus LM head, float32 logits of every row."""
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        free_before = self.ops.free_memory()
        # Largest first: its allocations size the shared pool; smaller buckets reuse the blocks.
        for bs in reversed(self.sizes):
            fb = self.inputs.batch(bs)
            self.backend.init_forward_metadata_capture_cuda_graph(fb)
            self.graphs[bs], self.outputs[bs] = self.ops.capture(lambda fb=fb: self._forward(fb), self.num_warmup_runs)
        logger.info(
            "CUDA graphs: captured %d decode buckets (%s) using %.1f MiB",
            len(self.sizes),
            ", ".join(map(str, self.sizes)),
            (free_before - self.ops.free_memory()) / (1 << 20),
        )

    # -- replay ------------------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` replays a graph: a plain decode batch (one token and one logits row
        per request) over the runner's own cache that fits a bucket and the backend accepts."""
        return (
            batch.mode.is_decode()
            and batch.positions.dim() == 1  # graphs capture 1-D positions, not M-RoPE's [3, n]
            and batch.logits_indices is None
            and 0 < batch.batch_size <= self.max_batch_size
            and batch.num_tokens == batch.batch_size
            and batch.kv_cache is self.runner.kv_cache
            and batch.req_to_token is self.runner.req_to_token
            and batch.attn_backend is self.backend
            and self.backend.can_replay_cuda_graph(batch)
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` (``can_run`` must hold) through its bucket's graph; float32 logits
        ``[batch_size, vocab]``."""
        bs = bucket_for(batch.batch_size, self.sizes)
        assert bs is not None, "replay() called for a batch beyond the largest bucket"
        fb = self.inputs.load(batch, bs)
        self.backend.init_forward_metadata_replay_cuda_graph(fb, batch.batch_size)
        self.graphs[bs].replay()
        self.replay_count += 1
        # Clone: buckets share the memory pool, so the next replay of any bucket may overwrite
        # this output while the sampler (or the overlap worker) still reads it.
        return self.outputs[bs][: batch.batch_size].clone()


def maybe_create_cuda_graph_runner(runner: Any, config: CudaGraphConfig) -> CudaGraphRunner | None:
    """The runner's CUDA-graph runner, or ``None`` when graphs are off (always on CPU).

    ``config.enabled`` is normally resolved by the config loader already; ``None`` (settings
    built by hand) is resolved here against the instantiated backend.
    """
    name = runner.settings.attention.backend
    supports = get_registry().get("attention_backend", name, key="attention.backend").capabilities.cuda_graph
    enabled = resolve_cuda_graph_enabled(config.enabled, runner.device.type, name, supports)
    if not enabled:
        return None
    if getattr(runner, "uses_mrope", False):
        # Graphs are captured with 1-D positions; M-RoPE decode feeds [3, n], so it runs eagerly.
        logger.info("CUDA graphs off: the model takes M-RoPE positions")
        return None
    sizes = capture_batch_sizes(config.batch_sizes, config.max_batch_size, runner.plan.max_running_requests)
    return CudaGraphRunner(runner, sizes, config.num_warmup_runs)
