"""One side of a KV transfer round trip, run as its own process by ``test_transfer_roundtrip``.

``python tests/pd/transfer_peer.py prefill|decode BACKEND BOOTSTRAP_PORT``. The prefill side hosts
the bootstrap service, fills its KV with seeded random values and sends the rooms' pages; the
decode side reserves destination pages, posts them, waits for the data and checks it byte for
byte against the same seeded values (and that no other page was touched). Each side prints one
JSON line with its verdict.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import torch

from framework.disaggregation.base import KVLayout, TransferState
from framework.disaggregation.bootstrap import BootstrapClient, BootstrapService
from framework.memory.kv_cache import KVCache
from framework.plugins import get_registry

DEADLINE_S = 60.0
DONE_ROOM = 0
# Sent, then released at once by the prefill side: its source pages must become quiescent (the
# backend stops reading them) and the decode side does not check what, if anything, landed.
RELEASED_ROOM, RELEASED_SRC, RELEASED_DST = 21, [11, 12], [13, 14]
# room -> (source pages on the prefill side, destination pages on the decode side)
ROOMS = {
    11: ([1, 2, 3, 7], [4, 5, 6, 12]),  # two runs on the destination side
    12: ([9, 10], [2, 3]),  # one run
    13: ([15], [1]),
    14: ([16, 4, 5, 6], [16, 8, 9, 10]),
}


def make_cache() -> KVCache:
    return KVCache(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8,
                   dtype=torch.float32, device="cpu")


def fill(cache: KVCache) -> None:
    gen = torch.Generator().manual_seed(1234)
    for buf in [b for pair in zip(cache.k_buffers, cache.v_buffers, strict=True) for b in pair]:
        buf.copy_(torch.randn(buf.shape, generator=gen))


def metadata(room: int) -> bytes:
    return msgspec.msgpack.encode({"room": room, "first_token": room * 3, "logprob": -0.5})


def wait_for(predicate, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def make_backend(name: str, role: str, layout: KVLayout):
    comp = get_registry().get("transfer_backend", name)
    return comp.factory(role, layout, comp.make_options({}))


def prefill(name: str, port: int) -> dict:
    service = BootstrapService("127.0.0.1", port).start()
    cache = make_cache()
    fill(cache)
    backend = make_backend(name, "prefill", KVLayout.from_cache(cache))
    try:
        service.register("prefill", 0, backend.endpoint())
        peer = wait_for(lambda: service.endpoints("decode").get(0), "the decode endpoint")
        backend.connect(peer)
        pending = dict(ROOMS)
        while pending:
            for room in list(pending):
                posted = service.take_room(room)
                if posted is not None:
                    backend.send(room, pending.pop(room)[0], posted[0], metadata(room))
            time.sleep(0.01)
        states = {room: wait_for(lambda r=room: backend.poll(r).state.final and backend.poll(r), f"room {room}")
                  for room in ROOMS}
        posted = wait_for(lambda: service.take_room(RELEASED_ROOM), "the released room's pages")
        backend.send(RELEASED_ROOM, RELEASED_SRC, posted[0], metadata(RELEASED_ROOM))
        backend.release(RELEASED_ROOM)
        quiescent = bool(wait_for(lambda: backend.quiescent(RELEASED_ROOM), "the released room to go quiescent"))
        handles_left = len(getattr(backend, "_draining", {}))  # nixl: in-flight handles not yet released
        wait_for(lambda: service.take_room(DONE_ROOM), "the decode side to finish")
        return {"ok": all(t.state is TransferState.success for t in states.values()) and quiescent
                and handles_left == 0, "states": {r: t.state.value for r, t in states.items()},
                "released_room_quiescent": quiescent, "handles_left": handles_left}
    finally:
        backend.close()
        service.close()


def decode(name: str, port: int) -> dict:
    cache = make_cache()
    backend = make_backend(name, "decode", KVLayout.from_cache(cache))
    client = BootstrapClient("127.0.0.1", port)
    try:
        wait_for(client.health, "the bootstrap service")
        client.register("decode", 0, backend.endpoint())
        backend.connect(wait_for(lambda: client.endpoints("prefill").get(0), "the prefill endpoint"))
        for room, (_src, dst) in ROOMS.items():
            backend.expect(room, dst)
            client.post_room(room, dst)
        tasks = {room: wait_for(lambda r=room: backend.poll(r).state.final and backend.poll(r), f"room {room}")
                 for room in ROOMS}
        errors = {r: t.error for r, t in tasks.items() if t.state is not TransferState.success}
        backend.expect(RELEASED_ROOM, RELEASED_DST)
        client.post_room(RELEASED_ROOM, RELEASED_DST)
        meta_ok = all(backend.metadata(r) == metadata(r) for r in ROOMS)
        expected = make_cache()
        fill(expected)
        mismatched = []
        touched: set[int] = set(RELEASED_DST)
        for room, (src, dst) in ROOMS.items():
            touched.update(dst)
            for s, d in zip(src, dst, strict=True):
                for b_exp, b_got in zip(KVLayout.from_cache(expected).buffers, backend.layout.buffers, strict=True):
                    bpp = backend.layout.bytes_per_page
                    if not torch.equal(b_exp[s * bpp : (s + 1) * bpp], b_got[d * bpp : (d + 1) * bpp]):
                        mismatched.append((room, s, d))
        untouched_zero = all(
            not b[p * backend.layout.bytes_per_page : (p + 1) * backend.layout.bytes_per_page].any()
            for b in backend.layout.buffers for p in range(backend.layout.num_pages) if p not in touched
        )
        # The released room's data may or may not land (the sender gave it up); let it settle.
        time.sleep(0.5)
        backend.release(RELEASED_ROOM)
        client.post_room(DONE_ROOM, [1])
        return {"ok": not errors and meta_ok and not mismatched and untouched_zero, "errors": errors,
                "metadata_ok": meta_ok, "mismatched": mismatched[:5], "untouched_zero": untouched_zero}
    finally:
        client.close()
        backend.close()


if __name__ == "__main__":
    role, backend_name, bootstrap_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = (prefill if role == "prefill" else decode)(backend_name, bootstrap_port)
    print(json.dumps({"role": role, **result}), flush=True)
    sys.stderr.flush()
    # Skip the interpreter's teardown, as the scheduler process does: NIXL 1.5.1 (UCX) crashes in
    # its static destructors at exit on CPU, after everything here has finished and been closed.
    os._exit(0 if result["ok"] else 1)
