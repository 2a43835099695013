"""How the scheduler runs a step: a strategy with a declared interface.

``Scheduler.step()`` delegates to its :class:`StepLoop`: :class:`SyncLoop` (plan, prefill or
decode, sample, in that order) or :class:`~framework.scheduler.overlap.OverlapLoop` (the next
decode launched on a worker thread before the previous one's results are processed). A loop uses
only the scheduler's public API; the scheduler asks its loop only what this class declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from framework.scheduler.request import Req
    from framework.scheduler.scheduler import Scheduler


class StepLoop:
    """The synchronous parts every loop shares; subclasses implement :meth:`step`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def step(self) -> None:
        """Run one batch."""
        raise NotImplementedError

    def release(self, req: Req) -> None:
        """Release a finished request's KV (a loop with a forward in flight may defer it)."""
        self.sched.kv.release(req)

    def holders(self) -> list[Req]:
        """Finished requests whose KV the loop still holds (for the leak report)."""
        return []

    def has_work(self) -> bool:
        """Work of the loop's own (a forward in flight)."""
        return False

    def drain(self) -> None:
        """Land the forward in flight, if any (its tokens are applied); afterwards the scheduler's
        state is complete and nothing runs until the next :meth:`step`."""

    def close(self) -> None:
        """Finish what is in flight and stop any thread the loop owns."""


class SyncLoop(StepLoop):
    """One batch per step: the PD side's transfers, then a prefill batch if one can be formed
    (with the running requests' decode rows in it when the plan is a mixed step: see
    ``Scheduler.mixed_step_now``), else a decode step of the running batch."""

    def step(self) -> None:
        s = self.sched
        if s.pd is not None:
            s.pd.step()
        plan = s.plan_prefill()
        if plan.reqs and plan.mixed and s.run_prefill(plan.reqs, plan.chunked, mixed=True):
            return
        ran_prefill = bool(plan.reqs) and s.run_prefill(plan.reqs, plan.chunked)
        if not ran_prefill and s.running:
            s.run_decode()
