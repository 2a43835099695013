"""KV transfer over a two-rank torch.distributed process group (prefill = rank 0, decode = rank 1).

The prefill side hosts the rendezvous store (its address is in its bootstrap endpoint); the decode
side joins it on ``connect``. Both then hold one process group (gloo when the KV lives on the CPU,
NCCL on a GPU) that carries, per room and in order, from sender to receiver:

1. a header ``int64[4]``: room, number of page runs, metadata length, protocol version;
2. the runs ``int64[3 * runs]``: (source page, destination page, pages) each;
3. for each buffer (per layer, K then V) and each run, the run's bytes, received straight into
   the decode side's KV buffer (a view of ``num_pages * bytes_per_page`` bytes at the page);
   or, when the link moves head slices (prefill and decode of different TP sizes), one tensor
   ``[buffers, tokens, slice bytes]`` the sender gathers from its slots and the receiver scatters
   into its own (one message per room instead of one per run and buffer);
4. the metadata bytes (msgpack, chosen by the caller) as ``uint8[len]``.

Messages on one process group arrive in order, so the sender ships rooms one after another from
one worker thread and the receiver reads them from one worker thread. One process group links one
prefill server with one decode server.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from framework.disaggregation.addressing import check_compatible, check_pages, merge_page_runs, slice_slots
from framework.disaggregation.base import KVLayout, RoomTableBackend, TransferState, TransferTask

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
SENDER, RECEIVER = 0, 1
HEARTBEAT_ROOM = -1
"""A header with this room carries nothing: the sender sends one when idle for a quarter of the
timeout, so the receiver's pending receive never times out on a healthy but quiet link."""
BYE_ROOM = -2
"""The sender's last header (it is closing): the receiver's loop ends instead of blocking."""


@dataclass
class NcclOptions:
    """Options of the ``nccl`` transfer backend."""

    store_host: str = "127.0.0.1"
    """Address the prefill side's rendezvous store listens on and advertises to the decode side."""
    store_port: int = 0
    """Port of the rendezvous store; 0 picks a free one (it is advertised through bootstrap)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when the KV is on a GPU, else gloo), gloo or nccl."""
    timeout_s: float = 60.0
    """Timeout of the rendezvous and of each point-to-point operation."""


class NcclTransferBackend(RoomTableBackend):
    """Sender (``prefill``) or receiver (``decode``) of KV pages over torch.distributed p2p."""

    def __init__(self, role: str, layout: KVLayout, options: NcclOptions) -> None:
        super().__init__(role, layout, options)
        if not layout.buffers:
            raise ValueError("the nccl backend needs the KV buffers themselves (KVLayout.from_cache)")
        name = options.backend
        if name == "auto":
            name = "nccl" if layout.device.startswith("cuda") else "gloo"
        if name not in ("gloo", "nccl"):
            raise ValueError(f"transfer_options.backend must be auto, gloo or nccl, got {name!r}")
        self.dist_backend = name
        self.device = torch.device(layout.device if name == "nccl" else "cpu")
        self._timeout = datetime.timedelta(seconds=options.timeout_s)
        self._expected: dict[int, list[int]] = {}
        self._store: dist.TCPStore | None = None
        self._pg: Any = None
        self._ready = threading.Event()
        self._broken: str | None = None
        self._closed = False
        self._outbox: queue.Queue[tuple[int, list[tuple[int, int, int]], bytes] | None] = queue.Queue()
        self._peer_layout: KVLayout | None = None
        self._peer: dict[str, Any] = {}
        self._whole = True
        """Both sides move whole pages (else head slices: gathered, sent as one tensor, scattered)."""
        self._threads: list[threading.Thread] = []
        self._works: list[Any] = []
        """The point-to-point operations in progress (aborted by ``close``)."""
        if role == "prefill":
            self._store = dist.TCPStore(options.store_host, options.store_port, 2, True,
                                        timeout=self._timeout, wait_for_workers=False)

    @classmethod
    def create(cls, role: str, layout: KVLayout, options: NcclOptions | None = None) -> NcclTransferBackend:
        return cls(role, layout, options or NcclOptions())

    # -- connection ------------------------------------------------------------------------

    def endpoint(self) -> dict[str, Any]:
        ep: dict[str, Any] = {"layout": self.layout.to_json(), "backend": self.dist_backend}
        if self._store is not None:
            ep.update(host=self.options.store_host, port=self._store.port)
        return ep

    def connect(self, peer: dict[str, Any]) -> None:
        """Join the peer: the prefill side is given the decode endpoint, and vice versa."""
        self._peer_layout = KVLayout.from_json(peer["layout"])
        check_compatible(self.layout, self._peer_layout)
        self._whole = self.layout.whole and self._peer_layout.whole
        self._peer = peer
        self._spawn(self._run)

    def _spawn(self, target: Any) -> None:
        t = threading.Thread(target=target, name=f"pd-{self.dist_backend}-{self.role}", daemon=True)
        t.start()
        self._threads.append(t)

    def _make_group(self) -> Any:
        rank = SENDER if self.role == "prefill" else RECEIVER
        prefix = dist.PrefixStore("plugserve-kv", self._store)
        if self.dist_backend == "gloo":
            return dist.ProcessGroupGloo(prefix, rank, 2, self._timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)

    def _run(self) -> None:
        try:
            if self.role == "decode":  # joining may wait up to the timeout: not on the caller's thread
                self._store = dist.TCPStore(self._peer["host"], int(self._peer["port"]), 2, False,
                                            timeout=self._timeout)
            self._pg = self._make_group()
            self._ready.set()
            if self.role == "prefill":
                self._send_loop()
            else:
                self._recv_loop()
        except Exception as exc:  # the peer died or the link broke: every pending room fails
            if not self._closed:
                logger.error("%s transfer link broken: %s", self.dist_backend, exc)
            self._break(f"the KV transfer link to the peer broke: {type(exc).__name__}: {exc}")

    def _break(self, reason: str) -> None:
        with self._lock:
            self._broken = reason
            self._busy_room = None  # the worker has stopped
            for task in self._tasks.values():
                task.fail(reason)
        self._ready.set()

    # -- sender ----------------------------------------------------------------------------

    def send(self, room: int, src_pages: list[int], dst_pages: list[int], metadata: bytes) -> None:
        check_pages(self.layout, src_pages, "source")
        runs = [(r.src_page, r.dst_page, r.num_pages) for r in merge_page_runs(src_pages, dst_pages)]
        task = TransferTask(room, TransferState.waiting_for_input)
        task.advance(TransferState.transferring)
        with self._lock:
            self._tasks[room] = task
            if self._broken:
                task.fail(self._broken)
                return
        self._outbox.put((room, runs, metadata))

    def _send_loop(self) -> None:
        heartbeat_s = max(self.options.timeout_s / 4, 0.1)
        while True:
            try:
                item = self._outbox.get(timeout=heartbeat_s)
            except queue.Empty:
                self._send_room(HEARTBEAT_ROOM, [], b"")
                continue
            if item is None:
                self._send_room(BYE_ROOM, [], b"")
                return
            room, runs, metadata = item
            with self._lock:
                task = self._tasks.get(room)
                if task is None or task.state.final:  # released or timed out meanwhile
                    continue
                self._busy_room = room
            try:
                self._send_room(room, runs, metadata)
            finally:
                with self._lock:
                    self._busy_room = None
            with self._lock:
                if not task.state.final:
                    task.advance(TransferState.success)

    def _p2p(self, tensor: torch.Tensor, send: bool) -> None:
        self._p2p_many([tensor], send)

    def _p2p_many(self, tensors: list[torch.Tensor], send: bool) -> None:
        """Post every operation, then wait for them in order. A fragmented room has thousands of
        page runs: waiting for each before posting the next costs a round trip per run (256 MB in
        15808 runs took ~10 s on gloo), posted together they stream."""
        if self._closed:
            raise RuntimeError("the backend is closed")
        works = self._works = [
            self._pg.send([t], RECEIVER, 0) if send else self._pg.recv([t], SENDER, 0) for t in tensors
        ]
        for work in works:
            work.wait()
        self._works = []

    def _send_room(self, room: int, runs: list[tuple[int, int, int]], metadata: bytes) -> None:
        header = torch.tensor([room, len(runs), len(metadata), PROTOCOL_VERSION], dtype=torch.int64)
        self._p2p(header.to(self.device), send=True)
        if runs:
            self._p2p(torch.tensor(runs, dtype=torch.int64).flatten().to(self.device), send=True)
        if not self._whole and runs:
            self._p2p(self._slice_view([s + i for s, _d, n in runs for i in range(n)]).contiguous(), send=True)
        else:
            bpp = self.layout.bytes_per_page
            for buf in self.layout.buffers:
                self._p2p_many([buf[src * bpp : (src + n) * bpp] for src, _dst, n in runs], send=True)
        if metadata:
            self._p2p(torch.frombuffer(bytearray(metadata), dtype=torch.uint8).to(self.device), send=True)

    # -- receiver --------------------------------------------------------------------------

    def expect(self, room: int, dst_pages: list[int]) -> None:
        check_pages(self.layout, dst_pages, "destination")
        task = TransferTask(room)
        with self._lock:
            self._tasks[room] = task
            self._expected[room] = list(dst_pages)
            if self._broken:
                task.fail(self._broken)
            elif self._ready.is_set():
                task.advance(TransferState.waiting_for_input)

    def _recv_loop(self) -> None:
        with self._lock:
            for task in self._tasks.values():
                if task.state is TransferState.bootstrapping:
                    task.advance(TransferState.waiting_for_input)
        while not self._closed:
            header = torch.empty(4, dtype=torch.int64, device=self.device)
            self._p2p(header, send=False)
            room, num_runs, meta_len, version = (int(x) for x in header.tolist())
            if version != PROTOCOL_VERSION:
                raise RuntimeError(f"protocol version {version} from the peer; this side speaks {PROTOCOL_VERSION}")
            if room == HEARTBEAT_ROOM:
                continue
            if room == BYE_ROOM:
                self._break("the prefill side closed the KV transfer link")
                return
            runs: list[list[int]] = []
            if num_runs:
                flat = torch.empty(3 * num_runs, dtype=torch.int64, device=self.device)
                self._p2p(flat, send=False)
                runs = flat.view(-1, 3).tolist()
            with self._lock:
                task = self._tasks.get(room)
                dst_ok = task is not None and not task.state.final and self._expected.get(room) == [
                    d + i for _s, d, n in runs for i in range(n)
                ]
                if dst_ok and task.state is TransferState.waiting_for_input:
                    task.advance(TransferState.transferring)
                if dst_ok:
                    self._busy_room = room
            try:
                self._receive_pages(runs, into_kv=dst_ok)
            finally:
                with self._lock:
                    self._busy_room = None
            meta = b""
            if meta_len:
                buf = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
                self._p2p(buf, send=False)
                meta = bytes(buf.cpu().numpy().tobytes())
            with self._lock:
                if dst_ok and not task.state.final:
                    self._metadata[room] = meta
                    task.advance(TransferState.success)
                elif task is not None and not task.state.final:
                    task.fail(f"room {room}: the sender's destination pages differ from the reserved ones")

    def _slice_view(self, pages: list[int]) -> torch.Tensor:
        """``[buffers, tokens, slice bytes]``: this side's head slice of every token slot of ``pages``
        (a gathered copy: head slices are strided in the KV buffers)."""
        lay = self.layout
        slots = torch.tensor(slice_slots(lay, pages), dtype=torch.int64, device=self.device)
        cols = slice(lay.slice_offset, lay.slice_offset + lay.moved_token_bytes)
        return torch.stack([buf.view(-1, lay.token_bytes)[slots, cols] for buf in lay.buffers])

    def _receive_slices(self, runs: list[list[int]], into_kv: bool) -> None:
        """Receive a head-slice room (one tensor) and scatter it into this side's slots."""
        lay = self.layout
        pages = [d + i for _s, d, n in runs for i in range(n)]
        staging = torch.empty(lay.num_buffers, len(pages) * lay.page_size, lay.moved_token_bytes,
                              dtype=torch.uint8, device=self.device)
        self._p2p(staging, send=False)
        if into_kv:
            slots = torch.tensor(slice_slots(lay, pages), dtype=torch.int64, device=self.device)
            cols = slice(lay.slice_offset, lay.slice_offset + lay.moved_token_bytes)
            for buf, part in zip(lay.buffers, staging, strict=True):
                buf.view(-1, lay.token_bytes)[slots, cols] = part

    def _receive_pages(self, runs: list[list[int]], into_kv: bool) -> None:
        """Receive every run; into the KV buffers when the room is expected, else into scratch
        (the bytes must still be consumed to keep the stream in step)."""
        if not self._whole:
            if runs:
                self._receive_slices(runs, into_kv)
            return
        bpp = self.layout.bytes_per_page
        for buf in self.layout.buffers:
            views = [buf[dst * bpp : (dst + n) * bpp] if into_kv
                     else torch.empty(n * bpp, dtype=torch.uint8, device=self.device) for _src, dst, n in runs]
            self._p2p_many(views, send=False)

    # -- both ------------------------------------------------------------------------------

    def forget_room(self, room: int) -> None:
        self._expected.pop(room, None)

    def link_error(self) -> str | None:
        return self._broken

    @property
    def connected(self) -> bool:
        return self._ready.is_set() and self._broken is None

    def close(self) -> None:
        """Stop the worker: a blocked receive is aborted so no C++ thread outlives the backend."""
        self._closed = True
        self._outbox.put(None)
        for work in list(self._works):
            try:
                work.abort()
            except Exception:  # best effort: the process is going away
                logger.debug("aborting a pending %s operation failed", self.dist_backend, exc_info=True)
        for t in self._threads:
            t.join(timeout=5)
