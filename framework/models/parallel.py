"""Tensor-parallel layers: what a model plugin builds so that it runs on any ``parallel.tp_size``.

Each layer is sized for this process's rank (:func:`framework.distributed.state.get_tensor_parallel`)
when it is constructed, and fills its shard from a checkpoint's full tensor in
:meth:`ParallelLinear.load_shard`, so each rank keeps only its slice (and reads only that slice,
through safetensors' lazy slices). With tp_size 1 every layer is exactly the plain torch layer.

- :class:`ColumnParallelLinear`: output features split; a merged projection (``[gate; up]``) is
  split shard by shard, so each rank holds ``[gate_r; up_r]``. No communication.
- :class:`QKVParallelLinear`: ``[q; k; v]`` with the query heads split and the KV heads split, or
  replicated when there are fewer KV heads than ranks.
- :class:`RowParallelLinear`: input features split; the partial outputs are summed with an
  all-reduce (the bias is added once, by rank 0's shard).
- :class:`VocabParallelEmbedding`: vocabulary rows split (padded to a multiple of the ranks); each
  rank looks up the ids it holds and an all-reduce assembles the embeddings.
- :class:`ParallelLMHead`: vocabulary rows split; the logits are all-gathered (and the padding cut)
  before sampling, so every rank samples from the same full row.

The CPU packer (``framework.models.cpu_linear``) packs these like ``nn.Linear`` and keeps their
:attr:`ParallelLinear.output_op` (the collective that follows the GEMM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from framework.distributed.state import (
    TensorParallel,
    get_tensor_parallel,
    kv_head_range,
    kv_heads_per_rank,
    shard_range,
)


class ParallelLinear(nn.Linear):
    """An ``nn.Linear`` holding one rank's shard. ``output_op`` (None, or a function of the GEMM's
    output) is the collective that completes the layer; :meth:`load_shard` fills the shard."""

    output_op: Callable[[torch.Tensor], torch.Tensor] | None = None
    gemm_call: str = "plain"
    """How the model calls this layer, for the CPU GEMM warm-up (:mod:`framework.models.gemm_warmup`):
    ``plain`` (``layer(x)``), ``add`` (through ``linear_add``, its output plus the residual) or
    ``logits`` (an LM head, through ``float_linear``). A wrong value costs only a cold first call."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self.tp: TensorParallel = get_tensor_parallel()
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.output_op is None else self.output_op(y)

    def load_shard(self, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy this rank's part of the checkpoint tensor ``loaded`` into ``param`` ("weight" or
        "bias"); ``shard`` indexes the sub-projection of a merged layer. Shape errors raise."""
        raise NotImplementedError

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"{what}: this rank expects shape {tuple(dst.shape)}, got {tuple(src.shape)}")
        dst.copy_(src)


class ColumnParallelLinear(ParallelLinear):
    """Output features split over the ranks; ``output_sizes`` lists the sub-projections of a merged
    layer (each split on its own), or is just ``[out_features]``."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 local_sizes: Sequence[int] | None = None) -> None:
        tp = get_tensor_parallel()
        self.full_sizes = list(output_sizes)
        if local_sizes is None:
            local_sizes = [s // tp.size for s in output_sizes if shard_range(s, tp.rank, tp.size)]
        self.local_sizes = list(local_sizes)
        super().__init__(in_features, sum(self.local_sizes), bias)

    def _shard_rows(self, shard: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(rows of the checkpoint tensor this rank takes, rows of the local parameter they go to)."""
        src = shard_range(self.full_sizes[shard], self.tp.rank, self.tp.size)
        start = sum(self.local_sizes[:shard])
        return src, (start, start + self.local_sizes[shard])

    def load_shard(self, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
        shard = shard or 0
        if loaded.shape[0] != self.full_sizes[shard]:
            raise ValueError(f"expected {self.full_sizes[shard]} rows, got shape {tuple(loaded.shape)}")
        (s0, s1), (d0, d1) = self._shard_rows(shard)
        dst = getattr(self, param)
        self._copy(dst[d0:d1], loaded[s0:s1], param)


class QKVParallelLinear(ColumnParallelLinear):
    """``[q; k; v]``: query heads split over the ranks, KV heads split (or replicated when the
    ranks outnumber them, each rank keeping the head its query heads attend to)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tensor_parallel()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads cannot be split over {tp.size} tensor-parallel ranks")
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.local_heads = num_heads // tp.size
        self.local_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        kv_local = self.local_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         local_sizes=[self.local_heads * head_dim, kv_local, kv_local])

    def _shard_rows(self, shard: int) -> tuple[tuple[int, int], tuple[int, int]]:
        d = self.head_dim
        if shard == 0:
            h0 = self.tp.rank * self.local_heads
            src = (h0 * d, (h0 + self.local_heads) * d)
        else:
            k0, k1 = kv_head_range(self.num_kv_heads, self.tp.rank, self.tp.size)
            src = (k0 * d, k1 * d)
        start = sum(self.local_sizes[:shard])
        return src, (start, start + self.local_sizes[shard])


class RowParallelLinear(ParallelLinear):
    """Input features split over the ranks; an all-reduce sums the partial outputs. Only rank 0
    holds the real bias (the others hold zeros), so the sum adds it once."""

    gemm_call = "add"  # the block's output projection: the residual rides on its GEMM (linear_add)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tensor_parallel()
        self.full_in = in_features
        start, end = shard_range(in_features, tp.rank, tp.size)
        super().__init__(end - start, out_features, bias)
        if tp.size > 1:
            comm = tp.comm
            self.output_op = comm.all_reduce

    def load_shard(self, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
        dst = getattr(self, param)
        if param == "bias":
            self._copy(dst, _full(loaded) if self.tp.is_first else torch.zeros(tuple(loaded.shape)), param)
            return
        if loaded.dim() != 2 or loaded.shape[1] != self.full_in:
            raise ValueError(f"expected {self.full_in} input columns, got shape {tuple(loaded.shape)}")
        start, end = shard_range(self.full_in, self.tp.rank, self.tp.size)
        self._copy(dst, loaded[:, start:end], param)


def _vocab_rows(vocab: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(rows per rank with padding, first and end vocabulary id of this rank's real rows)."""
    per = -(-vocab // tp.size)
    start = tp.rank * per
    return per, min(start, vocab), min(start + per, vocab)


class VocabParallelEmbedding(nn.Embedding):
    """Vocabulary rows split over the ranks (the last rank padded); an all-reduce of the masked
    lookups gives every rank the full embeddings."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp = get_tensor_parallel()
        self.full_vocab = num_embeddings
        per, self.vocab_start, self.vocab_end = _vocab_rows(num_embeddings, self.tp)
        super().__init__(per, embedding_dim)

    def reset_parameters(self) -> None:
        """Random init, except on the meta device, where ``build_model`` builds before loading
        every weight: ``normal_`` on a meta tensor imports ``torch._dynamo`` (0.7 s of each
        scheduler's start, measured) for values nobody reads."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.comm.all_reduce(out)

    def load_shard(self, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
        """This rank's vocabulary rows of the full ``[vocab, hidden]`` table (padding rows zero)."""
        if loaded.shape != (self.full_vocab, self.embedding_dim):
            raise ValueError(f"expected shape {(self.full_vocab, self.embedding_dim)}, got {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            self.weight[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
            self.weight[rows:].zero_()


class ParallelLMHead(ParallelLinear):
    """The output projection with vocabulary rows split like :class:`VocabParallelEmbedding` (so a
    tied head shares its weight); the logits of all ranks are gathered and the padding cut."""

    gemm_call = "logits"

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = get_tensor_parallel()
        self.full_vocab = vocab_size
        per, self.vocab_start, self.vocab_end = _vocab_rows(vocab_size, tp)
        super().__init__(hidden_size, per, bias=False)
        if tp.size > 1:
            comm = tp.comm

            def gather(y: torch.Tensor) -> torch.Tensor:
                return comm.all_gather(y, dim=-1)[..., :vocab_size]

            self.output_op = gather

    def load_shard(self, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
        if loaded.shape != (self.full_vocab, self.in_features):
            raise ValueError(f"expected shape {(self.full_vocab, self.in_features)}, got {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            self.weight[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
            self.weight[rows:].zero_()


def load_parallel_weight(module: nn.Module, param: str, loaded: torch.Tensor, shard: int | None = None) -> None:
    """Fill ``module.<param>`` from a checkpoint tensor: its shard for a parallel layer, the whole
    tensor for anything else (replicated: norms, rotary tables)."""
    load = getattr(module, "load_shard", None)
    if callable(load):
        load(param, loaded, shard)
        return
    dst = getattr(module, param)
    if dst.shape != loaded.shape:
        raise ValueError(f"expected shape {tuple(dst.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        dst.copy_(_full(loaded))


def _full(loaded: torch.Tensor) -> torch.Tensor:
    """The whole tensor, reading it now if it is a lazy checkpoint slice (``framework.models.loader.LazyTensor``)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.full()
