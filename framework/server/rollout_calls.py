"""The scheduler-process side of the RL control calls: ``Control.args`` -> a rollout operation.

The HTTP process validated the request bodies (``framework.server.rollout_routes``); the
arguments arrive here as plain msgpack values (tensors as safetensors bytes) and go to the
scheduler's :class:`~framework.scheduler.rollout.RolloutControl`.
"""

from __future__ import annotations

from typing import Any

from framework.scheduler.rollout import RolloutControl, RolloutError, tensors_from_bytes


def dispatch(rollout: RolloutControl, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one RL control call; raises :class:`RolloutError` for a refusal."""
    flush = bool(args.get("flush_cache", True))
    version = args.get("weight_version")
    if kind == "pause_generation":
        return rollout.pause(args.get("mode", "abort"))
    if kind == "continue_generation":
        return rollout.continue_generation()
    if kind == "release_memory_occupation":
        return rollout.release_memory(args.get("tags"))
    if kind == "resume_memory_occupation":
        return rollout.resume_memory(args.get("tags"))
    if kind == "update_weights_from_disk":
        return rollout.update_from_disk(args["model_path"], flush, version)
    if kind == "update_weights_from_tensor":
        named = [pair for blob in args["serialized_named_tensors"] for pair in tensors_from_bytes(blob)]
        return rollout.update_from_tensors(named, flush, version)
    if kind == "init_weights_update_group":
        return rollout.init_group(args["master_address"], args["master_port"], args["rank_offset"],
                                  args["world_size"], args["group_name"], args["backend"], args["timeout_s"])
    if kind == "update_weights_from_distributed":
        return rollout.update_from_distributed(args["names"], args["dtypes"], args["shapes"],
                                               args["group_name"], flush, version)
    if kind == "destroy_weights_update_group":
        return rollout.destroy_group(args["group_name"])
    if kind == "get_weights_by_name":
        return {"values": rollout.get_weights(args["name"], args.get("truncate_size", 100))}
    raise RolloutError(400, f"unknown rollout call {kind!r}")
