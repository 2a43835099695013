"""One rank of a head-sliced KV transfer, run as its own process by ``test_head_slice_roundtrip``.

``python tests/pd/head_slice_peer.py prefill|decode RANK PREFILL_TP DECODE_TP BACKEND BOOTSTRAP_PORT``.
Every rank holds its TP shard of one seeded "full" KV cache (4 KV heads); the ranks link through
``RankLinks`` (one transfer backend per rank pair, as the PD sides build them) over a bootstrap
service the test hosts. Each decode rank checks, byte for byte, that every destination page holds
exactly its own heads of the source page, and that no other page was touched. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import torch

from framework.disaggregation.base import KVLayout, TransferState
from framework.disaggregation.bootstrap import BootstrapClient
from framework.disaggregation.heads import ModelIdentity, RankShard, all_shards
from framework.disaggregation.links import RankLinks
from framework.memory.kv_cache import KVCache
from framework.plugins import get_registry

DEADLINE_S = 60.0
HEADS, LAYERS, PAGES, PAGE_SIZE, HEAD_DIM = 4, 2, 16, 4, 8
IDENTITY = ModelIdentity("LlamaForCausalLM", LAYERS, HEAD_DIM, HEADS, "float32", PAGE_SIZE)
# room -> (source pages, destination pages): runs that merge, split and single pages
ROOMS = {11: ([1, 2, 3, 7], [4, 5, 6, 12]), 12: ([9, 10], [2, 3]), 13: ([15], [1]), 14: ([16, 4, 5, 6], [16, 8, 9, 10])}
READY, DONE = 100, 200
"""Registration ranks used as flags: decode rank d expects its rooms (100 + d), checked them (200 + d)."""


def full_buffers() -> list[torch.Tensor]:
    """Every buffer (per layer, K then V) with all heads: what the prefill ranks hold between them."""
    gen = torch.Generator().manual_seed(99)
    return [torch.randn((PAGES + 1) * PAGE_SIZE, HEADS, HEAD_DIM, generator=gen) for _ in range(2 * LAYERS)]


def make_cache(shard: RankShard, filled: bool) -> KVCache:
    cache = KVCache(LAYERS, PAGES, PAGE_SIZE, shard.num_heads, HEAD_DIM, torch.float32, "cpu")
    if filled:
        bufs = [b for pair in zip(cache.k_buffers, cache.v_buffers, strict=True) for b in pair]
        for mine, full in zip(bufs, full_buffers(), strict=True):
            mine.copy_(full[:, shard.head_start : shard.head_end])
    return cache


def wait_for(predicate, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def metadata(room: int) -> bytes:
    return msgspec.msgpack.encode({"room": room, "first_token": room * 3})


def make_links(role: str, shard: RankShard, peers: list[RankShard], cache: KVCache, backend: str) -> RankLinks:
    comp = get_registry().get("transfer_backend", backend)
    layout = KVLayout.from_cache(cache, IDENTITY)
    return RankLinks(role, layout, shard, peers, lambda lay: comp.factory(role, lay, comp.make_options({})))


def ranks_registered(client: BootstrapClient, role: str, ranks: range) -> dict | None:
    eps = client.endpoints(role)
    return eps if all(r in eps for r in ranks) else None


def prefill(rank: int, m: int, n: int, backend: str, client: BootstrapClient) -> dict:
    shard = all_shards(HEADS, m)[rank]
    cache = make_cache(shard, filled=True)
    eps = wait_for(lambda: ranks_registered(client, "decode", range(n)), "the decode ranks' links")
    links = make_links("prefill", shard, all_shards(HEADS, n), cache, backend)
    try:
        me = str(rank)
        links.connect({d: eps[d]["links"][me] for d in range(n) if me in eps[d]["links"]})
        client.register("prefill", rank, {"links": links.endpoints()})
        wait_for(lambda: ranks_registered(client, "decode", range(READY, READY + n)), "the decode ranks to expect")
        for room, (src, dst) in ROOMS.items():
            links.send(room, src, dst, metadata(room))
        states = {room: wait_for(lambda r=room: links.status(r)[0].final and links.status(r), f"room {room}")
                  for room in ROOMS}
        wait_for(lambda: ranks_registered(client, "decode", range(DONE, DONE + n)), "the decode ranks to check")
        ok = all(s is TransferState.success for s, _e in states.values())
        return {"ok": ok, "links": sorted(links.links), "states": {r: s.value for r, (s, _e) in states.items()}}
    finally:
        links.close()


def decode(rank: int, m: int, n: int, backend: str, client: BootstrapClient) -> dict:
    shard = all_shards(HEADS, n)[rank]
    cache = make_cache(shard, filled=False)
    links = make_links("decode", shard, all_shards(HEADS, m), cache, backend)
    try:
        client.register("decode", rank, {"links": links.endpoints()})
        eps = wait_for(lambda: ranks_registered(client, "prefill", range(m)), "the prefill ranks' links")
        me = str(rank)
        links.connect({p: eps[p]["links"][me] for p in range(m) if me in eps[p]["links"]})
        for room, (_src, dst) in ROOMS.items():
            links.expect(room, dst)
        client.register("decode", READY + rank, {})
        states = {room: wait_for(lambda r=room: links.status(r)[0].final and links.status(r), f"room {room}")
                  for room in ROOMS}
        errors = {r: e for r, (s, e) in states.items() if s is not TransferState.success}
        meta_ok = all(links.metadata(r) == metadata(r) for r in ROOMS)
        got = [b for pair in zip(cache.k_buffers, cache.v_buffers, strict=True) for b in pair]
        mismatched, touched = [], {d for _s, dst in ROOMS.values() for d in dst}
        for room, (src, dst) in ROOMS.items():
            for s, d in zip(src, dst, strict=True):
                for i, (full, mine) in enumerate(zip(full_buffers(), got, strict=True)):
                    want = full[s * PAGE_SIZE : (s + 1) * PAGE_SIZE, shard.head_start : shard.head_end]
                    if not torch.equal(want, mine[d * PAGE_SIZE : (d + 1) * PAGE_SIZE]):
                        mismatched.append((room, s, d, i))
        untouched_zero = all(not b[p * PAGE_SIZE : (p + 1) * PAGE_SIZE].any()
                             for b in got for p in range(PAGES + 1) if p not in touched)
        client.register("decode", DONE + rank, {})
        return {"ok": not errors and meta_ok and not mismatched and untouched_zero, "errors": errors,
                "links": sorted(links.links), "metadata_ok": meta_ok, "mismatched": mismatched[:5],
                "untouched_zero": untouched_zero}
    finally:
        time.sleep(0.3)  # let the senders see the flag before the link goes
        links.close()


if __name__ == "__main__":
    role, rank, m, n, name, port = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], int(sys.argv[6])
    bootstrap = BootstrapClient("127.0.0.1", port)
    result = (prefill if role == "prefill" else decode)(rank, m, n, name, bootstrap)
    bootstrap.close()
    print(json.dumps({"role": role, "rank": rank, **result}), flush=True)
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # NIXL 1.5.1 crashes in its static destructors at exit on CPU
