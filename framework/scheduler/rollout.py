"""RL rollout control: pause and continue generation, release and resume memory, update weights.

The same operations serve the in-process :class:`~framework.engine.engine.Engine` and the server's
scheduler process (SGLang's names: ``pause_generation``, ``release_memory_occupation``,
``update_weights_from_disk`` ...). Each runs between two scheduler steps, on the scheduler thread.

Operations that need the model to themselves (releases, weight updates) wait until they can run
(:meth:`RolloutControl.ready`): no forward in flight, and no running request unless generation is
paused. While one waits, no new prefill starts (waiting requests are held), so requests in flight
finish first. ``pause_generation`` decides what happens to the others first, as SGLang's modes:
``abort`` (they end with finish reason abort), ``retract`` (their KV is dropped and they re-queue,
to be recomputed after ``continue_generation``) or ``in_place`` (they stay, holding their KV).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from framework.distributed.state import get_tensor_parallel
from framework.executor.weight_sync import WeightUpdateGroup, parse_dtype
from framework.executor.weights import WeightUpdateError
from framework.memory.memory_saver import MEMORY_TAGS
from framework.scheduler.retraction import retract_all

if TYPE_CHECKING:
    from framework.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")

#: Control calls that need the model to themselves (see the module docstring).
EXCLUSIVE_CALLS = ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk",
                   "update_weights_from_tensor", "update_weights_from_distributed")


class RolloutError(Exception):
    """A rollout call the server refuses: ``status`` is the HTTP status, ``param`` the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def parse_tags(tags: Any) -> list[str]:
    """``None``/``[]`` -> every tag; else the tags, each checked against :data:`MEMORY_TAGS`."""
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RolloutError(400, "tags must be a list of strings", "tags")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise RolloutError(400, f"unknown memory tag(s) {unknown}; allowed: {', '.join(MEMORY_TAGS)}", "tags")
    return list(dict.fromkeys(tags))


def tensors_to_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as safetensors bytes: the wire form of ``update_weights_from_tensor``
    (no pickle, so a request body can never run code in the server)."""
    from safetensors.torch import save

    return save({name: t.detach().cpu().contiguous() for name, t in named})


def tensors_from_bytes(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`tensors_to_bytes`; RolloutError 400 if the bytes are not safetensors."""
    from safetensors.torch import load

    try:
        return list(load(bytes(data)).items())
    except Exception as exc:  # safetensors raises its own error types for corrupt input
        raise RolloutError(400, f"serialized_named_tensors: not a safetensors payload ({exc})",
                           "serialized_named_tensors") from None


class RolloutControl:
    """The rollout operations on one scheduler (see the module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.runner = scheduler.runner
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.paused_mode: str | None = None

    # -- pausing -------------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """Stop generating; ``mode`` decides what happens to the requests in flight."""
        if mode not in PAUSE_MODES:
            raise RolloutError(400, f"mode {mode!r}; allowed: {', '.join(PAUSE_MODES)}", "mode")
        s = self.s
        s.loop.drain()  # the forward in flight lands first: its tokens are kept
        affected = 0
        if mode == "abort":
            for rid in list(s.requests):
                affected += s.abort(rid, "generation paused (pause_generation mode abort)")
        elif mode == "retract":
            affected = retract_all(s)
        s.holds.add("paused")
        self.paused_mode = mode
        return {"success": True, "mode": mode, "num_affected_requests": affected}

    def continue_generation(self) -> dict[str, Any]:
        self.s.holds.discard("paused")
        self.paused_mode = None
        return {"success": True}

    def ready(self) -> bool:
        """An exclusive call can run now (no forward in flight, nothing running unless paused)."""
        s = self.s
        if s.loop.has_work():
            return False
        return "paused" in s.holds or (not s.running and s.chunked is None)

    # -- memory --------------------------------------------------------------------------------

    def release_memory(self, tags: Any = None) -> dict[str, Any]:
        tags = parse_tags(tags)
        s, runner = self.s, self.runner
        if not runner.memory_saver.releases_memory:
            raise RolloutError(400, "memory_saver.name is 'none': this server cannot release memory; "
                               "start it with memory_saver.name=auto (cpu on CPU, torch_memory_saver on CUDA)")
        if s.pd is not None and not runner.memory_saver.preserves_addresses:
            raise RolloutError(400, f"memory saver {runner.memory_saver.name!r} moves buffers on resume, which "
                               "the KV transfer backend has registered; releases are refused with disaggregation")
        if "kv_cache" in tags:
            if s.running or s.chunked is not None:
                raise RolloutError(409, "requests paused in place hold KV; pause with mode retract or abort "
                                   "before releasing kv_cache")
            if not s.kv.flush():  # its KV is stale after a release
                raise RolloutError(409, "the prefix cache is in use and cannot be flushed")
        runner.release_memory(tags)
        s.holds.add("released")
        return {"success": True, "released_tags": sorted(runner.released_tags)}

    def resume_memory(self, tags: Any = None) -> dict[str, Any]:
        tags = parse_tags(tags)
        self.runner.resume_memory(tags)
        if not self.runner.released_tags:
            self.s.holds.discard("released")
        return {"success": True, "released_tags": sorted(self.runner.released_tags)}

    # -- weights -------------------------------------------------------------------------------

    def _after_update(self, flush_cache: bool, version: str | None) -> dict[str, Any]:
        flushed = self.s.kv.flush() if flush_cache else False  # cached KV was computed with old weights
        if version is not None:
            self.runner.weight_version = version
        return {"success": True, "flushed_cache": flushed, "weight_version": self.runner.weight_version}

    def _weights_call(self, fn: Any, *args: Any) -> int:
        if "weights" in self.runner.released_tags:
            raise RolloutError(409, "the weights are released; resume them (tags: weights) before updating")
        try:
            return fn(*args)
        except WeightUpdateError as exc:
            raise RolloutError(400, str(exc), exc.name) from None

    def update_from_disk(self, model_path: str, flush_cache: bool = True,
                         weight_version: str | None = None) -> dict[str, Any]:
        count = self._weights_call(self.runner.weights.update_from_disk, model_path)
        self.runner.model_path = model_path
        out = self._after_update(flush_cache, weight_version)
        return {**out, "message": f"loaded {count} tensors from {model_path}", "num_tensors": count}

    def update_from_tensors(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool = True,
                            weight_version: str | None = None) -> dict[str, Any]:
        count = self._weights_call(self.runner.weights.update, named)
        return {**self._after_update(flush_cache, weight_version), "num_tensors": count}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str = "gloo",
                   timeout_s: float = 600.0) -> dict[str, Any]:
        """Join the trainer's weight-update group as rank ``rank_offset`` (blocks until all joined)."""
        if group_name in self.groups:
            raise RolloutError(409, f"weight update group {group_name!r} already exists", "group_name")
        try:
            self.groups[group_name] = WeightUpdateGroup(master_address, master_port, rank_offset, world_size,
                                                        group_name, backend, timeout_s)
        except ValueError as exc:
            raise RolloutError(400, str(exc)) from None
        except Exception as exc:  # rendezvous timeouts and connection errors
            raise RolloutError(503, f"could not join weight update group {group_name!r}: {exc}") from None
        return {"success": True, "message": f"joined {group_name} as rank {rank_offset} of {world_size}"}

    def destroy_group(self, group_name: str) -> dict[str, Any]:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise RolloutError(404, f"no weight update group {group_name!r}", "group_name")
        group.close()
        return {"success": True}

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str = "weight_update_group", flush_cache: bool = True,
                                weight_version: str | None = None) -> dict[str, Any]:
        """Receive the named tensors from the trainer's broadcast (rank 0), then apply them.

        Everything is received even when a name or shape is wrong, so the trainer's broadcast
        completes; the error then names the tensor and the served weights stay as they were."""
        group = self.groups.get(group_name)
        if group is None:
            raise RolloutError(400, f"no weight update group {group_name!r}; call init_weights_update_group",
                               "group_name")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RolloutError(400, "names, dtypes and shapes must have the same length", "names")
        try:
            specs = [([int(d) for d in shape], parse_dtype(dt)) for dt, shape in zip(dtypes, shapes, strict=True)]
        except (ValueError, TypeError) as exc:
            raise RolloutError(400, f"dtypes/shapes: {exc}", "dtypes") from None
        announced = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in specs)
        # Full tensors arrive (each rank keeps its shard): bound them by twice the whole model.
        whole_model = self.runner.weights.nbytes() * get_tensor_parallel().size
        if any(d < 0 for shape, _ in specs for d in shape) or announced > 2 * whole_model:
            raise RolloutError(400, f"shapes: {announced} bytes announced, more than twice the model's weights",
                               "shapes")
        buffers = [torch.empty(shape, dtype=dt) for shape, dt in specs]
        group.broadcast(buffers, src=0)
        return self.update_from_tensors(list(zip(names, buffers, strict=True)), flush_cache, weight_version)

    def get_weights(self, name: str, truncate_size: int = 100) -> list[float]:
        if "weights" in self.runner.released_tags:
            raise RolloutError(409, "the weights are released; resume them first")
        try:
            return self.runner.weights.get(name, truncate_size)
        except WeightUpdateError as exc:
            raise RolloutError(400, str(exc), exc.name) from None

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
