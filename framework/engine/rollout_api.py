"""The Engine's RL methods, with SGLang's names: what an RL framework calls between rollouts.

They run on the caller's thread between two steps. Calls that need the model to themselves first
step the engine until the running requests have finished (no new prefill starts meanwhile), unless
generation is paused. Refusals raise :class:`~framework.scheduler.rollout.RolloutError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from framework.scheduler.scheduler import Scheduler

T = TypeVar("T")


class RolloutMethods:
    """Mixed into :class:`~framework.engine.engine.Engine` (which provides ``scheduler``, ``step``)."""

    scheduler: Scheduler
    step: Callable[[], Any]

    def _when_free(self, fn: Callable[..., T], *args: Any) -> T:
        s = self.scheduler
        s.hold_admission = True
        try:
            while not s.rollout.ready():
                self.step()
        finally:
            s.hold_admission = False
        return fn(*args)

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Stop generating: ``abort`` the requests in flight, ``retract`` them (recomputed after
        :meth:`continue_generation`) or hold them ``in_place``."""
        return self.scheduler.rollout.pause(mode)

    def continue_generation(self) -> dict[str, Any]:
        return self.scheduler.rollout.continue_generation()

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free ``weights``, ``kv_cache`` and/or ``cuda_graph`` memory (all when ``tags`` is None)."""
        return self._when_free(self.scheduler.rollout.release_memory, tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._when_free(self.scheduler.rollout.resume_memory, tags)

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> dict[str, Any]:
        """Load a new checkpoint of the same architecture in place; the prefix cache is flushed."""
        return self._when_free(self.scheduler.rollout.update_from_disk, model_path, flush_cache, weight_version)

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict[str, Any]:
        """Write HF-named tensors into the served weights (all checked first: a bad name or shape
        raises and nothing changes)."""
        return self._when_free(self.scheduler.rollout.update_from_tensors, list(named_tensors), flush_cache,
                               weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  timeout_s: float = 600.0) -> dict[str, Any]:
        """Join a trainer's weight-update group (blocks until every rank joined)."""
        return self.scheduler.rollout.init_group(master_address, master_port, rank_offset, world_size, group_name,
                                                 backend, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None) -> dict[str, Any]:
        """Receive the named tensors from the group's rank 0 and apply them."""
        return self._when_free(self.scheduler.rollout.update_from_distributed, names, dtypes, shapes, group_name,
                               flush_cache, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return self.scheduler.rollout.destroy_group(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of a weight, by its Hugging Face name."""
        return self.scheduler.rollout.get_weights(name, truncate_size)
