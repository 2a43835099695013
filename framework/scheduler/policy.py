"""The schedule-policy interface: how the waiting queue is ordered before each prefill round."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class SchedulePolicy(ABC):
    """Orders waiting requests; registered by name through ``register_schedule_policies``."""

    uses_priority: bool = False
    """True for a policy that orders by the requests' ``priority``. The server refuses a non-zero
    ``priority`` unless the policy declares this (a priority that silently does nothing misleads)."""

    @abstractmethod
    def order(self, waiting: list[Any], prefix_len: Callable[[Any], int]) -> list[Any]:
        """Return the waiting requests in the order prefill should consider them.

        ``prefix_len(req)`` gives the number of the request's tokens already in the prefix cache
        (it runs a radix match, so call it only if the policy needs it). Requests have
        ``arrival_time``, ``rid`` and ``priority`` (an int, or None when the client sent none).
        """
