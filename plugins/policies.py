"""Built-in schedule policies: ``fcfs`` (first come, first served) and ``lpm`` (longest prefix
match first, which groups requests sharing a cached prefix so the radix cache keeps hitting)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.hookspecs import hookimpl
from framework.scheduler.policy import SchedulePolicy


class FCFSPolicy(SchedulePolicy):
    """Arrival order."""

    def order(self, waiting: list[Any], prefix_len: Callable[[Any], int]) -> list[Any]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    @classmethod
    def create(cls, options: Any = None) -> FCFSPolicy:
        return cls()


@dataclass
class LPMOptions:
    """Options of the longest-prefix-match policy."""

    max_queue_for_matching: int = 128
    """Above this many waiting requests, matching every one costs more than it saves: use fcfs."""


class LPMPolicy(SchedulePolicy):
    """Longest cached prefix first; ties in arrival order."""

    def __init__(self, options: LPMOptions | None = None) -> None:
        self.options = options or LPMOptions()

    def order(self, waiting: list[Any], prefix_len: Callable[[Any], int]) -> list[Any]:
        if len(waiting) > self.options.max_queue_for_matching:
            return sorted(waiting, key=lambda r: r.arrival_time)
        matched = {id(r): prefix_len(r) for r in waiting}
        return sorted(waiting, key=lambda r: (-matched[id(r)], r.arrival_time))

    @classmethod
    def create(cls, options: LPMOptions | None = None) -> LPMPolicy:
        return cls(options)


@hookimpl
def register_schedule_policies(register) -> None:
    """Register fcfs and lpm."""
    register("fcfs", FCFSPolicy.create, config=None)
    register("lpm", LPMPolicy.create, config=LPMOptions)
