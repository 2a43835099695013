"""``plugserve bench transfer-heads``: KV transfer throughput of head-sliced rooms vs whole pages.

When prefill and decode run different TP sizes, a link moves only some KV heads of each token
(``framework.disaggregation.heads``), so a room becomes one strided region per token slot per
buffer instead of one span per run of pages. This bench moves the same page set (the fragmented
one of ``bench transfer``) three ways per backend, each in a fresh pair of processes
(``framework.bench.transfer_peer``):

- ``whole``: 8 heads on both sides (what equal TP sizes move);
- ``tp1-to-tp2``: the sender holds 8 heads and sends heads 0..3 (a decode rank of a TP 2 server);
- ``tp2-to-tp1``: the sender holds 4 heads and writes them into heads 0..3 of an 8-head cache.

A head slice moves half the bytes of a whole page; the table gives GB/s of bytes actually moved,
the milliseconds per room, and the library's raw figure for one buffer of that many bytes.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from framework.bench.transfer import (
    BACKENDS,
    LAYOUTS,
    LIBRARY_MODULE,
    _installed,
    page_layout,
    run_backend,
    summarize_backend,
)


def add_transfer_heads_command(bench_sub: Any, common_output: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench transfer-heads`` (called from framework/bench/cli.py)."""
    p = bench_sub.add_parser("transfer-heads", help="KV transfer throughput: head-sliced rooms vs whole pages")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--total-mb", type=float, default=64.0, help="MB (1e6 bytes) of whole pages per room")
    p.add_argument("--page-kb", type=int, default=32,
                   help="bytes per 8-head page and buffer, in KiB; 32 = 16 tokens x 8 heads x 128 x fp16")
    p.add_argument("--layers", type=int, default=8, help="layers (each a K and a V buffer)")
    p.add_argument("--run-pages", type=int, default=8, help="mean length of a run of consecutive pages")
    p.add_argument("--iters", type=int, default=5, help="timed rooms per backend and layout (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rooms first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a pair of processes may take")
    common_output(p)
    p.set_defaults(func=cmd_transfer_heads)


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = f"{'backend':<10}{'layout':<12}{'MB moved':>10}{'ms/room':>10}{'GB/s':>9}{'raw GB/s':>10}{'plugin/raw':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['backend']:<10}{r['layout']:<12}  {'skipped' if r.get('skipped') else 'FAILED'}: "
                         f"{r['error']}")
        else:
            lines.append(f"{r['backend']:<10}{r['layout']:<12}{r['moved_mb']:>10.1f}{r['ms_per_room']:>10.1f}"
                         f"{r['plugin_gbps']:>9.3f}{r['raw_gbps']:>10.3f}{r['ratio']:>12.2f}")
    return "\n".join(lines)


def cmd_transfer_heads(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment

    page_bytes, num_pages, src, dst, pool, runs = page_layout(args)
    print(f"{num_pages} pages x {2 * args.layers} buffers, {runs} merged runs: whole pages = {runs * 2 * args.layers} "
          f"spans, a head slice = {num_pages * 16 * 2 * args.layers} (one per token slot)", flush=True)
    rows = []
    for name in args.backends:
        for layout in args.layouts:
            if not _installed(LIBRARY_MODULE[name]):
                rows.append({"backend": name, "layout": layout, "skipped": True,
                             "error": f"{LIBRARY_MODULE[name]} is not installed"})
                continue
            spec = {"layers": args.layers, "page_bytes": page_bytes, "pool_pages": pool, "src_pages": src,
                    "dst_pages": dst, "iters": args.iters, "warmup": args.warmup, "timeout_s": args.timeout,
                    "layout": layout}
            moved = num_pages * 2 * args.layers * page_bytes // (1 if layout == "whole" else 2)
            row = {**summarize_backend(name, run_backend(name, spec, args.timeout), moved), "layout": layout}
            if "error" not in row:
                row.update(moved_mb=moved / 1e6, ms_per_room=round(statistics.median(row["plugin_s"]) * 1e3, 2))
            rows.append(row)
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_rows(rows))
    append_result(args.output, {"kind": "transfer_heads", "tag": args.tag, **environment(), "pages": num_pages,
                                "page_bytes": page_bytes, "layers": args.layers, "merged_runs": runs,
                                "iters": args.iters, "rows": rows})
    return 0 if all("error" not in r or r.get("skipped") for r in rows) else 1
