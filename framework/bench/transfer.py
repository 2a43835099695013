"""``plugserve bench transfer``: KV transfer throughput of each transfer plugin between two real
processes on 127.0.0.1, beside the transfer library's own figure for the same byte count.

The page set is what a fragmented KV allocator hands out: runs of consecutive pages (mean length
``--run-pages``) separated by a gap on the source side and shuffled on the destination side, so
the plugins' run merging (``merge_page_runs``) yields exactly one span per run and buffer. Each
backend runs in a fresh pair of processes (``framework.bench.transfer_peer``). The plugin figure
is timed from the sender's ``send`` to the receiver seeing the room succeed; the raw figure is one
buffer of the same size moved by the library alone (Mooncake ``transfer_sync_write``, a NIXL WRITE,
a gloo ``send``). ``plugin / raw`` is the share of the library's throughput the plugin keeps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BACKENDS = ("nccl", "mooncake", "nixl")
LIBRARY_MODULE = {"nccl": "torch.distributed", "mooncake": "mooncake.engine", "nixl": "nixl._api"}
LAYOUTS = ("whole", "tp1-to-tp2", "tp2-to-tp1")
"""Head layouts of ``bench transfer-heads``: both sides whole, or one side holding half the heads
(defined here, not in the torch-importing peer, so the CLI parser stays light)."""


def add_transfer_command(bench_sub: Any, common_output: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench transfer`` (called from framework/bench/cli.py)."""
    p = bench_sub.add_parser("transfer", help="KV transfer throughput of each transfer plugin vs its library")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--total-mb", type=float, default=256.0, help="MB (1e6 bytes) moved per transfer")
    p.add_argument("--page-kb", type=int, default=32,
                   help="bytes per page and buffer (one layer's K or V), in KiB; 32 = 16 tokens x 8 heads x 128 x fp16")
    p.add_argument("--layers", type=int, default=8, help="layers (each a K and a V buffer)")
    p.add_argument("--run-pages", type=int, default=8, help="mean length of a run of consecutive pages")
    p.add_argument("--iters", type=int, default=5, help="timed transfers per backend (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a backend's pair of processes may take")
    common_output(p)
    p.set_defaults(func=cmd_transfer)


def page_set(num_pages: int, run_pages: int, seed: int) -> tuple[list[int], list[int], int]:
    """Source pages, destination pages (position by position) and the pool size (pages) needed."""
    rng = random.Random(seed)
    runs: list[int] = []
    while sum(runs) < num_pages:
        runs.append(min(rng.randint(1, 2 * run_pages - 1), num_pages - sum(runs)))

    def lay_out(order: list[int]) -> list[list[int]]:
        placed, start = [], 1  # page 0 is the padding page
        for i in order:
            placed.append(list(range(start, start + runs[i])))
            start += runs[i] + 1  # a one-page gap, so runs never merge with each other
        return placed

    src_runs = lay_out(list(range(len(runs))))
    shuffled = list(range(len(runs)))
    rng.shuffle(shuffled)
    dst_by_run = dict(zip(shuffled, lay_out(shuffled), strict=True))
    src = [p for r in src_runs for p in r]
    dst = [p for i in range(len(runs)) for p in dst_by_run[i]]
    return src, dst, num_pages + len(runs) + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run_backend(name: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Both sides of one backend in fresh processes; their two JSON verdicts, merged."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    port = _free_port()
    procs = {role: subprocess.Popen([sys.executable, "-m", "framework.bench.transfer_peer", role, name, str(port),
                                     f.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("prefill", "decode")}
    verdicts: dict[str, dict[str, Any]] = {}
    try:
        for role, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                verdicts[role] = {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
                continue
            lines = [line for line in out.splitlines() if line.startswith("{")]
            verdicts[role] = json.loads(lines[-1]) if lines else {
                "ok": False, "error": f"no verdict (exit {proc.returncode}): {err[-500:]}"}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        Path(f.name).unlink(missing_ok=True)
    return {"prefill": verdicts["prefill"], "decode": verdicts["decode"]}


def summarize_backend(name: str, verdicts: dict[str, dict[str, Any]], moved: int) -> dict[str, Any]:
    """One table row: medians in GB/s (1e9 bytes per second) and plugin / raw."""
    row: dict[str, Any] = {"backend": name}
    errors = [f"{role}: {v['error']}" for role, v in verdicts.items() if not v.get("ok") and v.get("error")]
    if errors or not (verdicts["prefill"].get("ok") and verdicts["decode"].get("ok")):
        row["error"] = "; ".join(errors) or "the received bytes differ from the sent ones"
        return row
    plugin_s, raw_s = verdicts["decode"]["plugin_s"], verdicts["prefill"]["raw_s"]
    plugin = moved / statistics.median(plugin_s) / 1e9
    raw = moved / statistics.median(raw_s) / 1e9
    row.update(plugin_gbps=round(plugin, 3), plugin_best_gbps=round(moved / min(plugin_s) / 1e9, 3),
               raw_gbps=round(raw, 3), raw_best_gbps=round(moved / min(raw_s) / 1e9, 3),
               ratio=round(plugin / raw, 3), raw_library=verdicts["prefill"]["raw_library"],
               plugin_s=plugin_s, raw_s=raw_s)
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'backend':<10}{'plugin GB/s':>13}{'raw GB/s':>11}{'plugin/raw':>12}  raw = "
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['backend']:<10}  {'skipped' if r.get('skipped') else 'FAILED'}: {r['error']}")
        else:
            lines.append(f"{r['backend']:<10}{r['plugin_gbps']:>13.3f}{r['raw_gbps']:>11.3f}{r['ratio']:>12.2f}"
                         f"  {r['raw_library']}")
    return "\n".join(lines)


def page_layout(args: argparse.Namespace) -> tuple[int, int, list[int], list[int], int, int]:
    """``(page_bytes, num_pages, src_pages, dst_pages, pool_pages, merged_runs)`` of a room the
    size ``--total-mb`` asks for (``bench transfer`` and ``bench transfer-heads`` share it)."""
    from framework.disaggregation.addressing import merge_page_runs

    page_bytes = args.page_kb * 1024
    if page_bytes % (16 * 8 * 2):
        raise SystemExit("--page-kb must be a multiple of 4 (a page is 16 tokens x 8 heads x head_dim x fp16)")
    num_pages = max(1, round(args.total_mb * 1e6 / (2 * args.layers * page_bytes)))
    src, dst, pool = page_set(num_pages, args.run_pages, args.seed)
    return page_bytes, num_pages, src, dst, pool, len(merge_page_runs(src, dst))


def cmd_transfer(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment

    page_bytes, num_pages, src, dst, pool, runs = page_layout(args)
    moved = num_pages * 2 * args.layers * page_bytes
    spec = {"layers": args.layers, "page_bytes": page_bytes, "pool_pages": pool, "src_pages": src,
            "dst_pages": dst, "iters": args.iters, "warmup": args.warmup, "timeout_s": args.timeout}
    print(f"moving {moved / 1e6:.1f} MB per transfer: {num_pages} pages x {2 * args.layers} buffers x "
          f"{page_bytes} B, {runs} merged runs ({runs * 2 * args.layers} spans); {args.iters} timed, "
          f"{args.warmup} warm-up", flush=True)
    rows = []
    for name in args.backends:
        if not _installed(LIBRARY_MODULE[name]):
            rows.append({"backend": name, "skipped": True, "error": f"{LIBRARY_MODULE[name]} is not installed"})
            continue
        rows.append(summarize_backend(name, run_backend(name, spec, args.timeout), moved))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    append_result(args.output, {"kind": "transfer", "tag": args.tag, **environment(), "moved_bytes": moved,
                                "pages": num_pages, "page_bytes": page_bytes, "layers": args.layers,
                                "merged_runs": runs, "iters": args.iters, "backends": rows})
    return 0 if all("error" not in r or r.get("skipped") for r in rows) else 1
