"""Built-in schedule policies: ``fcfs`` (first come, first served), ``lpm`` (longest prefix
match first, which groups requests sharing a cached prefix so the radix cache keeps hitting) and
``priority`` (the requests' ``priority`` field first, then arrival order)."""

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


@dataclass
class PriorityOptions:
    """Options of the priority policy."""

    low_values_first: bool = False
    """false (SGLang's default): a larger ``priority`` value is served first. true: a smaller one is
    (vLLM's order; SGLang's ``--schedule-low-priority-values-first``)."""
    default_priority: int = 0
    """The priority of a request that sends none."""


class PriorityPolicy(SchedulePolicy):
    """By ``priority`` (see :class:`PriorityOptions` for the direction), ties in arrival order.

    It orders the waiting queue only: running requests are not preempted for a higher priority
    arrival (SGLang's priority preemption is not implemented)."""

    uses_priority = True

    def __init__(self, options: PriorityOptions | None = None) -> None:
        self.options = options or PriorityOptions()

    def order(self, waiting: list[Any], prefix_len: Callable[[Any], int]) -> list[Any]:
        sign = 1 if self.options.low_values_first else -1
        default = self.options.default_priority

        def key(r: Any) -> tuple[int, float]:
            return (sign * (r.priority if r.priority is not None else default), r.arrival_time)

        return sorted(waiting, key=key)

    @classmethod
    def create(cls, options: PriorityOptions | None = None) -> PriorityPolicy:
        return cls(options)


@hookimpl
def register_schedule_policies(register) -> None:
    """Register fcfs, lpm and priority."""
    register("fcfs", FCFSPolicy.create, config=None)
    register("lpm", LPMPolicy.create, config=LPMOptions)
    register("priority", PriorityPolicy.create, config=PriorityOptions)
