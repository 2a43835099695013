"""One side of ``plugserve bench transfer``, run as its own process.

``python -m framework.bench.transfer_peer prefill|decode BACKEND BOOTSTRAP_PORT SPEC.json``

Both sides build a KV cache of the spec's shape and the named transfer plugin, exactly as a
server does (registry -> factory -> bootstrap endpoints -> ``connect``). Then:

1. plugin phase: per iteration the decode side reserves the spec's destination pages (``expect``)
   and posts them to the bootstrap service; the prefill side ``send``s the source pages with its
   ``time.monotonic()`` in the metadata. The decode side times from that instant to the moment it
   sees the room succeed (CLOCK_MONOTONIC is shared by the processes of one machine), so the
   figure includes everything the plugin does: merging runs, descriptors, completion notices.
2. raw phase: the library alone moves one buffer of the same byte count (``RawLink``), timed on
   the prefill side until the bytes are known to be on the decode side.

Each side prints one JSON line; the parent (``framework.bench.transfer``) computes the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from framework.disaggregation.base import KVLayout, TransferState
from framework.disaggregation.bootstrap import BootstrapClient, BootstrapService
from framework.memory.kv_cache import KVCache
from framework.plugins import get_registry

DONE_ROOM = 0
RAW_DONE_RANK = 1
"""The prefill side registers an endpoint under this rank when its raw transfers are over."""
POLL_S = 0.0005
"""Sleep between polls: short next to a transfer of many MB, long enough not to starve the
other process on a machine with few cores."""


@dataclass
class Spec:
    """What to move (written by the parent as JSON)."""

    layers: int
    page_bytes: int
    pool_pages: int
    src_pages: list[int]
    dst_pages: list[int]
    iters: int
    warmup: int
    timeout_s: float
    layout: str = "whole"
    """``whole``: 8 heads on both sides (whole pages). ``tp1-to-tp2``: the sender holds 8 heads and
    sends heads 0..3 of each token to a receiver that holds those 4 (decode rank 0 of 2).
    ``tp2-to-tp1``: the sender holds 4 heads and writes them into heads 0..3 of a receiver that
    holds 8 (prefill rank 0 of 2). Head slices move half the bytes, strided per token."""

    @property
    def moved_bytes(self) -> int:
        whole = len(self.src_pages) * 2 * self.layers * self.page_bytes
        return whole if self.layout == "whole" else whole // 2


HEADS = {("whole", "prefill"): 8, ("whole", "decode"): 8, ("tp1-to-tp2", "prefill"): 8,
         ("tp1-to-tp2", "decode"): 4, ("tp2-to-tp1", "prefill"): 4, ("tp2-to-tp1", "decode"): 8}
"""KV heads each side's cache holds, per layout."""


def make_cache(spec: Spec, fill: float, heads: int = 8) -> KVCache:
    """A cache of ``heads`` heads whose 8-head page would be ``page_bytes`` per buffer (fp16, 16
    tokens x 8 heads x head_dim)."""
    head_dim = spec.page_bytes // (16 * 8 * 2)
    cache = KVCache(spec.layers, spec.pool_pages, 16, heads, head_dim, torch.float16, "cpu")
    for buf in [*cache.k_buffers, *cache.v_buffers]:
        buf.fill_(fill)  # touch every page now, so no page fault lands inside a timed transfer
    return cache


def side_layout(spec: Spec, role: str, fill: float) -> KVLayout:
    """This side's cache and the layout its backend moves (sliced to heads 0..3 where it holds 8
    and the peer 4)."""
    heads = HEADS[(spec.layout, role)]
    layout = KVLayout.from_cache(make_cache(spec, fill, heads))
    peer = HEADS[(spec.layout, "decode" if role == "prefill" else "prefill")]
    return layout.sliced(0, peer) if heads > peer else layout


def wait_for(predicate: Any, what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"timed out waiting for {what}")


# -- the libraries on their own ----------------------------------------------------------------


class RawLink:
    """One buffer of ``nbytes`` moved by the library itself, with no plugin code in the way."""

    library = ""

    def __init__(self, role: str, backend: Any, nbytes: int) -> None:
        self.role = role
        self.backend = backend
        self.nbytes = nbytes
        self.buf = (torch.ones if role == "prefill" else torch.zeros)(nbytes, dtype=torch.uint8)

    def endpoint(self) -> dict[str, Any]:
        return {"ptr": self.buf.data_ptr()}

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = peer

    def send_once(self) -> None:
        raise NotImplementedError

    def recv_once(self) -> None:
        """One-sided libraries: the receiver does nothing."""

    def close(self) -> None:
        pass


class MooncakeRaw(RawLink):
    """The plugin's own TransferEngine, one ``transfer_sync_write`` of the whole buffer."""

    library = "mooncake TransferEngine.transfer_sync_write"

    def __init__(self, role: str, backend: Any, nbytes: int) -> None:
        super().__init__(role, backend, nbytes)
        if backend.engine.register_memory(self.buf.data_ptr(), nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")

    def send_once(self) -> None:
        peer = self.backend._peer
        ret = self.backend.engine.transfer_sync_write(peer["session"], self.buf.data_ptr(), self.peer["ptr"],
                                                      self.nbytes)
        if ret < 0:
            raise RuntimeError(f"transfer_sync_write failed ({ret})")


class NixlRaw(RawLink):
    """The plugin's own NIXL agent, one WRITE descriptor of the whole buffer. Registered before the
    plugin's endpoint is taken, so the agent metadata the peer loads already holds it."""

    library = "nixl agent WRITE (UCX)"

    def __init__(self, role: str, backend: Any, nbytes: int) -> None:
        super().__init__(role, backend, nbytes)
        agent = backend.agent
        self._reg = agent.register_memory(agent.get_reg_descs([(self.buf.data_ptr(), nbytes, 0, "")], "DRAM"))

    def send_once(self) -> None:
        agent = self.backend.agent
        local = agent.get_xfer_descs([(self.buf.data_ptr(), self.nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(self.peer["ptr"], self.nbytes, 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, self.backend._peer_name)
        try:
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL raw transfer failed")
        finally:
            agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.backend.agent.deregister_memory(self._reg)


class GlooRaw(RawLink):
    """torch.distributed gloo, a two-rank group of its own: one ``send`` of the whole tensor, then a
    one-element acknowledgement back so the sender's clock stops when the receiver has it all."""

    library = "torch.distributed gloo send/recv"

    def __init__(self, role: str, backend: Any, nbytes: int) -> None:
        super().__init__(role, backend, nbytes)
        self._store: Any = None
        self._pg: Any = None
        self._ack = torch.zeros(1, dtype=torch.int64)
        if role == "prefill":
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)

    def endpoint(self) -> dict[str, Any]:
        return {"port": self._store.port} if self._store is not None else {}

    def _group(self) -> Any:
        import datetime

        import torch.distributed as dist

        if self._pg is None:
            if self._store is None:
                self._store = dist.TCPStore("127.0.0.1", int(self.peer["port"]), 2, False)
            rank = 0 if self.role == "prefill" else 1
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", self._store), rank, 2,
                                             datetime.timedelta(seconds=120))
        return self._pg

    def send_once(self) -> None:
        pg = self._group()
        pg.send([self.buf], 1, 0).wait()
        pg.recv([self._ack], 1, 1).wait()

    def recv_once(self) -> None:
        pg = self._group()
        pg.recv([self.buf], 0, 0).wait()
        pg.send([self._ack], 0, 1).wait()


RAW: dict[str, type[RawLink]] = {"mooncake": MooncakeRaw, "nixl": NixlRaw, "nccl": GlooRaw}


# -- the two sides -------------------------------------------------------------------------------


def _backend(name: str, role: str, layout: KVLayout) -> Any:
    comp = get_registry().get("transfer_backend", name)
    return comp.factory(role, layout, comp.make_options({}))


def prefill(name: str, port: int, spec: Spec) -> dict[str, Any]:
    service = BootstrapService("127.0.0.1", port).start()
    backend = _backend(name, "prefill", side_layout(spec, "prefill", 1.0))
    raw = RAW[name]("prefill", backend, spec.moved_bytes)
    try:
        service.register("prefill", 0, {**backend.endpoint(), "raw": raw.endpoint()})
        peer = wait_for(lambda: service.endpoints("decode").get(0), "the decode endpoint", spec.timeout_s)
        backend.connect(peer)
        raw.connect(peer["raw"])
        for room in range(1, spec.warmup + spec.iters + 1):
            posted = wait_for(lambda r=room: service.take_room(r), f"room {room}", spec.timeout_s)
            backend.send(room, spec.src_pages, posted[0], msgspec.msgpack.encode(time.monotonic()))
            task = wait_for(lambda r=room: backend.poll(r).state.final and backend.poll(r), f"room {room}",
                            spec.timeout_s)
            if task.state is not TransferState.success:
                raise RuntimeError(f"room {room}: {task.error}")
            backend.release(room)
        raw_s = []
        for _ in range(spec.warmup + spec.iters):
            t0 = time.monotonic()
            raw.send_once()
            raw_s.append(time.monotonic() - t0)
        # one-sided libraries: the receiver learns here that the writes are over (rank 1 = a flag)
        service.register("prefill", RAW_DONE_RANK, {"raw_done": True})
        wait_for(lambda: service.take_room(DONE_ROOM), "the decode side to finish", spec.timeout_s)
        return {"ok": True, "raw_s": raw_s[spec.warmup:], "raw_library": raw.library}
    finally:
        raw.close()
        backend.close()
        service.close()


def decode(name: str, port: int, spec: Spec) -> dict[str, Any]:
    backend = _backend(name, "decode", side_layout(spec, "decode", 0.0))
    raw = RAW[name]("decode", backend, spec.moved_bytes)
    client = BootstrapClient("127.0.0.1", port)
    try:
        wait_for(client.health, "the bootstrap service", spec.timeout_s)
        client.register("decode", 0, {**backend.endpoint(), "raw": raw.endpoint()})
        peer = wait_for(lambda: client.endpoints("prefill").get(0), "the prefill endpoint", spec.timeout_s)
        backend.connect(peer)
        raw.connect(peer["raw"])
        plugin_s = []
        for room in range(1, spec.warmup + spec.iters + 1):
            backend.expect(room, spec.dst_pages)
            client.post_room(room, spec.dst_pages)
            task = wait_for(lambda r=room: backend.poll(r).state.final and backend.poll(r), f"room {room}",
                            spec.timeout_s)
            done = time.monotonic()
            if task.state is not TransferState.success:
                raise RuntimeError(f"room {room}: {task.error}")
            plugin_s.append(done - msgspec.msgpack.decode(backend.metadata(room)))
            backend.release(room)
        # the sender filled its KV with ones: the last destination page of the last buffer has them
        # (in the moved heads only, when the receiver holds more heads than it was sent)
        lay = backend.layout
        last = lay.buffers[-1][spec.dst_pages[-1] * lay.bytes_per_page : (spec.dst_pages[-1] + 1) * lay.bytes_per_page]
        tokens = last.view(16, lay.token_bytes)
        moved = tokens[:, lay.slice_offset : lay.slice_offset + lay.moved_token_bytes]
        bytes_ok = bool(moved.contiguous().view(torch.float16).eq(1.0).all()) and int(tokens.sum()) == int(moved.sum())
        for _ in range(spec.warmup + spec.iters):
            raw.recv_once()
        # stay up (memory registered) until the sender's last one-sided write has completed
        wait_for(lambda: client.endpoints("prefill").get(RAW_DONE_RANK), "the raw transfers", spec.timeout_s)
        client.post_room(DONE_ROOM, [1])
        return {"ok": bytes_ok, "bytes_ok": bytes_ok, "plugin_s": plugin_s[spec.warmup:]}
    finally:
        client.close()
        raw.close()
        backend.close()


def main(argv: list[str]) -> int:
    role, name, port, spec_path = argv[0], argv[1], int(argv[2]), argv[3]
    with open(spec_path) as f:
        spec = Spec(**json.load(f))
    try:
        result = (prefill if role == "prefill" else decode)(name, port, spec)
    except Exception as exc:  # reported to the parent as JSON, like a result
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps({"role": role, **result}), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    # Skip the interpreter's teardown: NIXL 1.5.1 (UCX) crashes in its static destructors at exit
    # on CPU, after everything here has finished and been closed (the servers do the same).
    os._exit(code)
