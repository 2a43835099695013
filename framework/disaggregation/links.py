"""One rank's transfer links to the ranks of the other PD side.

A link is one transfer backend (the configured plugin) between one prefill rank and one decode
rank, over the heads they exchange (``framework.disaggregation.heads``): whole pages when both
hold the same heads, else a head slice of each token slot on either or both sides. Backends stay
single-peer; :class:`RankLinks` fans a room out to this rank's links and folds their states into
one. A prefill replica rank (GQA with more ranks than KV heads) may have no link at all: its rooms
succeed at once, since another rank sends its heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from framework.disaggregation.base import KVLayout, TransferBackend, TransferState
from framework.disaggregation.heads import HeadSlice, RankShard, all_shards, head_plan, sources_of

_ORDER = [TransferState.bootstrapping, TransferState.waiting_for_input, TransferState.transferring,
          TransferState.success]


def link_slices(role: str, shard: RankShard, num_kv_heads: int, peers: list[RankShard]) -> dict[int, HeadSlice]:
    """This rank's exchanges, by peer rank (one contiguous head range per peer at most)."""
    if role == "decode":
        return {s.src: s for s in sources_of(peers, shard)}
    mine = all_shards(num_kv_heads, shard.tp_size)
    return {s.dst: s for s in head_plan(mine, peers) if s.src == shard.tp_rank}


class RankLinks:
    """This rank's backends, one per peer rank it exchanges heads with, behind one room interface."""

    def __init__(self, role: str, layout: KVLayout, shard: RankShard, peers: list[RankShard],
                 make: Callable[[KVLayout], TransferBackend]) -> None:
        if layout.identity is None:
            raise ValueError("links need the layout's model identity")
        self.role, self.shard, self.peers = role, shard, peers
        self.slices = link_slices(role, shard, layout.identity.num_kv_heads, peers)
        self.links: dict[int, TransferBackend] = {}
        try:
            for peer, s in self.slices.items():
                lo, hi = s.start - shard.head_start, s.end - shard.head_start
                self.links[peer] = make(layout if (lo, hi) == (0, shard.num_heads) else layout.sliced(lo, hi))
        except Exception:
            self.close()
            raise
        self._linkless: set[int] = set()
        """Rooms sent by a rank with no link (a replica): they succeed at once."""

    def endpoints(self) -> dict[str, dict[str, Any]]:
        """Each link's endpoint, by the peer rank it is for (JSON keys are strings)."""
        return {str(peer): b.endpoint() for peer, b in self.links.items()}

    def connect(self, peer_endpoints: dict[int, dict[str, Any]]) -> None:
        """``peer_endpoints[p]``: the endpoint peer rank ``p`` made for its link to this rank."""
        for peer, backend in self.links.items():
            if peer not in peer_endpoints:
                raise ValueError(f"{self.role} rank {self.shard.tp_rank}: peer rank {peer} has no link to it")
            backend.connect(peer_endpoints[peer])

    # -- rooms -----------------------------------------------------------------------------

    def send(self, room: int, src_pages: list[int], dst_pages: list[int], metadata: bytes) -> None:
        if not self.links:
            self._linkless.add(room)
        for backend in self.links.values():
            backend.send(room, src_pages, dst_pages, metadata)

    def expect(self, room: int, dst_pages: list[int]) -> None:
        for backend in self.links.values():
            backend.expect(room, dst_pages)

    def status(self, room: int) -> tuple[TransferState, str | None]:
        """The room over every link: failed if one failed, success once all succeeded, else the
        least advanced state."""
        if room in self._linkless:
            return TransferState.success, None
        states = []
        for peer, backend in self.links.items():
            try:
                task = backend.poll(room)
            except KeyError:
                return TransferState.failed, f"room {room}: unknown to the link with {self.role} peer rank {peer}"
            if task.state is TransferState.failed:
                return task.state, task.error
            states.append(task.state)
        return min(states, key=_ORDER.index, default=TransferState.success), None

    def metadata(self, room: int) -> bytes | None:
        """The metadata of the first link that has it (every prefill rank sends the same)."""
        for backend in self.links.values():
            meta = backend.metadata(room)
            if meta is not None:
                return meta
        return None

    def release(self, room: int) -> None:
        self._linkless.discard(room)
        for backend in self.links.values():
            backend.release(room)

    def quiescent(self, room: int) -> bool:
        return all(b.quiescent(room) for b in self.links.values())

    def link_error(self) -> str | None:
        for peer, backend in self.links.items():
            err = backend.link_error()
            if err is not None:
                return f"(link with {'decode' if self.role == 'prefill' else 'prefill'} rank {peer}) {err}"
        return None

    def close(self) -> None:
        for backend in self.links.values():
            backend.close()
