"""Fault injection for plugserve's tests, as a third-party plugin: ``nccl_stalling``, the
``nccl`` transfer backend with a link that stalls for chosen rooms, and ``slow_steps``, a logit
processor that makes the steps of the requests naming it slow.

A room in ``stall_rooms`` pauses ``stall_s`` after its first layer buffer's pages went out, while
the receiver is mid-write: what a stalled or congested link does. The fault tests select it with
``disaggregation.transfer_backend=nccl_stalling`` and
``disaggregation.transfer_options.stall_rooms=[...]``; the production backend carries no test hook.
``slow_steps`` (``custom_logit_processor``, with ``server.enable_custom_logit_processor=true``)
keeps a request generating for as long as a test needs, on a fast host as on a slow one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from framework.disaggregation.base import KVLayout
from framework.hookspecs import Register, hookimpl
from plugins.transfer.nccl.backend import NcclOptions, NcclTransferBackend


@dataclass
class StallingNcclOptions(NcclOptions):
    """``nccl``'s options plus the rooms that stall and for how long."""

    stall_rooms: list[int] = field(default_factory=list)
    stall_s: float = 0.0


class StallingNcclTransferBackend(NcclTransferBackend):
    """``nccl`` whose sender stalls after the first layer buffer of a room in ``stall_rooms``."""

    def __init__(self, role: str, layout: KVLayout, options: StallingNcclOptions) -> None:
        super().__init__(role, layout, options)
        self.stall_rooms = set(options.stall_rooms)
        self.stall_s = options.stall_s
        self._stall_next_buffer = False

    @classmethod
    def create(cls, role: str, layout: KVLayout,
               options: StallingNcclOptions | None = None) -> StallingNcclTransferBackend:
        return cls(role, layout, options or StallingNcclOptions())

    def _send_room(self, room: int, runs: list[tuple[int, int, int]], metadata: bytes) -> None:
        self._stall_next_buffer = room in self.stall_rooms
        super()._send_room(room, runs, metadata)

    def _p2p(self, tensor: torch.Tensor, send: bool) -> None:
        # The header, the page runs and the metadata go out as single tensors: never stalled here.
        NcclTransferBackend._p2p_many(self, [tensor], send)

    def _p2p_many(self, tensors: list[torch.Tensor], send: bool) -> None:
        """A layer buffer's pages (``_send_room`` sends each buffer's runs in one call)."""
        super()._p2p_many(tensors, send)
        if send and self._stall_next_buffer:  # the first buffer's pages are out: stall mid-room
            self._stall_next_buffer = False
            time.sleep(self.stall_s)


@hookimpl
def register_transfer_backends(register: Register) -> None:
    """Register ``nccl_stalling`` (tests only)."""
    register("nccl_stalling", StallingNcclTransferBackend.create, config=StallingNcclOptions)


@dataclass
class SlowStepsParams:
    """``custom_params`` of ``slow_steps``."""

    sleep_s: float = 0.0
    """How long each decode step that samples for this request waits (0 to 1 s)."""

    def __post_init__(self) -> None:
        if not isinstance(self.sleep_s, (int, float)) or not 0 <= self.sleep_s <= 1:
            raise ValueError(f"sleep_s must be a number of seconds in [0, 1], got {self.sleep_s!r}")


class SlowSteps:
    """A logit processor that leaves the logits alone and waits: a request that names it keeps
    every step it is part of at least ``sleep_s`` long, whatever the host's speed, so a test can
    know it is still generating (the drain tests need requests that outlast the grace period)."""

    def __call__(self, logits: torch.Tensor, params: list[dict | None], output_ids: list[list[int]]) -> torch.Tensor:
        time.sleep(max(float((p or {}).get("sleep_s", 0.0)) for p in params))
        return logits


@hookimpl
def register_logit_processors(register: Register) -> None:
    """Register ``slow_steps`` (tests only)."""
    register("slow_steps", SlowSteps, config=SlowStepsParams)
