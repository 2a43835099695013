"""Which KV heads travel between which ranks when prefill and decode run different TP sizes.

Each tensor-parallel rank caches only its KV heads (``framework.distributed.state.kv_head_range``).
A decode rank needs exactly its own head range, so it receives, from every prefill rank whose
range overlaps it, the overlapping heads of each page (per layer, K and V). With equal TP sizes the
ranges coincide and rank ``i`` sends whole pages to rank ``i``. When ranks outnumber the KV heads
(GQA replication: several ranks hold the same head), a decode rank takes each head from the
lowest prefill rank that holds it, so every head arrives exactly once and the replicas of the
prefill side send nothing.

Both sides also describe their model (:class:`ModelIdentity`): the KV of a different model, or of
the same model in another dtype or page size, may have the same bytes per page and still be wrong,
so links are refused on identity, not on byte counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from framework.distributed.state import kv_head_range


@dataclass(frozen=True)
class ModelIdentity:
    """What must match for one server's KV to be another's: compared field by field."""

    architecture: str
    num_layers: int
    head_dim: int
    num_kv_heads: int
    """The checkpoint's KV heads (all ranks together)."""
    dtype: str
    page_size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelIdentity:
        return cls(str(data["architecture"]), int(data["num_layers"]), int(data["head_dim"]),
                   int(data["num_kv_heads"]), str(data["dtype"]), int(data["page_size"]))

    @classmethod
    def of_runner(cls, runner: Any) -> ModelIdentity:
        """The identity of a ``ModelRunner``'s model and KV cache."""
        # A multimodal config nests its decoder's under text_config (the runner resolves it).
        cfg, cache = getattr(runner, "text_config", runner.hf_config), runner.kv_cache
        total = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(str(runner.architecture), cache.num_layers, cache.head_dim, int(total),
                   str(cache.dtype).removeprefix("torch."), cache.page_size)

    def mismatch(self, other: ModelIdentity) -> str | None:
        """Why ``other``'s KV cannot be this one's (None if it can)."""
        diffs = [f"{name} {a!r} vs {b!r}" for name, a, b in
                 ((f, getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__) if a != b]
        return "; ".join(diffs) or None


@dataclass(frozen=True)
class RankShard:
    """One rank's place: its TP rank and size and the KV heads ``[head_start, head_end)`` it holds."""

    tp_rank: int
    tp_size: int
    head_start: int
    head_end: int

    @classmethod
    def of(cls, num_kv_heads: int, rank: int, size: int) -> RankShard:
        return cls(rank, size, *kv_head_range(num_kv_heads, rank, size))

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    def to_json(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "kv_heads": [self.head_start, self.head_end]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankShard:
        start, end = data["kv_heads"]
        return cls(int(data["tp_rank"]), int(data["tp_size"]), int(start), int(end))


def all_shards(num_kv_heads: int, size: int) -> list[RankShard]:
    """Every rank's shard of a side with ``size`` ranks."""
    return [RankShard.of(num_kv_heads, r, size) for r in range(size)]


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[start, end)`` (checkpoint numbering) that prefill rank ``src`` sends to decode rank ``dst``."""

    src: int
    dst: int
    start: int
    end: int


def sources_of(prefill: list[RankShard], decode: RankShard) -> list[HeadSlice]:
    """What one decode rank receives: its head range covered exactly once, each head from the
    lowest prefill rank that holds it (the others are replicas: GQA with tp_size > KV heads)."""
    out: list[HeadSlice] = []
    head = decode.head_start
    while head < decode.head_end:
        src = next((p for p in prefill if p.head_start <= head < p.head_end), None)
        if src is None:
            raise ValueError(f"no prefill rank holds KV head {head} (prefill shards: {prefill})")
        end = min(src.head_end, decode.head_end)
        out.append(HeadSlice(src.tp_rank, decode.tp_rank, head, end))
        head = end
    return out


def head_plan(prefill: list[RankShard], decode: list[RankShard]) -> list[HeadSlice]:
    """Every (prefill rank, decode rank, heads) exchange between the two sides."""
    return [s for d in decode for s in sources_of(prefill, d)]


def is_whole(shard: RankShard, s: HeadSlice) -> bool:
    """True when ``s`` covers all of ``shard``'s heads (that side moves whole pages)."""
    return (s.start, s.end) == (shard.head_start, shard.head_end)
