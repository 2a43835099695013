"""The child process of the KV transfer conformance kit (``framework.testing.transfer_conformance``):
one side (``prefill`` sender or ``decode`` receiver) with its own KV cache and backend, driven by
JSON commands on stdin, answering on stdout after :data:`MARK`.

    python -m framework.testing.transfer_conformance_peer ROLE SPEC_JSON
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

MARK = "@@transfer-conformance "
"""Prefix of the protocol lines on stdout (anything else there is the backend's own output)."""

# The KV geometry of both processes: 2 layers, 16 usable pages (1 .. 16) of 4 tokens.
GEOMETRY = dict(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)
SENDER_SEED, RECEIVER_SEED = 1234, 4321


def _resolve_path(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child_make_backend(spec: dict[str, Any], role: str, layout: Any) -> Any:
    if "name" in spec:
        from framework.plugins import get_registry

        comp = get_registry().get("transfer_backend", spec["name"])
        return comp.factory(role, layout, comp.make_options(spec.get("options") or {}))
    factory = _resolve_path(spec["factory"])
    options = None
    if spec.get("options_cls"):
        options = _resolve_path(spec["options_cls"])(**spec["options"])
    return factory(role, layout, options)


class _Child:
    """One side: its KV cache, its backend, and the commands the parent sends."""

    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        import torch

        from framework.disaggregation.base import KVLayout
        from framework.memory.kv_cache import KVCache

        torch.set_num_threads(1)
        self.torch = torch
        self.role = role
        self.device = spec["device"]
        self.cache = KVCache(**GEOMETRY, dtype=torch.float32, device=self.device)
        self._fill(self.cache, SENDER_SEED if role == "prefill" else RECEIVER_SEED)
        self.layout = KVLayout.from_cache(self.cache)
        self.backend = _child_make_backend(spec, role, self.layout)
        self._probe_room = 1 << 40
        self._reference: list[Any] | None = None
        """What the receiver's buffers must hold, updated by each verified room."""

    def _fill(self, cache: Any, seed: int) -> None:
        gen = self.torch.Generator().manual_seed(seed)
        for buf in [b for pair in zip(cache.k_buffers, cache.v_buffers, strict=True) for b in pair]:
            buf.copy_(self.torch.randn(buf.shape, generator=gen).to(buf.device))

    def _expected(self, seed: int) -> list[Any]:
        """The flat byte view of each buffer (K, V per layer) as ``seed`` fills it, on the CPU."""
        from framework.memory.kv_cache import KVCache

        cache = KVCache(**GEOMETRY, dtype=self.torch.float32, device="cpu")
        self._fill(cache, seed)
        return [b.reshape(-1).view(self.torch.uint8) for pair in zip(cache.k_buffers, cache.v_buffers, strict=True)
                for b in pair]

    def _page(self, buf: Any, page: int) -> Any:
        bpp = self.cache.bytes_per_page
        return buf[page * bpp : (page + 1) * bpp]

    # -- commands --

    def endpoint(self) -> dict[str, Any]:
        return {"endpoint": self.backend.endpoint()}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        self.backend.connect(peer)
        return {}

    def expect(self, room: int, pages: list[int]) -> dict[str, Any]:
        self.backend.expect(room, pages)
        return {}

    def send(self, room: int, src: list[int], dst: list[int], meta: str) -> dict[str, Any]:
        self.backend.send(room, src, dst, bytes.fromhex(meta))
        return {}

    def _state(self, room: int) -> tuple[str, Any]:
        from framework.disaggregation.base import TransferTask

        task = self.backend.poll(room)
        if not isinstance(task, TransferTask):
            raise TypeError(f"poll({room}) returned a {type(task).__name__}, expected a TransferTask")
        return task.state.value, task

    def wait_final(self, rooms: list[int], deadline_s: float) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        seen: dict[int, list[str]] = {r: [] for r in rooms}
        tasks: dict[int, Any] = {}
        while True:
            pending = False
            for room in rooms:
                state, tasks[room] = self._state(room)
                if not seen[room] or seen[room][-1] != state:
                    seen[room].append(state)
                pending |= state not in ("success", "failed")
            if not pending or time.monotonic() > end:
                break
            time.sleep(0.002)
        return {"rooms": {str(r): {"states": seen[r], "error": tasks[r].error} for r in rooms}}

    def observe(self, room: int, seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        seen: list[str] = []
        while time.monotonic() < end:
            state, _ = self._state(room)
            if not seen or seen[-1] != state:
                seen.append(state)
            time.sleep(0.01)
        return {"states": seen}

    def expire(self, room: int, after_s: float) -> dict[str, Any]:
        _, task = self._state(room)
        failed = task.check_timeout(after_s, after_s)
        state, task2 = self._state(room)
        return {"failed": bool(failed), "poll_state": state, "error": task2.error}

    def release(self, room: int) -> dict[str, Any]:
        self.backend.release(room)
        return {}

    def quiescent(self, room: int, deadline_s: float) -> dict[str, Any]:
        start = time.monotonic()
        while not self.backend.quiescent(room):
            if time.monotonic() - start > deadline_s:
                return {"quiescent": False, "waited_s": time.monotonic() - start}
            time.sleep(0.005)
        return {"quiescent": True, "waited_s": time.monotonic() - start}

    def verify_receiver(self, pairs: list[list[int]], maybe: list[int], metadata: dict[str, str]) -> dict[str, Any]:
        """Destination pages hold the sender's source pages; every other page holds what it held
        (this side's own fill, or an earlier room's data); ``maybe`` pages may hold anything."""
        if self._reference is None:
            self._reference = [b.clone() for b in self._expected(RECEIVER_SEED)]
        problems: list[str] = []
        sent = self._expected(SENDER_SEED)
        got = [b.cpu() for b in self.layout.buffers]
        written = {d for _s, d in pairs}
        for i, buf in enumerate(got):
            ref = self._reference[i]
            for s, d in pairs:
                page, want = self._page(buf, d), self._page(sent[i], s)
                if not self.torch.equal(page, want):
                    bad = int((page != want).nonzero()[0, 0])
                    problems.append(f"buffer {i} (layer {i // 2} {'KV'[i % 2]}): destination page {d} differs from "
                                    f"source page {s} at byte {bad} of {self.cache.bytes_per_page}")
                self._page(ref, d).copy_(page)  # what landed: a later check reports only new damage
            for p in maybe:
                self._page(ref, p).copy_(self._page(buf, p))
            for p in range(self.layout.num_pages):
                if p not in written and not self.torch.equal(self._page(buf, p), self._page(ref, p)):
                    problems.append(f"buffer {i}: page {p}, which no room targets, was overwritten")
        for room, meta in metadata.items():
            value = self.backend.metadata(int(room))
            want = bytes.fromhex(meta)
            if (value or b"") != want:  # None is fine for empty metadata
                problems.append(f"metadata({room}) is {value!r:.80}, expected {want!r:.80}")
        return {"problems": problems}

    def verify_sender(self) -> dict[str, Any]:
        sent = self._expected(SENDER_SEED)
        bad = [i for i, b in enumerate(self.layout.buffers) if not self.torch.equal(b.cpu(), sent[i])]
        return {"problems": [f"sender buffer {i} changed: a backend must only read its source pages" for i in bad]}

    def link_error(self, deadline_s: float, probe: bool) -> dict[str, Any]:
        start = time.monotonic()
        probes: list[int] = []
        next_probe = start
        while True:
            err = self.backend.link_error()
            if err or time.monotonic() - start > deadline_s:
                break
            if probe and time.monotonic() >= next_probe:
                self._probe_room += 1
                probes.append(self._probe_room)
                try:
                    self.backend.send(self._probe_room, [1], [1], b"probe")
                except Exception:  # refusing to send on a dead link is fine
                    probes[-1] = -1
                next_probe = time.monotonic() + 0.25
            time.sleep(0.01)
        states = {}
        for room in probes[-3:]:
            if room >= 0:
                try:
                    states[str(room)] = self.backend.poll(room).state.value
                except KeyError:
                    states[str(room)] = "unknown"
        return {"link_error": err, "waited_s": time.monotonic() - start, "probes": len(probes), "probe_states": states}


def _child_main(role: str, spec_json: str) -> None:
    def emit(msg: dict[str, Any]) -> None:
        sys.stdout.write(MARK + json.dumps(msg) + "\n")
        sys.stdout.flush()

    try:
        child = _Child(role, json.loads(spec_json))
        emit({"ok": True, "id": 0, **child.endpoint()})
    except Exception:
        emit({"ok": False, "id": 0, "error": traceback.format_exc()})
        os._exit(1)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd, seq = msg.pop("cmd"), msg.pop("id")
        if cmd == "close":
            try:
                child.backend.close()
            except Exception:
                traceback.print_exc()
            emit({"ok": True, "id": seq})
            break
        try:
            emit({"ok": True, "id": seq, **getattr(child, cmd)(**msg)})
        except Exception:
            emit({"ok": False, "id": seq, "error": traceback.format_exc()})
    sys.stderr.flush()
    # Skip the interpreter's teardown, as the scheduler process does: some transports (NIXL/UCX)
    # crash in static destructors at exit after everything has been closed.
    os._exit(0)


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
