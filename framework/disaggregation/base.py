"""The KV transfer plugin interface and the per-request transfer state machine.

A transfer backend moves the KV pages of one request (a *room*, named by the router's
``bootstrap_room``) from a prefill server (role ``prefill``, the sender) to a decode server (role
``decode``, the receiver), together with a small metadata blob (the first sampled token and its
logprob, msgpack-encoded by the caller). The backend only moves bytes; the bootstrap service and
the schedulers decide which pages go where.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

ROLES = ("prefill", "decode")


class TransferState(Enum):
    """Where one request's transfer stands; ``success`` and ``failed`` are final."""

    bootstrapping = "bootstrapping"
    """Finding the peer (its endpoint is not registered yet)."""
    waiting_for_input = "waiting_for_input"
    """Peer known; waiting for the other side (sender: the destination pages; receiver: the data)."""
    transferring = "transferring"
    success = "success"
    failed = "failed"

    @property
    def final(self) -> bool:
        return self in (TransferState.success, TransferState.failed)


_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.bootstrapping: frozenset({TransferState.waiting_for_input, TransferState.failed}),
    TransferState.waiting_for_input: frozenset({TransferState.transferring, TransferState.failed}),
    TransferState.transferring: frozenset({TransferState.success, TransferState.failed}),
    TransferState.success: frozenset(),
    TransferState.failed: frozenset(),
}


class TransferStateError(RuntimeError):
    """An illegal state transition (a bug in a backend or a scheduler)."""


@dataclass
class TransferTask:
    """One request's transfer: its state, when it entered it, and why it failed.

    The bootstrap timeout covers ``bootstrapping`` and ``waiting_for_input``; the transfer timeout
    covers ``transferring``. ``check_timeout`` moves an overdue task to ``failed``.
    """

    room: int
    state: TransferState = TransferState.bootstrapping
    error: str | None = None
    since: float = field(default_factory=time.monotonic)

    def advance(self, state: TransferState, error: str | None = None) -> None:
        if state is self.state and not state.final:
            return
        if state not in _NEXT[self.state]:
            raise TransferStateError(f"room {self.room}: illegal transition {self.state.value} -> {state.value}")
        self.state = state
        self.since = time.monotonic()
        if state is TransferState.failed:
            self.error = error or "the KV transfer failed"

    def fail(self, error: str) -> None:
        """Move to ``failed`` unless already final (a late failure after success is ignored)."""
        if not self.state.final:
            self.advance(TransferState.failed, error)

    def check_timeout(self, bootstrap_timeout_s: float, transfer_timeout_s: float, now: float | None = None) -> bool:
        """Fail the task if it stayed too long in its state; True if it is (now) failed."""
        if self.state.final:
            return self.state is TransferState.failed
        waited = (time.monotonic() if now is None else now) - self.since
        if self.state is TransferState.transferring:
            if waited > transfer_timeout_s:
                self.fail(f"KV transfer timed out after {transfer_timeout_s:g} s (room {self.room})")
        elif waited > bootstrap_timeout_s:
            self.fail(f"bootstrap timed out after {bootstrap_timeout_s:g} s in {self.state.value} (room {self.room})")
        return self.state is TransferState.failed


@dataclass(frozen=True)
class KVLayout:
    """Where one server's KV pages live: per layer, the K then the V buffer.

    ``ptrs[2 * layer]`` is layer ``layer``'s K base address and ``ptrs[2 * layer + 1]`` its V base
    address; page ``p`` of buffer ``i`` starts at ``ptrs[i] + p * bytes_per_page``. ``buffers``
    (same order, flat uint8 views) is for backends that move tensors rather than raw addresses;
    it never leaves the process (``to_json`` drops it).
    """

    ptrs: tuple[int, ...]
    bytes_per_page: int
    num_pages: int
    """Pages per buffer including the padding page 0 (valid page indices: 0 .. num_pages - 1)."""
    device: str = "cpu"
    buffers: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_cache(cls, cache: Any) -> KVLayout:
        """The layout of a ``framework.memory.kv_cache.KVCache``."""
        k_ptrs, v_ptrs = cache.buffer_pointers()
        ptrs = tuple(p for pair in zip(k_ptrs, v_ptrs, strict=True) for p in pair)
        bufs = tuple(
            b.view(-1).view(torch.uint8)
            for pair in zip(cache.k_buffers, cache.v_buffers, strict=True)
            for b in pair
        )
        return cls(ptrs, cache.bytes_per_page, cache.num_pages + 1, str(cache.device), bufs)

    @property
    def num_buffers(self) -> int:
        return len(self.ptrs)

    @property
    def buffer_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def to_json(self) -> dict[str, Any]:
        return {"ptrs": list(self.ptrs), "bytes_per_page": self.bytes_per_page,
                "num_pages": self.num_pages, "device": self.device}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVLayout:
        return cls(tuple(int(p) for p in data["ptrs"]), int(data["bytes_per_page"]),
                   int(data["num_pages"]), str(data.get("device", "cpu")))


class TransferBackend(ABC):
    """A KV transfer plugin: one object per server process, in the role ``prefill`` (sender) or
    ``decode`` (receiver).

    Lifecycle: ``endpoint()`` (JSON registered with the bootstrap service) -> ``connect(peer)``
    with the other side's endpoint -> per room, the sender calls ``send`` and the receiver
    ``expect`` -> both ``poll`` until the state is final -> ``release``. ``close`` ends it all.
    Calls come from the scheduler thread; backends may move bytes on their own threads.
    """

    conformance_optional: frozenset[str] = frozenset()
    """Checks of the transfer conformance kit (``framework.testing.transfer_conformance``) this
    backend declares it cannot pass, with the reason in a comment where it is set: e.g. a
    transport that only notices a dead peer through transfer timeouts declares
    ``{"link_error_sender", "link_error_receiver"}``. ``roundtrip`` can never be optional."""

    def __init__(self, role: str, layout: KVLayout, options: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.layout = layout
        self.options = options

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """What the peer needs to reach this side (JSON-serialisable)."""

    @abstractmethod
    def connect(self, peer: dict[str, Any]) -> None:
        """Start talking to the peer whose ``endpoint()`` is ``peer`` (may finish asynchronously)."""

    @abstractmethod
    def send(self, room: int, src_pages: list[int], dst_pages: list[int], metadata: bytes) -> None:
        """Sender: ship ``src_pages`` into the receiver's ``dst_pages``, then ``metadata``."""

    @abstractmethod
    def expect(self, room: int, dst_pages: list[int]) -> None:
        """Receiver: ``dst_pages`` are reserved for ``room``; data may arrive from now on."""

    @abstractmethod
    def poll(self, room: int) -> TransferTask:
        """The room's task (its state; ``error`` when failed)."""

    @abstractmethod
    def metadata(self, room: int) -> bytes | None:
        """Receiver: the metadata that arrived with the pages (after ``success``)."""

    @abstractmethod
    def release(self, room: int) -> None:
        """Forget the room (after its final state; its pages are the caller's again). Releasing
        an unknown room is a no-op."""

    def quiescent(self, room: int) -> bool:
        """False while the backend may still touch the room's pages (the sender reading its
        source pages, the receiver writing its destination pages), even after the room failed
        or was released. The schedulers keep such pages out of reuse until it turns True.
        Backends that cannot tell answer True (no quarantine)."""
        return True

    def link_error(self) -> str | None:
        """Why the link to the peer is gone for good (the peer died or closed it), or None while
        it is usable or the backend cannot tell. The schedulers then build a fresh backend."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Stop threads and free transport resources."""


class RoomTableBackend(TransferBackend):
    """A :class:`TransferBackend` with the per-room bookkeeping every transport needs: each room's
    task and the metadata that arrived with it, under one lock (transports complete rooms on their
    own threads), and ``poll`` / ``metadata`` / ``release`` over them.

    Subclasses add rooms with :meth:`add_room`, record arrived metadata in ``self._metadata`` under
    ``self._lock``, and drop their own per-room state in :meth:`forget_room`. A transport whose
    worker thread moves one room at a time sets ``self._busy_room`` (under the lock) while it
    touches that room's pages; :meth:`quiescent` answers from it.
    """

    def __init__(self, role: str, layout: KVLayout, options: Any) -> None:
        super().__init__(role, layout, options)
        self._lock = threading.Lock()
        self._tasks: dict[int, TransferTask] = {}
        self._metadata: dict[int, bytes] = {}
        self._busy_room: int | None = None
        """The room whose pages the transport's worker is reading or writing right now."""

    def add_room(self, room: int, state: TransferState = TransferState.waiting_for_input) -> TransferTask:
        """Start tracking ``room`` (replacing any earlier task of the same number)."""
        task = TransferTask(room, state)
        with self._lock:
            self._tasks[room] = task
        return task

    def poll(self, room: int) -> TransferTask:
        with self._lock:
            task = self._tasks.get(room)
        if task is None:
            raise KeyError(f"unknown room {room}")
        return task

    def metadata(self, room: int) -> bytes | None:
        with self._lock:
            return self._metadata.get(room)

    def release(self, room: int) -> None:
        with self._lock:
            task = self._tasks.pop(room, None)
            if task is not None:
                task.fail("released")  # work still queued for it sees a final task and skips it
            self._metadata.pop(room, None)
            self.forget_room(room)

    def quiescent(self, room: int) -> bool:
        """False while the worker is on this room (``self._busy_room``), even after the room failed or
        was released; a room still queued when released is skipped, so it is quiescent."""
        with self._lock:
            return self._busy_room != room

    def forget_room(self, room: int) -> None:  # noqa: B027 - optional
        """Drop the transport's own state of a released room (called with ``self._lock`` held)."""
