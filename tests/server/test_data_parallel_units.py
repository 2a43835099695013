"""Data parallelism and the unified-server router without servers: the load balancers, the summed
load, the config checks and the router command's argument errors."""

from __future__ import annotations

import subprocess

import pytest

from framework.config.loader import resolve_config
from framework.errors import ConfigError
from framework.router.unified import WorkerRouter, WorkerRouterConfig
from framework.server.data_parallel import LoadBalancer, Replica, combined_load, replica_failure
from tests.server.conftest import PLUGSERVE


def _replicas(n: int) -> list[Replica]:
    return [Replica(rank, None, None) for rank in range(n)]  # type: ignore[arg-type]  # sockets unused here


def test_round_robin_cycles() -> None:
    replicas = _replicas(3)
    balancer = LoadBalancer("round_robin", replicas)
    replicas[0].in_flight = 100  # round robin ignores the queues
    assert [balancer.pick().dp_rank for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [r.assigned for r in replicas] == [3, 2, 2]


def test_shortest_queue_takes_the_emptiest_and_breaks_ties_round_robin() -> None:
    replicas = _replicas(3)
    balancer = LoadBalancer("shortest_queue", replicas)
    assert [balancer.pick().dp_rank for _ in range(4)] == [0, 1, 2, 0]  # all idle: round robin
    replicas[0].in_flight, replicas[1].in_flight, replicas[2].in_flight = 5, 1, 3
    assert balancer.pick().dp_rank == 1
    replicas[1].in_flight = 9
    assert balancer.pick().dp_rank == 2
    replicas[2].in_flight = 5  # 0 and 2 tie at 5: the one after the last pick goes first
    assert balancer.pick().dp_rank == 0


def test_balancer_refuses_unknown_methods() -> None:
    with pytest.raises(ValueError, match="round_robin, shortest_queue"):
        LoadBalancer("least_work", _replicas(2))


def test_combined_load_sums_counts_and_recomputes_the_hit_rate() -> None:
    a = {"num_running": 1, "num_waiting": 2, "kv_used_tokens": 10, "kv_total_tokens": 100, "cache_hit_tokens": 30,
         "prompt_tokens_seen": 40, "prefix_cache_hit_rate": 0.75, "num_retractions": 0, "num_waiting_tokens": 5}
    b = {"num_running": 3, "num_waiting": 0, "kv_used_tokens": 50, "kv_total_tokens": 100, "cache_hit_tokens": 0,
         "prompt_tokens_seen": 60, "prefix_cache_hit_rate": 0.0, "num_retractions": 2, "num_waiting_tokens": 0}
    total = combined_load([a, b])
    assert total["num_running"] == 4 and total["num_waiting"] == 2 and total["kv_used_tokens"] == 60
    assert total["kv_total_tokens"] == 200 and total["num_retractions"] == 2
    assert total["prefix_cache_hit_rate"] == pytest.approx(30 / 100)  # not the mean of 0.75 and 0
    assert combined_load([a]) == a


def test_replica_failure_names_the_first_failing_rank() -> None:
    assert replica_failure([(True, {}), (True, {})]) is None
    assert replica_failure([(True, {}), (False, {"error": "x"}), (False, {})]) == (1, {"error": "x"})


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.dp_size=0"], "parallel.dp_size: invalid value 0, must be >= 1"),
    (["parallel.dp_size=2", "disaggregation.mode=prefill"], "parallel.dp_size: invalid value 2, must be 1 with"),
    (["parallel.load_balance_method=least_work"], "round_robin, shortest_queue"),
    (["parallel.dp_size=2", "parallel.dist_init_addr=127.0.0.1:5000"],
     "parallel.dist_init_addr: invalid value '127.0.0.1:5000', must be null when parallel.dp_size > 1"),
    (["parallel.dp_size=2", "parallel.tp_size=2", "parallel.nnodes=2"], "parallel.nnodes: invalid value 2, must be 1 when"),
])
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_config(None, overrides=overrides)


def test_worker_router_order() -> None:
    urls = ["http://a", "http://b", "http://c"]
    rr = WorkerRouter(WorkerRouterConfig(urls, "round_robin"))
    assert [rr.order()[0] for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    sq = WorkerRouter(WorkerRouterConfig(urls, "shortest_queue"))
    sq.in_flight.update({"http://a": 2, "http://b": 0, "http://c": 1})
    assert sq.order() == ["http://b", "http://c", "http://a"]
    sq._down_until["http://b"] = float("inf")  # refused a connection: tried last
    assert sq.order()[-1] == "http://b"
    with pytest.raises(ValueError, match="round_robin, shortest_queue"):
        WorkerRouter(WorkerRouterConfig(urls, "random"))


@pytest.mark.parametrize("args", [[], ["--worker-urls", "http://a", "--decode", "http://b"],
                                  ["--prefill", "http://a"]])
def test_router_command_needs_one_mode(args: list[str]) -> None:
    done = subprocess.run([PLUGSERVE, "router", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--worker-urls" in done.stderr or "--decode" in done.stderr, done.stderr
