"""The per-step agreement between the ranks of one PD side: rank 0 decides from every rank's
report and every rank gets the same decision; a room fails on all ranks when it failed on any,
succeeds only when it succeeded on all, and is quiescent only when every rank's links are."""

from __future__ import annotations

import threading

from framework.disaggregation.agreement import RankAgreement, merge_rooms
from framework.distributed.communicator import Communicator
from framework.distributed.state import TensorParallel


class ThreadGroup(Communicator):
    """``broadcast_bytes`` between threads standing in for ranks."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        self.rank, self.size, self.shared = rank, size, shared

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        if self.rank == src:
            self.shared["slot"] = data
        self.shared["barrier"].wait()
        out = self.shared["slot"]
        self.shared["barrier"].wait()
        return out


def test_rank_zero_decides_from_every_report_and_all_ranks_apply_it():
    shared = {"barrier": threading.Barrier(3)}
    reports = [{"rooms": {7: ["success", None, True]}},
               {"rooms": {7: ["failed", "link with decode rank 0 broke", False]}},
               {"rooms": {7: ["success", None, True]}}]
    seen_by_leader: list = []
    got: dict[int, dict] = {}

    def decide(all_reports):
        seen_by_leader.append(all_reports)
        return {"rooms": merge_rooms(all_reports)}

    def rank(r: int) -> None:
        agree = RankAgreement(TensorParallel(r, 3, ThreadGroup(r, 3, shared)))
        got[r] = agree.exchange(reports[r], decide)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(seen_by_leader) == 1 and seen_by_leader[0] == reports  # only rank 0 decides, on all reports
    assert got[0] == got[1] == got[2] == {"rooms": {7: ["failed", "link with decode rank 0 broke", False]}}


def test_merge_rooms():
    def rep(state, quiescent=True, error=None):
        return {"rooms": {1: [state, error, quiescent]}}

    assert merge_rooms([rep("success"), rep("success")]) == {1: ["success", None, True]}
    assert merge_rooms([rep("success"), rep("transferring")]) == {1: ["transferring", None, True]}
    assert merge_rooms([rep("failed", error="x"), rep("success")]) == {1: ["failed", "x", True]}
    assert merge_rooms([rep("success"), rep("failed", False, "y")]) == {1: ["failed", "y", False]}
    assert merge_rooms([rep("waiting_for_input"), rep("transferring")])[1][0] == "waiting_for_input"


def test_one_rank_is_a_plain_call():
    agree = RankAgreement()
    assert agree.leader and agree.size == 1
    assert agree.exchange({"a": 1}, lambda reports: {"n": len(reports), "first": reports[0]}) == {
        "n": 1, "first": {"a": 1}}
