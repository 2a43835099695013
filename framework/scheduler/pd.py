"""The seam between the scheduler and prefill/decode disaggregation.

The scheduler never imports ``framework.disaggregation``: whoever builds it (the ``Engine``, the
server's scheduler process) passes a factory that returns the :class:`PDSide` for the configured
``disaggregation.mode``, and the scheduler calls the side only through this protocol. The sides in
turn use only the scheduler's public API (``finish``, ``emit``, ``sample``, ``start_decoding``,
the ``kv`` manager) - see :class:`framework.scheduler.scheduler.Scheduler`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from framework.scheduler.request import Req
    from framework.scheduler.scheduler import Scheduler


class PDSide(Protocol):
    """One server's half of PD disaggregation, as the scheduler drives it."""

    def admit(self, req: Req) -> bool:
        """Check the request's PD fields (raise ``ValueError`` to refuse it). True: the side
        queues it itself and it never enters the waiting queue (decode); False: it is prefilled
        like any other request (prefill)."""

    def step(self) -> None:
        """Advance transfers (called at the start of every scheduler step)."""

    def on_prefilled(self, reqs: list[Req], logits: torch.Tensor) -> bool:
        """The prefill of ``reqs`` is complete (``logits``: one row each). True: the side took
        them (a prefill server samples the first token and ships the KV); False: the scheduler
        samples them into its running batch as usual."""

    def abort(self, req: Req, message: str) -> bool:
        """Abort a request the side holds; False if it holds none by that object."""

    def has_work(self) -> bool:
        """Requests in transfer or reservations still held: the scheduler keeps stepping."""

    def holders(self) -> list[Any]:
        """What holds KV outside the running batch (requests in transfer, quarantined
        reservations), for the leak report: each has ``req_pool_idx``, ``kv_len``,
        ``prefix_len``."""

    def close(self) -> None:
        """Stop the transfer backend and the bootstrap connections."""


PDSideFactory = Callable[["Scheduler"], "PDSide | None"]
"""Builds the side for the scheduler's ``disaggregation.mode`` (None in unified mode)."""
