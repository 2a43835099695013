"""Scheduler memory soak: many short requests through the real scheduler, RSS sampled.

It drives the scheduler process's own ``SchedulerLoop`` in this process: every HTTP-side message
is msgpack-encoded with ``framework.server.ipc`` and handed to ``SchedulerLoop._handle`` (the
loop's real admission, abort and control code), each step's outputs are encoded as
``ipc.Outputs`` exactly as the loop sends them, and a fake socket decodes them on the "client"
side. Only zmq itself is left out. ``--engine`` drives ``framework.Engine`` instead (client-side
detokenisation and stop strings included).

Workload: random prompts of 4-200 tokens (some sharing prefixes), max_new_tokens 1-32, greedy /
sampled / seeded / penalised rows, logprobs (top-k and prompt logprobs), stop strings and stop
token ids, n > 1 groups, client aborts mid-way, a few refused requests (too long). Every
``--sample-every`` requests the workload is drained, ``flush_cache`` is called (as /flush_cache
does) and memory is sampled while the scheduler is idle, so the samples are comparable.

Each sample: VmRSS/RssAnon (/proc/self/status), glibc ``mallinfo2`` (bytes in use vs free in
the heap), the lengths of every container reachable from the scheduler's components, optionally
the gc object count by type (``--gc``), a tracemalloc diff (``--tracemalloc``), and the RSS after
``malloc_trim(0)`` (``--trim``: if RSS drops back, the growth is allocator fragmentation, not live
objects).

    .venv/bin/python scripts/soak/scheduler_memory.py --requests 10000 --sample-every 1000
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/soak/scheduler_memory.py --requests 5000 --trim

Exit status 1 when ``--max-growth-mb`` is given and the idle RSS after warm-up grew by more, or
``--max-heap-free-mb`` is given and glibc holds more free heap than that at the last sample.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MB = 1 << 20

# -- memory probes ------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def mallinfo() -> dict[str, int]:
    """glibc heap: ``in_use`` (uordblks + mmapped hblkhd) and ``free`` (fordblks, held by malloc)."""
    try:
        fn = _libc.mallinfo2
    except AttributeError:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"heap_in_use": m.uordblks + m.hblkhd, "heap_free": m.fordblks, "heap_arena": m.arena,
            "heap_mmapped": m.hblkhd}


def malloc_trim() -> None:
    _libc.malloc_trim(0)


def malloc_info(path: str) -> None:
    """glibc's per-arena XML report (free chunk sizes, arenas, mmaps) into ``path``."""
    _libc.fopen.restype = ctypes.c_void_p
    _libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    _libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _libc.fclose.argtypes = [ctypes.c_void_p]
    f = _libc.fopen(path.encode(), b"w")
    _libc.malloc_info(0, f)
    _libc.fclose(f)


CONTAINER_TYPES = (list, dict, set, frozenset, deque, bytearray, tuple)


def container_lengths(roots: dict[str, Any]) -> dict[str, int]:
    """``root.attr`` -> len for every container attribute of each root object (one level)."""
    out: dict[str, int] = {}
    for name, obj in roots.items():
        if obj is None:
            continue
        attrs = getattr(obj, "__dict__", None) or {}
        slots = getattr(type(obj), "__slots__", ())
        items = list(attrs.items()) + [(s, getattr(obj, s, None)) for s in slots if isinstance(s, str)]
        for attr, value in items:
            if isinstance(value, CONTAINER_TYPES):
                out[f"{name}.{attr}"] = len(value)
    return out


def scheduler_roots(scheduler: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    runner = scheduler.runner
    roots = {
        "scheduler": scheduler, "kv": scheduler.kv, "cache": scheduler.kv.cache,
        "allocator": scheduler.kv.allocator, "req_pool": scheduler.kv.req_pool,
        "rows": getattr(scheduler.kv.req_pool, "_rows", None), "sampler": scheduler.sampler,
        "planner": scheduler.planner, "policy": scheduler.policy, "runner": runner,
        "attn": runner.attn_backend, "model": runner.model, "plugins": scheduler.plugins,
        "pm": scheduler.plugins.pm, "tokenizer": scheduler.tokenizer,
    }
    for name, plugin in scheduler.plugins.pm.list_name_plugin():
        roots[f"plugin[{name}]"] = plugin
    roots.update(extra or {})
    return roots


def radix_nodes(cache: Any) -> int:
    root = getattr(cache, "root", None)
    if root is None:
        return 0
    n, stack = 0, list(root.children.values())
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def gc_type_counts() -> collections.Counter:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


# -- the workload -------------------------------------------------------------------------------


STOP_STRINGS = ["e", "the", "\n", "and", ".", "ou", "!", "ing"]


class Workload:
    """Random request groups (what one HTTP request becomes in the scheduler)."""

    def __init__(self, rng: random.Random, vocab: int, context_len: int, eos: list[int]) -> None:
        self.rng = rng
        self.vocab = vocab
        self.context_len = context_len
        self.eos = eos
        self.prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(16, 96))] for _ in range(32)]
        self.counter = 0

    def prompt(self) -> list[int]:
        r = self.rng
        n = r.randint(4, 200)
        if r.random() < 0.3:
            head = r.choice(self.prefixes)[:n]
            return head + [r.randrange(self.vocab) for _ in range(n - len(head))]
        return [r.randrange(self.vocab) for _ in range(n)]

    def sampling_params(self) -> dict[str, Any]:
        r = self.rng
        sp: dict[str, Any] = {"max_new_tokens": r.randint(1, 32)}
        kind = r.random()
        if kind < 0.35:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = r.choice([0.7, 1.0, 1.3])
            if r.random() < 0.5:
                sp["top_p"] = r.choice([0.8, 0.95])
            if r.random() < 0.4:
                sp["top_k"] = r.choice([5, 40])
            if r.random() < 0.2:
                sp["min_p"] = 0.05
            if kind > 0.75:
                sp["seed"] = r.randrange(1 << 31)
        if r.random() < 0.08:
            sp["repetition_penalty"] = 1.2
        if r.random() < 0.08:
            sp["frequency_penalty"] = 0.5
            sp["presence_penalty"] = 0.3
        if r.random() < 0.15:
            sp["stop"] = r.sample(STOP_STRINGS, r.randint(1, 3))
        if r.random() < 0.05:
            sp["stop_token_ids"] = [r.randrange(self.vocab) for _ in range(2)]
        if r.random() < 0.1:
            sp["min_new_tokens"] = min(2, sp["max_new_tokens"])
        if r.random() < 0.2:
            sp["ignore_eos"] = True
        return sp

    def group(self) -> list[dict[str, Any]]:
        """One HTTP request's scheduler requests: n copies (seed + i) of one prompt."""
        r = self.rng
        n = 1 if r.random() < 0.8 else r.randint(2, 4)
        prompt = self.prompt()
        if r.random() < 0.01:  # refused at admission: longer than the context
            prompt = [r.randrange(self.vocab) for _ in range(self.context_len + 1)]
        sp = self.sampling_params()
        logprob = r.random() < 0.15
        top = r.choice([0, 0, 1, 5]) if logprob else 0
        start = r.choice([-1, -1, 0, len(prompt) // 2]) if logprob else -1
        out = []
        for i in range(n):
            self.counter += 1
            sub = dict(sp)
            if "seed" in sp:
                sub["seed"] = sp["seed"] + i
            out.append({"rid": f"soak-{self.counter}", "input_ids": prompt, "sampling_params": sub,
                        "return_logprob": logprob, "top_logprobs_num": top, "logprob_start_len": start})
        return out


# -- drivers ------------------------------------------------------------------------------------


class _FakeSocket:
    """Collects what the scheduler loop sends; decodes it as the HTTP process would."""

    def __init__(self) -> None:
        from framework.server import ipc

        self.ipc = ipc
        self.finished: list[str] = []
        self.rejected: list[str] = []
        self.replies: list[Any] = []
        self.bytes_sent = 0

    def send(self, data: bytes) -> None:
        self.bytes_sent += len(data)
        msg = self.ipc.decode_from_scheduler(data)
        if isinstance(msg, self.ipc.Outputs):
            self.finished.extend(o.rid for o in msg.outputs if o.finished)
        elif isinstance(msg, self.ipc.Rejected):
            self.rejected.extend(msg.rids)
        elif isinstance(msg, self.ipc.ControlReply):
            self.replies.append(msg)


class LoopDriver:
    """The scheduler process's SchedulerLoop, minus zmq."""

    def __init__(self, overrides: list[str]) -> None:
        from framework.server import ipc
        from framework.server.scheduler_process import SchedulerLoop, _build

        cfg_path = Path(f"/tmp/soak_config_{os.getpid()}.yaml")
        from omegaconf import OmegaConf

        from framework.config.loader import resolve_config

        OmegaConf.save(resolve_config(None, overrides), cfg_path)  # what `plugserve serve` writes
        self.scheduler, self.runner, eos, self.info = _build(str(cfg_path))
        cfg_path.unlink()
        self.eos = eos
        self.sock = _FakeSocket()
        self.loop = SchedulerLoop(self.scheduler, self.runner, eos, recv=None, send=self.sock,  # type: ignore[arg-type]
                                  parent_pid=os.getppid())
        self.ipc = ipc
        self._call = 0

    def submit(self, group: list[dict[str, Any]]) -> None:
        msg = self.ipc.GenerateBatch(reqs=[self.ipc.GenerateReq(**g) for g in group])
        self.loop._handle(self.ipc.encode(msg))

    def abort(self, rids: list[str]) -> None:
        self.loop._handle(self.ipc.encode(self.ipc.Abort(rids=rids)))

    def step(self) -> None:
        """One iteration of SchedulerLoop.run's body (without the blocking receive)."""
        if self.scheduler.has_work():
            outputs = self.loop._step()
            if outputs:
                self.sock.send(self.ipc.encode(self.ipc.Outputs(outputs=outputs, load=self.loop.load())))

    def control(self, kind: str) -> Any:
        self._call += 1
        self.loop._handle(self.ipc.encode(self.ipc.Control(call_id=self._call, kind=kind)))
        return self.sock.replies.pop()

    def flush(self) -> bool:
        return bool(self.control("flush_cache").ok)

    def take_finished(self) -> list[str]:
        done = self.sock.finished + self.sock.rejected
        self.sock.finished, self.sock.rejected = [], []
        return done

    def extra_roots(self) -> dict[str, Any]:
        return {"loop": self.loop, "fake_socket": self.sock}


class EngineDriver:
    """framework.Engine (client-side RequestState, detokenisation and stop strings included)."""

    def __init__(self, overrides: list[str]) -> None:
        from framework.engine.engine import Engine

        self.engine = Engine(overrides=overrides, progress=False)
        self.scheduler = self.engine.scheduler
        self.runner = self.engine.runner
        self.eos = self.engine.eos_token_ids
        self._done: list[str] = []

    def submit(self, group: list[dict[str, Any]]) -> None:
        from framework.scheduler.scheduler import AdmissionError

        added = []
        try:
            for g in group:
                self.engine.submit(g["input_ids"], dict(g["sampling_params"]), rid=g["rid"],
                                   return_logprob=g["return_logprob"], top_logprobs_num=g["top_logprobs_num"],
                                   logprob_start_len=g["logprob_start_len"])
                added.append(g["rid"])
        except AdmissionError:
            for rid in added:
                self.engine.abort(rid)
            for g in group:
                self.engine._states.pop(g["rid"], None)
            self._done.extend(g["rid"] for g in group)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def step(self) -> None:
        if self.scheduler.has_work():
            self.engine.step()
        for rid, state in list(self.engine._states.items()):
            if state.finished:
                state.result()
                del self.engine._states[rid]  # what generate() does with a finished request
                self._done.append(rid)

    def flush(self) -> bool:
        return self.engine.flush_cache()

    def take_finished(self) -> list[str]:
        done, self._done = self._done, []
        return done

    def extra_roots(self) -> dict[str, Any]:
        return {"engine": self.engine}


# -- the soak -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="scheduler requests in total")
    ap.add_argument("--sample-every", type=int, default=1000, help="drain, flush and sample every N requests")
    ap.add_argument("--warmup", type=int, default=2000, help="requests before the baseline sample")
    ap.add_argument("--concurrency", type=int, default=32, help="scheduler requests in flight")
    ap.add_argument("--abort-rate", type=float, default=0.05, help="fraction of groups aborted mid-way")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the embedded model")
    ap.add_argument("--engine", action="store_true", help="drive framework.Engine instead of SchedulerLoop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="device.num_threads")
    ap.add_argument("--gc", action="store_true", help="gc object counts by type at each sample")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                    help="trace Python allocations (FRAMES deep) from the baseline; diff at each sample")
    ap.add_argument("--trim", action="store_true", help="also sample RSS after malloc_trim(0)")
    ap.add_argument("--malloc-info", type=Path, default=None, help="write glibc malloc_info XML here at the end")
    ap.add_argument("--max-growth-mb", type=float, default=None, help="fail if idle RSS grows more than this")
    ap.add_argument("--max-heap-free-mb", type=float, default=None,
                    help="fail if glibc holds more free heap than this at the last idle sample (fragmentation)")
    ap.add_argument("--json", type=Path, default=None, help="write the samples here")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. scheduler.overlap=true")
    args = ap.parse_args(argv)

    overrides = [f"device.num_threads={args.threads}", f"device.seed={args.seed}", *args.overrides]
    if args.tiny:
        from framework.testing.tiny_models import save_tiny_model

        path = Path(f"/tmp/soak_tiny_model_{os.getpid()}")
        if not path.exists():
            save_tiny_model(path)
        overrides.insert(0, f"model.path={path}")

    t0 = time.perf_counter()
    driver = EngineDriver(overrides) if args.engine else LoopDriver(overrides)
    scheduler = driver.scheduler
    rng = random.Random(args.seed)
    work = Workload(rng, driver.runner.vocab_size, scheduler.context_len, driver.eos)
    print(f"# built in {time.perf_counter() - t0:.1f}s; context {scheduler.context_len}, "
          f"KV tokens {scheduler.kv.total_tokens()}, max running {scheduler.max_running}, "
          f"driver {'engine' if args.engine else 'loop'}, MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')}",
          flush=True)

    in_flight: dict[str, list[str]] = {}  # rid -> its group's rids
    abort_at: list[tuple[int, list[str]]] = []  # (step number, rids)
    submitted = steps = 0
    samples: list[dict[str, Any]] = []
    baseline_lengths: dict[str, int] | None = None
    baseline_types: collections.Counter | None = None
    snap0 = None
    t_start = time.perf_counter()
    next_sample = args.warmup if args.warmup > 0 else 0

    def sample(label: str) -> dict[str, Any]:
        nonlocal baseline_lengths, baseline_types, snap0
        gc.collect()
        rec: dict[str, Any] = {"requests": submitted, "label": label,
                               "elapsed_s": round(time.perf_counter() - t_start, 1)}
        rec.update({k: v for k, v in proc_status().items()})
        rec.update(mallinfo())
        if args.trim:
            malloc_trim()
            rec["rss_after_trim"] = proc_status()["VmRSS"]
        rec["radix_nodes"] = radix_nodes(scheduler.kv.cache)
        rec["leak_report"] = scheduler.leak_report()
        lengths = container_lengths(scheduler_roots(scheduler, driver.extra_roots()))
        if baseline_lengths is None:
            baseline_lengths = lengths
        rec["grown_containers"] = {k: (baseline_lengths.get(k, 0), v) for k, v in lengths.items()
                                   if v > baseline_lengths.get(k, 0)}
        if args.gc:
            counts = gc_type_counts()
            if baseline_types is None:
                baseline_types = counts
            diff = {k: counts[k] - baseline_types.get(k, 0) for k in counts}
            rec["gc_objects"] = sum(counts.values())
            rec["gc_growth"] = dict(sorted(((k, v) for k, v in diff.items() if v > 0), key=lambda kv: -kv[1])[:10])
        if args.tracemalloc:
            if snap0 is None:
                tracemalloc.start(args.tracemalloc)
                snap0 = tracemalloc.take_snapshot()
            else:
                snap = tracemalloc.take_snapshot().filter_traces([
                    tracemalloc.Filter(False, tracemalloc.__file__)])
                stats = snap.compare_to(snap0, "traceback" if args.tracemalloc > 1 else "lineno")
                rec["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / MB, 2)
                rec["tracemalloc_top"] = [
                    {"size_diff_kb": round(s.size_diff / 1024, 1), "count_diff": s.count_diff,
                     "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-args.tracemalloc:]}
                    for s in stats[:8] if s.size_diff > 0
                ]
        samples.append(rec)
        base = samples[0]
        print(f"{submitted:>8} req  rss {rec['VmRSS'] / MB:8.1f} MB (anon {rec['RssAnon'] / MB:7.1f}, "
              f"+{(rec['VmRSS'] - base['VmRSS']) / MB:6.1f})"
              + (f"  heap in-use {rec['heap_in_use'] / MB:7.1f} free {rec['heap_free'] / MB:6.1f}"
                 if "heap_in_use" in rec else "")
              + (f"  after-trim {rec['rss_after_trim'] / MB:8.1f}" if args.trim else "")
              + f"  nodes {rec['radix_nodes']}  t {rec['elapsed_s']}s  leaked {rec['leak_report']['leaked']}",
              flush=True)
        for key in ("grown_containers", "gc_growth", "tracemalloc_top"):
            if rec.get(key):
                print(f"         {key}: {json.dumps(rec[key])}", flush=True)
        return rec

    def drain() -> None:
        nonlocal steps
        while in_flight or scheduler.has_work():
            driver.step()
            steps += 1
            for rid in driver.take_finished():
                in_flight.pop(rid, None)
            if steps > 10_000_000:
                raise RuntimeError("drain did not finish")
        abort_at.clear()

    while True:
        if submitted >= next_sample:
            drain()
            if not driver.flush():
                raise RuntimeError("flush_cache refused on an idle scheduler")
            report = scheduler.leak_report()
            if report["leaked"] or report["req_slots_free"] != report["req_slots_total"]:
                raise RuntimeError(f"KV leak: {report}")
            sample("baseline" if not samples else "idle+flushed")
            next_sample += args.sample_every
        if submitted >= args.requests:
            break
        while len(in_flight) < args.concurrency and submitted < min(next_sample, args.requests):
            group = work.group()
            rids = [g["rid"] for g in group]
            for rid in rids:
                in_flight[rid] = rids
            submitted += len(rids)
            driver.submit(group)
            if rng.random() < args.abort_rate:
                abort_at.append((steps + rng.randint(0, 12), rids))
            if rng.random() < 0.005:
                driver.abort([f"soak-unknown-{submitted}"])  # abort of an id the scheduler never had
        driver.step()
        steps += 1
        due = [a for a in abort_at if a[0] <= steps]
        if due:
            abort_at[:] = [a for a in abort_at if a[0] > steps]
            for _, rids in due:
                driver.abort(rids)
        for rid in driver.take_finished():
            in_flight.pop(rid, None)

    total_s = time.perf_counter() - t_start
    if args.malloc_info:
        malloc_info(str(args.malloc_info))
    base, last = samples[0], samples[-1]
    growth = (last["VmRSS"] - base["VmRSS"]) / MB
    measured = max(last["requests"] - base["requests"], 1)
    print(f"# {submitted} requests, {steps} steps in {total_s:.0f}s ({total_s / submitted * 10_000:.0f}s per 10k); "
          f"idle RSS {base['VmRSS'] / MB:.1f} -> {last['VmRSS'] / MB:.1f} MB "
          f"({growth:+.1f} MB, {growth * 1024 / measured * 400:+.1f} KB per 400 requests)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "samples": samples,
                                         "seconds": total_s}, indent=1, default=str))
    failed = False
    if args.max_growth_mb is not None and growth > args.max_growth_mb:
        print(f"# FAIL: idle RSS grew {growth:.1f} MB > {args.max_growth_mb} MB", flush=True)
        failed = True
    free_mb = last.get("heap_free", 0) / MB
    if args.max_heap_free_mb is not None and free_mb > args.max_heap_free_mb:
        print(f"# FAIL: {free_mb:.1f} MB free in the malloc heap while idle > {args.max_heap_free_mb} MB "
              "(fragmentation)", flush=True)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
