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
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from framework.disaggregation.heads import ModelIdentity

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

    def overdue(self, bootstrap_timeout_s: float, transfer_timeout_s: float, now: float | None = None) -> str | None:
        """Why the task has stayed too long in its state (None if it has not, or is final)."""
        if self.state.final:
            return None
        waited = (time.monotonic() if now is None else now) - self.since
        if self.state is TransferState.transferring:
            if waited > transfer_timeout_s:
                return f"KV transfer timed out after {transfer_timeout_s:g} s (room {self.room})"
        elif waited > bootstrap_timeout_s:
            return f"bootstrap timed out after {bootstrap_timeout_s:g} s in {self.state.value} (room {self.room})"
        return None

    def check_timeout(self, bootstrap_timeout_s: float, transfer_timeout_s: float, now: float | None = None) -> bool:
        """Fail the task if it stayed too long in its state; True if it is (now) failed."""
        error = self.overdue(bootstrap_timeout_s, transfer_timeout_s, now)
        if error is not None:
            self.fail(error)
        return self.state is TransferState.failed

    def follow(self, state: TransferState, error: str | None = None) -> None:
        """Catch up with ``state`` (agreed by the ranks), through the states in between; a state
        behind this one, or any after a final one, changes nothing."""
        if self.state.final or state is self.state:
            return
        if state is TransferState.failed:
            self.fail(error or "the KV transfer failed")
            return
        order = list(_NEXT)[:4]  # bootstrapping, waiting_for_input, transferring, success
        for nxt in order[order.index(self.state) + 1 : order.index(state) + 1]:
            self.advance(nxt)


@dataclass(frozen=True)
class KVLayout:
    """Where one server's KV pages live: per layer, the K then the V buffer.

    ``ptrs[2 * layer]`` is layer ``layer``'s K base address and ``ptrs[2 * layer + 1]`` its V base
    address; page ``p`` of buffer ``i`` starts at ``ptrs[i] + p * bytes_per_page``. ``buffers``
    (same order, flat uint8 views) is for backends that move tensors rather than raw addresses;
    it never leaves the process (``to_json`` drops it).

    A page holds ``page_size`` token slots of ``token_bytes`` each (``heads`` KV heads side by
    side). A link between ranks of different TP sizes moves only some heads: ``slice_offset`` and
    ``slice_bytes`` say which bytes of each token slot (0 bytes: all of them, whole pages).
    ``identity`` is the model the KV belongs to; two layouts with identities are compatible only
    when the identities are equal.
    """

    ptrs: tuple[int, ...]
    bytes_per_page: int
    num_pages: int
    """Pages per buffer including the padding page 0 (valid page indices: 0 .. num_pages - 1)."""
    device: str = "cpu"
    buffers: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)
    page_size: int = 0
    """Token slots per page (0: not described; only whole pages can move)."""
    heads: int = 0
    """KV heads per token slot on this rank (0: not described)."""
    slice_offset: int = 0
    slice_bytes: int = 0
    """Bytes of each token slot a link moves, from ``slice_offset`` (0: the whole slot)."""
    identity: ModelIdentity | None = None

    @classmethod
    def from_cache(cls, cache: Any, identity: ModelIdentity | None = None) -> KVLayout:
        """The layout of a ``framework.memory.kv_cache.KVCache``."""
        k_ptrs, v_ptrs = cache.buffer_pointers()
        ptrs = tuple(p for pair in zip(k_ptrs, v_ptrs, strict=True) for p in pair)
        bufs = tuple(
            b.view(-1).view(torch.uint8)
            for pair in zip(cache.k_buffers, cache.v_buffers, strict=True)
            for b in pair
        )
        return cls(ptrs, cache.bytes_per_page, cache.num_pages + 1, str(cache.device), bufs,
                   page_size=cache.page_size, heads=cache.num_kv_heads, identity=identity)

    @property
    def num_buffers(self) -> int:
        return len(self.ptrs)

    @property
    def buffer_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot in one buffer (all of this rank's heads)."""
        return self.bytes_per_page // self.page_size if self.page_size else self.bytes_per_page

    @property
    def moved_token_bytes(self) -> int:
        """Bytes of each token slot a transfer moves."""
        return self.slice_bytes or self.token_bytes

    @property
    def whole(self) -> bool:
        """True when a transfer moves whole pages (contiguous runs), not head slices."""
        return self.slice_bytes in (0, self.token_bytes)

    def sliced(self, head_start: int, head_end: int) -> KVLayout:
        """This layout moving only local heads ``[head_start, head_end)`` of each token slot."""
        if not self.heads or not self.page_size:
            raise ValueError("a head slice needs a layout that describes its heads and page size")
        if not 0 <= head_start < head_end <= self.heads:
            raise ValueError(f"heads [{head_start}, {head_end}) are not within this rank's {self.heads}")
        head_bytes = self.token_bytes // self.heads
        return replace(self, slice_offset=head_start * head_bytes, slice_bytes=(head_end - head_start) * head_bytes)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"ptrs": list(self.ptrs), "bytes_per_page": self.bytes_per_page,
                                "num_pages": self.num_pages, "device": self.device, "page_size": self.page_size,
                                "heads": self.heads, "slice_offset": self.slice_offset,
                                "slice_bytes": self.slice_bytes}
        if self.identity is not None:
            data["identity"] = self.identity.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVLayout:
        identity = data.get("identity")
        return cls(tuple(int(p) for p in data["ptrs"]), int(data["bytes_per_page"]),
                   int(data["num_pages"]), str(data.get("device", "cpu")), page_size=int(data.get("page_size", 0)),
                   heads=int(data.get("heads", 0)), slice_offset=int(data.get("slice_offset", 0)),
                   slice_bytes=int(data.get("slice_bytes", 0)),
                   identity=None if identity is None else ModelIdentity.from_json(identity))


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
