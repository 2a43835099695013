"""KV transfer with NIXL agents (UCX).

Each side creates an agent and registers its K and V buffers (DRAM on CPU, VRAM on a GPU); the
endpoints carry the agents' metadata (base64 in JSON), and each side loads the other's. The sender
posts one WRITE of every merged page run (descriptors from ``transfer_spans``) with a notification
that carries the room and the metadata (msgpack); the receiver completes a room when that
notification arrives, which NIXL delivers after the data. No thread of our own: the scheduler's
polls drive everything, and NIXL's progress thread moves the bytes.

A link that moves a head slice into whole token slots (a decode rank of a larger TP size) first
gathers the room's slices into a staging tensor laid out as the receiver's pages, registered for
the room's WRITE and deregistered with its handle, so a run of pages is one descriptor instead
of one per token slot.
"""

from __future__ import annotations

import base64
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from framework.disaggregation.addressing import (
    TransferSpan,
    check_compatible,
    check_pages,
    merge_page_runs,
    slice_slots,
    transfer_spans,
)
from framework.disaggregation.base import KVLayout, RoomTableBackend, TransferState, TransferTask

logger = logging.getLogger(__name__)


@dataclass
class NixlOptions:
    """Options of the ``nixl`` transfer backend."""

    backend: str = "UCX"
    """NIXL backend plugin that moves the bytes."""


class _Notif(msgspec.Struct, array_like=True):
    room: int
    metadata: bytes


class NixlTransferBackend(RoomTableBackend):
    """Transfer backend ``nixl``: one NIXL WRITE per room with a notification that carries the
    metadata; progress is driven by the schedulers' polls."""

    # link_error() is not implemented yet: a transfer to a dead peer fails at once (NIXL reports
    # the error per transfer), but nothing reports the link itself between transfers.
    conformance_optional = frozenset({"link_error_sender", "link_error_receiver"})

    def __init__(self, role: str, layout: KVLayout, options: NixlOptions) -> None:
        super().__init__(role, layout, options)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise RuntimeError("the nixl transfer backend needs `pip install plugserve[nixl]`") from exc
        self.name = f"plugserve-{role}-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[options.backend]))
        gpu = layout.device.startswith("cuda")
        self.mem_type = "VRAM" if gpu else "DRAM"
        self.dev_id = int(layout.device.partition(":")[2] or 0) if gpu else 0
        regs = [(p, layout.buffer_bytes, self.dev_id, "") for p in layout.ptrs]
        self._reg = self.agent.register_memory(self.agent.get_reg_descs(regs, self.mem_type))
        self._handles: dict[int, Any] = {}
        self._draining: dict[int, Any] = {}
        """Handles of released rooms whose WRITE was still in flight (``quiescent``)."""
        self._peer_name: str | None = None
        self._peer_layout: KVLayout | None = None
        self._staged: dict[int, tuple[torch.Tensor, Any]] = {}
        """Per room in flight: its gathered head slices and their registration."""

    @classmethod
    def create(cls, role: str, layout: KVLayout, options: NixlOptions | None = None) -> NixlTransferBackend:
        return cls(role, layout, options or NixlOptions())

    def endpoint(self) -> dict[str, Any]:
        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"agent": self.name, "agent_metadata": meta, "layout": self.layout.to_json()}

    def connect(self, peer: dict[str, Any]) -> None:
        self._peer_layout = KVLayout.from_json(peer["layout"])
        check_compatible(self.layout, self._peer_layout)
        self._peer_name = self.agent.add_remote_agent(base64.b64decode(peer["agent_metadata"]))

    # -- sender ----------------------------------------------------------------------------

    def send(self, room: int, src_pages: list[int], dst_pages: list[int], metadata: bytes) -> None:
        check_pages(self.layout, src_pages, "source")
        task = self.add_room(room)
        try:
            assert self._peer_name is not None and self._peer_layout is not None, "connect() first"
            spans = self._spans(room, src_pages, dst_pages)
            local = self.agent.get_xfer_descs([(s.src_addr, s.nbytes, self.dev_id) for s in spans], self.mem_type)
            remote = self.agent.get_xfer_descs([(s.dst_addr, s.nbytes, self.dev_id) for s in spans], self.mem_type)
            notif = msgspec.msgpack.encode(_Notif(room, metadata))
            handle = self.agent.initialize_xfer("WRITE", local, remote, self._peer_name, notif)
            state = self.agent.transfer(handle)
        except Exception as exc:
            self._unstage(room)
            task.fail(f"NIXL transfer could not start: {exc}")
            return
        task.advance(TransferState.transferring)
        self._handles[room] = handle
        if state == "ERR":
            task.fail("NIXL transfer failed to post")

    def _spans(self, room: int, src_pages: list[int], dst_pages: list[int]) -> list[TransferSpan]:
        """The room's descriptors: from the KV itself, or from a staging copy of its head slices
        when the receiver takes whole token slots (one descriptor per run, not per slot)."""
        lay, peer = self.layout, self._peer_layout
        assert peer is not None
        runs = merge_page_runs(src_pages, dst_pages)
        if lay.whole or not peer.whole or not lay.buffers:
            return transfer_spans(lay, peer, runs)
        check_compatible(lay, peer)
        check_pages(peer, dst_pages, "destination")
        page, cols = peer.bytes_per_page, slice(lay.slice_offset, lay.slice_offset + lay.moved_token_bytes)
        slots = torch.tensor(slice_slots(lay, [r.src_page + i for r in runs for i in range(r.num_pages)]))
        staging = torch.stack([buf.view(-1, lay.token_bytes)[slots, cols] for buf in lay.buffers]).view(-1)
        reg = self.agent.register_memory(self.agent.get_reg_descs([(staging.data_ptr(), staging.numel(),
                                                                   self.dev_id, "")], self.mem_type))
        self._staged[room] = (staging, reg)
        total, spans, done = len(src_pages), [], 0
        for r in runs:
            spans.extend(TransferSpan(i, staging.data_ptr() + (i * total + done) * page,
                                      peer.ptrs[i] + r.dst_page * page, r.num_pages * page)
                         for i in range(lay.num_buffers))
            done += r.num_pages
        return spans

    def _unstage(self, room: int) -> None:
        staged = self._staged.pop(room, None)
        if staged is not None:
            try:
                self.agent.deregister_memory(staged[1])
            except Exception:
                logger.debug("NIXL staging of room %d not deregistered", room, exc_info=True)

    def _progress_send(self, room: int, task: TransferTask) -> None:
        handle = self._handles.get(room)
        if handle is None or task.state.final:
            return
        state = self.agent.check_xfer_state(handle)
        if state == "DONE":
            task.advance(TransferState.success)
        elif state == "ERR":
            task.fail("NIXL transfer failed")
        else:
            return
        self._release_handle(room, self._handles.pop(room))

    # -- receiver --------------------------------------------------------------------------

    def expect(self, room: int, dst_pages: list[int]) -> None:
        check_pages(self.layout, dst_pages, "destination")
        self.add_room(room)

    def _drain_notifs(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            for raw in msgs:
                try:
                    n = msgspec.msgpack.decode(raw, type=_Notif)
                except msgspec.DecodeError:
                    logger.warning("dropping an undecodable NIXL notification")
                    continue
                with self._lock:
                    task = self._tasks.get(n.room)
                    if task is None or task.state.final:
                        continue
                    task.advance(TransferState.transferring)
                    self._metadata[n.room] = n.metadata
                    task.advance(TransferState.success)

    # -- both ------------------------------------------------------------------------------

    def poll(self, room: int) -> TransferTask:
        task = super().poll(room)
        if self.role == "prefill":
            self._progress_send(room, task)
            if self._draining:
                self._sweep_draining()
        elif not task.state.final:
            self._drain_notifs()
        return task

    def _xfer_done(self, handle: Any) -> bool:
        try:
            return self.agent.check_xfer_state(handle) != "PROC"
        except Exception:  # the agent is gone or broken: nothing moves any more
            return True

    def _release_handle(self, room: int, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            logger.debug("NIXL handle of room %d not released", room, exc_info=True)
        self._unstage(room)  # the WRITE has ended: its staging copy is no longer read

    def forget_room(self, room: int) -> None:
        handle = self._handles.pop(room, None)
        if handle is None:
            return
        if self._xfer_done(handle):
            self._release_handle(room, handle)
        else:
            self._draining[room] = handle  # NIXL still reads its pages: see quiescent

    def _sweep_draining(self) -> None:
        """Release the handles of released rooms whose WRITE has ended."""
        for room, handle in list(self._draining.items()):
            if self._xfer_done(handle):
                del self._draining[room]
                self._release_handle(room, handle)

    def quiescent(self, room: int) -> bool:
        """Sender: False while the room's WRITE is in flight (NIXL reads its source pages until the
        handle is done), whether the room failed (a timeout) or was released. Receiver: True, since
        the writes are the sender's and this side cannot see them."""
        live = self._handles.get(room)
        if live is not None and not self._xfer_done(live):
            return False
        self._sweep_draining()
        return room not in self._draining

    def close(self) -> None:
        """Release handles, forget the peer, deregister and drop the agent, in that order (UCX
        crashes at interpreter exit when an agent still holds them)."""
        agent, self.agent = self.agent, None
        if agent is None:
            return
        for handle in [*self._handles.values(), *self._draining.values()]:
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                logger.debug("NIXL handle release failed", exc_info=True)
        self._handles.clear()
        self._draining.clear()
        try:
            for _staging, reg in self._staged.values():
                agent.deregister_memory(reg)
            self._staged.clear()
            if self._peer_name is not None:
                agent.remove_remote_agent(self._peer_name)
            agent.deregister_memory(self._reg)
        except Exception:
            logger.debug("NIXL teardown failed", exc_info=True)
        del agent
