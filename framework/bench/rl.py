"""``plugserve bench rl``: the latency of each RL call on the in-process engine.

Measured, each ``--repeats`` times (the median is reported): release and resume of every tag
(with the resident memory before, released and after), pause with retraction and continue,
``update_weights_from_disk`` (the served checkpoint again), ``update_weights_from_tensor`` (all
tensors, in ``--chunks`` calls), ``update_weights_from_distributed`` (a trainer process
broadcasting every tensor over a gloo group, in ``--chunks`` calls) and ``get_weights_by_name``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any


def add_rl_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench rl`` (called from framework/bench/cli.py with its model arguments)."""
    p = bench_sub.add_parser("rl", help="latency of release/resume, weight updates and pauses")
    common(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, default=8, help="calls a full weight update is split into")
    p.set_defaults(func=cmd_rl)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _timed(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chunks(items: list, n: int) -> list[list]:
    size = max(1, -(-len(items) // n))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _trainer(port: int, path: str, chunks: int, repeats: int) -> None:
    """The trainer process: joins the group as rank 0 and broadcasts the checkpoint's tensors."""
    from safetensors.torch import load_file

    from framework.executor.weight_sync import WeightUpdateGroup
    from framework.models.loader import safetensors_files

    state: dict = {}
    for file in safetensors_files(path):
        state.update(load_file(file))
    group = WeightUpdateGroup("127.0.0.1", port, 0, 2, "bench", "gloo", timeout_s=300)
    for _ in range(repeats):
        for chunk in _chunks(sorted(state), chunks):
            group.broadcast([state[n] for n in chunk])
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rl_bench(engine: Any, repeats: int, chunks: int) -> dict[str, Any]:
    """Every measurement of the module docstring, on ``engine``."""
    from safetensors.torch import load_file

    from framework.models.loader import safetensors_files

    path = engine.runner.model_path
    prompt = list(range(1, 129))
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    engine.generate([prompt] * 4, params)  # warm
    out: dict[str, Any] = {"weights_mib": engine.runner.weights.nbytes() / 2**20}
    kv = engine.runner.kv_cache
    out["kv_cache_mib"] = sum(b.numel() * b.element_size() for b in kv.k_buffers + kv.v_buffers) / 2**20
    rss_before = _rss_mib()
    out["release_all_s"] = _timed(engine.release_memory_occupation, 1)
    out["rss_mib"] = {"before": rss_before, "released": _rss_mib()}
    out["resume_all_s"] = _timed(engine.resume_memory_occupation, 1)
    out["rss_mib"]["resumed"] = _rss_mib()
    if repeats > 1:
        out["release_all_s"] = _timed(engine.release_memory_occupation, repeats - 1,
                                      before=engine.resume_memory_occupation)
        out["resume_all_s"] = _timed(engine.resume_memory_occupation, repeats - 1,
                                     before=engine.release_memory_occupation)
    for tag in ("weights", "kv_cache"):
        out[f"release_{tag}_s"] = _timed(lambda t=tag: engine.release_memory_occupation([t]), repeats,
                                         before=lambda: engine.resume_memory_occupation())
        engine.resume_memory_occupation()

    def start_requests() -> None:
        for _ in range(8):
            engine.submit(prompt, params)
        for _ in range(4):
            engine.step()

    def pause_retract() -> None:
        engine.pause_generation("retract")

    out["pause_retract_8_running_s"] = _timed(pause_retract, repeats,
                                              before=lambda: (engine.continue_generation(), start_requests()))
    engine.continue_generation()
    engine.run_until_done(list(engine._states))
    engine._states.clear()

    out["update_from_disk_s"] = _timed(lambda: engine.update_weights_from_disk(path), repeats)
    state: dict = {}
    for file in safetensors_files(path):
        state.update(load_file(file))
    named = sorted(state.items())

    def update_tensors() -> None:
        for chunk in _chunks(named, chunks):
            engine.update_weights_from_tensor(chunk)

    out["update_from_tensor_s"] = _timed(update_tensors, repeats)
    port = _free_port()
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(port, path, chunks, repeats))
    trainer.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench", "gloo", timeout_s=300)

    def update_distributed() -> None:
        for chunk in _chunks(named, chunks):
            engine.update_weights_from_distributed([n for n, _ in chunk], [str(t.dtype)[6:] for _, t in chunk],
                                                   [list(t.shape) for _, t in chunk], "bench")

    out["update_from_distributed_s"] = _timed(update_distributed, repeats)
    trainer.join(60)
    engine.destroy_weights_update_group("bench")
    out["get_weights_by_name_s"] = _timed(lambda: engine.get_weights_by_name("model.layers.0.mlp.up_proj.weight"),
                                          repeats)
    out["chunks"], out["repeats"] = chunks, repeats
    return out


def cmd_rl(args: argparse.Namespace) -> int:
    from framework.bench.cli import _record
    from framework.bench.offline import engine_from_args

    engine, _ = engine_from_args(args)
    return _record(args, "rl", engine, run_rl_bench(engine, args.repeats, args.chunks))
