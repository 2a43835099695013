"""Tensor-parallel settings are checked at config resolution, naming the key and what is allowed;
the split rules for heads and vocabulary."""

from __future__ import annotations

import pytest

from framework.config.loader import resolve_config
from framework.distributed.state import kv_head_range, kv_heads_per_rank, shard_range
from framework.errors import ConfigError


@pytest.mark.parametrize("overrides, key", [
    (["parallel.tp_size=0"], "parallel.tp_size"),
    # PD across TP sizes is built; several replicas of one PD server are still refused
    (["parallel.dp_size=2", "disaggregation.mode=prefill"], "parallel.dp_size"),
    (["parallel.tp_size=3", "parallel.nnodes=2", "parallel.dist_init_addr=h:1"], "parallel.nnodes"),
    (["parallel.tp_size=2", "parallel.nnodes=2"], "parallel.dist_init_addr"),
    (["parallel.tp_size=2", "parallel.nnodes=2", "parallel.node_rank=2", "parallel.dist_init_addr=h:1"],
     "parallel.node_rank"),
    (["parallel.communicator=mpi"], "parallel.communicator"),
    (["parallel.dp_size=2", "parallel.dist_init_addr=h:1"], "parallel.dist_init_addr"),
])
def test_bad_parallel_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config(None, ["model.path=/nonexistent", *overrides])


def test_tensor_parallel_pd_servers_resolve():
    for mode in ("prefill", "decode"):
        cfg = resolve_config(None, ["model.path=/nonexistent", "parallel.tp_size=2", f"disaggregation.mode={mode}",
                                    *(["memory_pool.name=decode_prealloc"] if mode == "decode" else [])])
        assert cfg.parallel.tp_size == 2 and cfg.disaggregation.mode.value == mode


def test_auto_communicator():
    assert resolve_config(None, ["model.path=/nonexistent"]).parallel.communicator == "torch_distributed"


def test_split_rules():
    assert [shard_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="divisible"):
        shard_range(6, 0, 4)
    assert kv_heads_per_rank(4, 2) == 2 and [kv_head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    # fewer KV heads than ranks: each rank keeps the one its query heads use
    assert kv_heads_per_rank(2, 4) == 1 and [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2),
                                                                                           (1, 2)]
    with pytest.raises(ValueError, match="cannot"):
        kv_heads_per_rank(3, 2)
