"""Keeping one decode step's sampling parameters for the next step of the same batch.

Why: building :class:`~framework.sampling.sampler.SamplingBatchInfo` costs ~0.26 ms a step for one
request and ~0.55 ms for 64 (Python over every row, a handful of small tensors), measured inside a
llama-120m decode loop where each step's weight reads have just flushed the caches; at one stream
that is 2.5-4% of a step. Between two decode steps of the same requests, an info without
penalties or logit processors changes only in its rows' output lengths (the seeded rows' step
counters): its parameter tensors depend on the requests' fixed sampling parameters alone, and
penalties never come back once pruned (``min_new_tokens`` only expires). So such an info is kept
and its lengths advanced; anything else is built afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from framework.sampling.sampler import SamplingBatchInfo

if TYPE_CHECKING:
    from framework.scheduler.request import Req


class SamplingInfoReuse:
    """The last info built for a batch, handed out again when the same requests (same objects, same
    order) come back each with exactly one more output token."""

    def __init__(self) -> None:
        self._reqs: list[Req] = []
        self._info: SamplingBatchInfo | None = None

    def take(self, reqs: list[Req]) -> SamplingBatchInfo | None:
        """The kept info advanced by one token per row, or None (build a new one and :meth:`keep` it)."""
        info = self._info
        if info is None or len(reqs) != len(self._reqs):
            return None
        lens = info.output_lens
        for r, kept, n in zip(reqs, self._reqs, lens, strict=True):
            if r is not kept or len(r.output_ids) != n + 1:
                self._info = None
                return None
        info.output_lens = [n + 1 for n in lens]
        return info

    def keep(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        """Remember ``info`` (built for ``reqs`` now) if it can be advanced without a rebuild."""
        plain = info.penalties is None and info.processor_outputs is None
        self._reqs, self._info = (list(reqs), info) if plain else ([], None)

    def clear(self) -> None:
        """Forget the kept info (the requests it names may be gone)."""
        self._reqs, self._info = [], None
