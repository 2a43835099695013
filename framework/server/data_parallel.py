"""Data parallelism in the HTTP process: one socket pair per engine replica, and the load balancer.

With ``parallel.dp_size`` = N the launcher spawns N scheduler processes (replicas, ``dp_rank``
0..N-1), each a full engine with its own KV cache. Each replica gets its OWN channel
(``framework.server.channel``: a Unix socket at its own path) rather than one shared receiver
for all outputs: the channel a message arrived on says which replica sent it, so per-replica
load reports and control replies need no rank field in the scheduler's messages, and the
scheduler process stays exactly what it is with dp 1 (the tensor-parallel code changes that
process; data parallelism stays out of it).

The balancer assigns each HTTP request (all its scheduler requests: a batch, ``n`` choices) to
one replica, so a group is admitted or refused as a whole by one scheduler and an ``n`` > 1
request shares its prompt's prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from framework.server.channel import AsyncChannel, listen

BALANCE_METHODS = ("round_robin", "shortest_queue")

SUMMED_LOAD_KEYS = ("num_running", "num_waiting", "num_waiting_tokens", "kv_used_tokens", "kv_total_tokens",
                    "num_retractions", "cache_hit_tokens", "prompt_tokens_seen")
"""Load fields that add up across replicas (the /metrics gauges are the server's totals)."""


@dataclass
class Replica:
    """One engine replica as the HTTP process sees it: its channel, what it reported, and how
    many scheduler requests it was sent that have not finished (the balancer's queue length)."""

    dp_rank: int
    channel: AsyncChannel
    info: dict[str, Any] = field(default_factory=dict)
    """Its Ready info (model, context length, scheduler pid)."""
    last_load: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    """Scheduler requests sent to it and neither finished, aborted nor refused yet."""
    assigned: int = 0
    """HTTP requests the balancer has sent it since the start (a counter for tests and logs)."""


def listen_replicas(paths: Sequence[str]) -> list[Replica]:
    """One replica per channel path, each listening (bound before its scheduler is spawned: it
    connects to the path); the replicas take their connections in ``TokenizerManager.wait_ready``."""
    replicas: list[Replica] = []
    try:
        for rank, path in enumerate(paths):
            replicas.append(Replica(rank, AsyncChannel(listen(path))))
    except BaseException:
        for replica in replicas:
            replica.channel.close()
        raise
    return replicas


class LoadBalancer:
    """Picks the replica of each HTTP request.

    ``round_robin`` cycles through the replicas. ``shortest_queue`` takes the replica with the
    fewest scheduler requests in flight (sent by this process, not yet finished: what the
    replica is running plus what waits in its queue); ties go round-robin, so that sequential
    requests on an idle server still spread over every replica.
    """

    def __init__(self, method: str, replicas: Sequence[Replica]) -> None:
        if method not in BALANCE_METHODS:
            raise ValueError(f"parallel.load_balance_method: {method!r}, must be one of {', '.join(BALANCE_METHODS)}")
        if not replicas:
            raise ValueError("the load balancer needs at least one replica")
        self.method = method
        self.replicas = list(replicas)
        self._next = 0

    def pick(self, dp_rank: int | None = None) -> Replica:
        """The replica of the next HTTP request; ``dp_rank`` forces one (the caller checked the range)."""
        if dp_rank is not None:
            self.replicas[dp_rank].assigned += 1
            return self.replicas[dp_rank]
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        chosen = order[0] if self.method == "round_robin" else min(order, key=lambda r: r.in_flight)
        self._next = (chosen.dp_rank + 1) % n
        chosen.assigned += 1
        return chosen


def combined_load(loads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The server's load over all replicas: counts summed, the hit rate recomputed from the sums."""
    if len(loads) == 1:
        return dict(loads[0])
    total: dict[str, Any] = {key: sum(load.get(key, 0) for load in loads) for key in SUMMED_LOAD_KEYS}
    seen = total["prompt_tokens_seen"]
    total["prefix_cache_hit_rate"] = total["cache_hit_tokens"] / seen if seen else 0.0
    return total


def replica_failure(results: Sequence[tuple[bool, dict[str, Any]]]) -> tuple[int, dict[str, Any]] | None:
    """The first replica whose control call failed, as ``(dp_rank, data)``; None if all succeeded."""
    for rank, (ok, data) in enumerate(results):
        if not ok:
            return rank, data
    return None
