"""Which tensor-parallel rank this process is, and its communicator.

A process serves one rank of one model, so the rank is process state (as in SGLang and vLLM):
the model runner sets it before building the model, and the parallel layers read it when they are
constructed (their sizes) and keep the communicator for their forward. Without a call to
:func:`set_tensor_parallel` a process is rank 0 of 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from framework.distributed.communicator import Communicator, SingleRank


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int
    size: int
    comm: Communicator

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_single = TensorParallel(0, 1, SingleRank())
_current: TensorParallel = _single


def get_tensor_parallel() -> TensorParallel:
    """The rank, group size and communicator the parallel layers use in this process."""
    return _current


def set_tensor_parallel(tp: TensorParallel | None) -> None:
    """Make ``tp`` this process's group (None: back to a single rank)."""
    global _current
    _current = tp or _single


@contextlib.contextmanager
def tensor_parallel(tp: TensorParallel) -> Iterator[TensorParallel]:
    """``tp`` for the duration of a block (tests build models of several ranks in one process)."""
    old = _current
    set_tensor_parallel(tp)
    try:
        yield tp
    finally:
        set_tensor_parallel(old)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of rank ``rank`` when ``total`` rows are split evenly (must divide)."""
    if total % size:
        raise ValueError(f"{total} is not divisible by the tensor-parallel size {size}")
    per = total // size
    return rank * per, (rank + 1) * per


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads a rank holds: split when there are at least as many heads as ranks, else each
    rank keeps one head, replicated over ``size // num_kv_heads`` ranks (as SGLang and vLLM do)."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {size} tensor-parallel ranks")
        return num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"{size} tensor-parallel ranks cannot share {num_kv_heads} KV heads evenly")
    return 1


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` (of the checkpoint's) that rank ``rank`` holds."""
    per = kv_heads_per_rank(num_kv_heads, size)
    if num_kv_heads >= size:
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // size
    return head, head + 1
