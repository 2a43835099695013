"""KV transfer with Mooncake's TransferEngine.

Each side starts a TransferEngine (``P2PHANDSHAKE`` metadata: peers find each other by
``host:rpc_port``, no metadata server) and registers its K and V buffers. The sender writes each
merged page run straight into the receiver's registered memory (``batch_transfer_sync_write``:
source addresses, destination addresses and lengths from ``transfer_spans``), then pushes a
completion notice with the metadata over zmq (``plugins.transfer.notify``).

A link between servers of different TP sizes moves a head slice of each token slot. Where the
receiver takes whole slots (a decode rank of a larger TP size), the sender first gathers the slice
of each page into a registered staging buffer laid out as the receiver's pages, so a run of pages
is one write again instead of one per token slot (``staging_mb``). Where the receiver takes a
slice of its slots, the writes stay strided (one per token slot): a one-sided write cannot scatter.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from framework.disaggregation.addressing import (
    PageRun,
    TransferSpan,
    check_compatible,
    check_pages,
    merge_page_runs,
    slice_slots,
    transfer_spans,
)
from framework.disaggregation.base import KVLayout, RoomTableBackend, TransferState
from plugins.transfer.notify import Notice, NoticeReceiver, NoticeSender

logger = logging.getLogger(__name__)


@dataclass
class MooncakeOptions:
    """Options of the ``mooncake`` transfer backend."""

    hostname: str = "127.0.0.1"
    """This host's address as the peer reaches it."""
    protocol: str = "tcp"
    """Mooncake transport: tcp (any machine) or rdma (needs RDMA NICs and device_name)."""
    device_name: str = ""
    """RDMA device(s), e.g. mlx5_0 (empty for tcp)."""
    metadata_server: str = "P2PHANDSHAKE"
    """P2PHANDSHAKE exchanges segment metadata directly between peers."""
    max_batch_size: int = 2048
    """Most spans per ``batch_transfer_sync_write`` call: Mooncake 0.3.13 answers -1 to a batch of
    more than 2048 entries, which a fragmented room (pages x layers x K/V) easily exceeds."""
    staging_mb: int = 64
    """Registered staging buffer (MiB) of a sender whose link moves a head slice into whole token
    slots: the slices are gathered there so each run of pages is one write; 0 writes one span
    per token slot instead."""


class MooncakeTransferBackend(RoomTableBackend):
    """Transfer backend ``mooncake``: one-sided writes into the decode side's registered KV memory,
    one room at a time on a sender thread (its ``_busy_room``: the sender is quiescent once it has
    moved on), then a zmq notice per room. The receiver cannot see the writes: always quiescent."""

    # Mooncake's TCP transport reports no broken peer to us: a dead decode server shows up as
    # rooms that stay "transferring" until the scheduler's transfer timeout fails them.
    conformance_optional = frozenset({"link_error_sender", "link_error_receiver"})

    def __init__(self, role: str, layout: KVLayout, options: MooncakeOptions) -> None:
        super().__init__(role, layout, options)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "the mooncake transfer backend needs `pip install plugserve[mooncake]` "
                "(mooncake-transfer-engine-non-cuda on CPU) and Debian's libibverbs1"
            ) from exc
        self.engine = TransferEngine()
        ret = self.engine.initialize(options.hostname, options.metadata_server, options.protocol,
                                     options.device_name)
        if ret != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({ret})")
        self.session = f"{options.hostname}:{self.engine.get_rpc_port()}"
        for ptr in layout.ptrs:
            if self.engine.register_memory(ptr, layout.buffer_bytes) != 0:
                raise RuntimeError("Mooncake register_memory failed")
        self._peer: dict[str, Any] | None = None
        self._receiver = NoticeReceiver(options.hostname, self._on_notice) if role == "decode" else None
        self._outbox: queue.Queue[tuple[int, list[int], list[int], bytes] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._staging: torch.Tensor | None = None

    @classmethod
    def create(cls, role: str, layout: KVLayout, options: MooncakeOptions | None = None) -> MooncakeTransferBackend:
        return cls(role, layout, options or MooncakeOptions())

    def endpoint(self) -> dict[str, Any]:
        ep: dict[str, Any] = {"session": self.session, "layout": self.layout.to_json()}
        if self._receiver is not None:
            ep["notify"] = self._receiver.address
        return ep

    def connect(self, peer: dict[str, Any]) -> None:
        peer_layout = KVLayout.from_json(peer["layout"])
        check_compatible(self.layout, peer_layout)
        self._peer = peer
        staged = not self.layout.whole and peer_layout.whole and self.layout.buffers
        if self.role == "prefill" and staged and self.options.staging_mb > 0 and self._staging is None:
            staging = torch.empty(self.options.staging_mb << 20, dtype=torch.uint8)
            if self.engine.register_memory(staging.data_ptr(), staging.numel()) != 0:
                raise RuntimeError("Mooncake register_memory of the staging buffer failed")
            self._staging = staging
        if self.role == "prefill" and self._worker is None:
            self._worker = threading.Thread(target=self._send_loop, name="pd-mooncake-send", daemon=True)
            self._worker.start()

    # -- sender ----------------------------------------------------------------------------

    def send(self, room: int, src_pages: list[int], dst_pages: list[int], metadata: bytes) -> None:
        check_pages(self.layout, src_pages, "source")
        self.add_room(room).advance(TransferState.transferring)
        self._outbox.put((room, src_pages, dst_pages, metadata))

    def _send_loop(self) -> None:
        assert self._peer is not None
        notices = NoticeSender(self._peer["notify"])
        peer_layout = KVLayout.from_json(self._peer["layout"])
        try:
            while (item := self._outbox.get()) is not None:
                room, src, dst, metadata = item
                with self._lock:
                    task = self._tasks.get(room)
                    if task is None or task.state.final:
                        continue  # released or failed before its turn: its pages are not read
                    self._busy_room = room
                error = None
                try:
                    runs = merge_page_runs(src, dst)
                    if self._staging is not None:
                        error = self._write_staged(runs, peer_layout)
                    else:
                        error = self._write(transfer_spans(self.layout, peer_layout, runs))
                except Exception as exc:  # a broken peer must fail the room, not the thread
                    error = f"Mooncake transfer failed: {exc}"
                notices.send(Notice(room, error is None, metadata if error is None else b"", error))
                with self._lock:
                    self._busy_room = None
                    if error is None:
                        if not task.state.final:
                            task.advance(TransferState.success)
                    else:
                        task.fail(error)
        finally:
            notices.close()

    def _write(self, spans: list[TransferSpan]) -> str | None:
        """Write the spans in batches of at most ``max_batch_size``; the error, or None."""
        step = max(1, self.options.max_batch_size)
        for i in range(0, len(spans), step):
            batch = spans[i : i + step]
            ret = self.engine.batch_transfer_sync_write(
                self._peer["session"], [s.src_addr for s in batch], [s.dst_addr for s in batch],
                [s.nbytes for s in batch],
            )
            if ret < 0:
                return f"Mooncake batch_transfer_sync_write failed ({ret}, {len(batch)} spans)"
        return None

    def _write_staged(self, runs: list[PageRun], peer: KVLayout) -> str | None:
        """Gather this side's head slice of as many pages as the staging buffer holds (laid out
        as the receiver's whole pages, buffer by buffer), write each run from there, repeat."""
        assert self._staging is not None
        lay = self.layout
        check_compatible(lay, peer)
        for r in runs:
            check_pages(peer, range(r.dst_page, r.dst_page + r.num_pages), "destination")
        page = peer.bytes_per_page  # one page of the slice = one whole page of the receiver
        room = max(1, self._staging.numel() // (page * lay.num_buffers))
        cols = slice(lay.slice_offset, lay.slice_offset + lay.moved_token_bytes)
        pieces = [PageRun(r.src_page + i, r.dst_page + i, min(room, r.num_pages - i))
                  for r in runs for i in range(0, r.num_pages, room)]
        while pieces:
            chunk, total = [], 0
            while pieces and total + pieces[0].num_pages <= room:
                chunk.append(pieces.pop(0))
                total += chunk[-1].num_pages
            pages = [r.src_page + i for r in chunk for i in range(r.num_pages)]
            slots = torch.tensor(slice_slots(lay, pages), dtype=torch.int64)
            out = self._staging[: lay.num_buffers * total * page].view(lay.num_buffers, -1, lay.moved_token_bytes)
            for i, buf in enumerate(lay.buffers):
                torch.index_select(buf.view(-1, lay.token_bytes)[:, cols], 0, slots, out=out[i])
            base, spans, done = self._staging.data_ptr(), [], 0
            for r in chunk:
                spans.extend(TransferSpan(i, base + (i * total + done) * page, peer.ptrs[i] + r.dst_page * page,
                                          r.num_pages * page) for i in range(lay.num_buffers))
                done += r.num_pages
            error = self._write(spans)
            if error is not None:
                return error
        return None

    # -- receiver --------------------------------------------------------------------------

    def expect(self, room: int, dst_pages: list[int]) -> None:
        check_pages(self.layout, dst_pages, "destination")
        self.add_room(room)

    def _on_notice(self, notice: Notice) -> None:
        with self._lock:
            task = self._tasks.get(notice.room)
            if task is None or task.state.final:
                return
            if notice.ok:
                task.advance(TransferState.transferring)
                self._metadata[notice.room] = notice.metadata
                task.advance(TransferState.success)
            else:
                task.fail(notice.error or "the sender reported a failed transfer")

    # -- both ------------------------------------------------------------------------------

    def close(self) -> None:
        self._outbox.put(None)
        if self._worker is not None:
            self._worker.join(timeout=10)
        if self._staging is not None:
            self.engine.unregister_memory(self._staging.data_ptr())
        if self._receiver is not None:
            self._receiver.close()
