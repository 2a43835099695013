"""Which PD side a scheduler runs with: the factory the ``Engine`` and the server pass to
:class:`~framework.scheduler.scheduler.Scheduler` (``pd_side=make_pd_side``)."""

from __future__ import annotations

from typing import Any

from framework.disaggregation.decode_side import DecodeSide
from framework.disaggregation.prefill_side import PrefillSide
from framework.scheduler.pd import PDSide


def make_pd_side(scheduler: Any) -> PDSide | None:
    """The scheduler's PD half for ``disaggregation.mode`` (None in unified mode). Combinations
    that cannot work (overlap with PD, a decode pool without pre-allocation) were refused when
    the config was resolved."""
    mode = scheduler.settings.disaggregation.mode
    if mode is None:
        return None
    return PrefillSide(scheduler) if mode.value == "prefill" else DecodeSide(scheduler)
