"""Agreement between the tensor-parallel ranks of one PD side.

Every rank runs the same scheduler in lockstep (``framework.scheduler.replicated``), so anything a
PD side decides from what it *observes* (a transfer finished on this rank's links, a timeout on
this rank's clock, a registration the bootstrap service saw, a failed HTTP call) would let the
ranks' schedulers drift apart: one rank frees a request's pages a step before another and the
next batches differ. So each PD step starts with one exchange: every rank reports what it saw,
rank 0 folds the reports (plus what only it can see: the bootstrap service, its clock) into one
decision, and every rank applies that same decision. A room fails on all ranks when it failed on
any, and succeeds only once it succeeded on all.

Messages are msgpack over the group's CPU broadcast (``Communicator.broadcast_bytes``); with one
rank the exchange is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from framework.distributed.state import TensorParallel, get_tensor_parallel


class RankAgreement:
    """One gather-decide-broadcast per call, over this process's tensor-parallel group."""

    def __init__(self, tp: TensorParallel | None = None) -> None:
        tp = tp or get_tensor_parallel()
        self.comm, self.rank, self.size = tp.comm, tp.rank, tp.size
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that decides (and that owns the bootstrap service or client)."""
        return self.rank == 0

    def exchange(self, report: Any, decide: Callable[[list[Any]], Any]) -> Any:
        """Every rank passes its ``report``; rank 0 calls ``decide`` with all of them (rank order)
        and every rank returns its result. Reports and decisions are msgpack-able."""
        if self.size == 1:
            return decide([report])
        mine = self._enc.encode(report)
        # A gather as one broadcast per rank: the reports are small and the group is a few ranks.
        reports = [self._dec.decode(self.comm.broadcast_bytes(mine if r == self.rank else None, src=r))
                   for r in range(self.size)]
        decision = self._enc.encode(decide(reports)) if self.leader else None
        return self._dec.decode(self.comm.broadcast_bytes(decision, src=0))


_ORDER = ("bootstrapping", "waiting_for_input", "transferring", "success")


def merge_rooms(reports: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """Each room (``report["rooms"][room] = [state, error, quiescent]``) over every rank: failed if
    it failed on one, success once it succeeded on all, else the least advanced state; quiescent
    only when every rank's links are."""
    rooms: dict[int, list[Any]] = {}
    for report in reports:
        for room, (state, error, quiescent) in report["rooms"].items():
            cur = rooms.setdefault(int(room), [state, error, quiescent])
            if cur[0] != "failed" and (state == "failed" or _ORDER.index(state) < _ORDER.index(cur[0])):
                cur[0], cur[1] = state, error
            cur[2] = cur[2] and quiescent
    return rooms
