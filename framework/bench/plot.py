"""``plugserve bench plot RESULTS.jsonl --out DIR``: PNG charts from the benchmark JSON lines.

Charts (each written only when the results hold runs it can use):
- ``throughput_vs_concurrency.png``: output throughput of ``bench serve`` runs against their
  ``--max-concurrency``, one line per tag (or backend);
- ``latency_percentiles.png``: mean / median / p99 TTFT, TPOT, ITL and end-to-end latency of each
  ``bench serve`` configuration;
- ``radix_cache.png``: ``bench offline`` throughput with the radix cache on and off, per dataset.
Runs of the same configuration are repeated on a noisy machine, so every point is the median of
the runs that share it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency"))


def add_plot_command(bench_sub: Any) -> None:
    """Register ``bench plot`` (called from framework/bench/cli.py)."""
    p = bench_sub.add_parser("plot", help="PNG charts from a results JSONL file")
    p.add_argument("results", help="JSONL written by bench serve / offline / one-batch")
    p.add_argument("--out", default="bench_results/plots", help="directory the PNG files are written to")
    p.set_defaults(func=cmd_plot)


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Every JSON object of the file; blank and unparseable lines are skipped (a run killed while
    appending leaves a partial line, which must not hide the others)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def radix_state(row: dict[str, Any]) -> bool | None:
    """True / False when an offline run says whether the radix cache was on, else None.

    The overrides decide (``radix_cache.enabled=false``); otherwise a tag mentioning radix, as in
    ``radix-off``, ``no-radix`` or ``radix-on``.
    """
    for item in row.get("overrides") or []:
        key, _, value = str(item).partition("=")
        if key.strip() == "radix_cache.enabled":
            return value.strip().lower() not in ("false", "0", "no", "off")
    tag = str(row.get("tag") or "").lower()
    if "radix" not in tag:
        return None
    return not any(word in tag for word in ("radix-off", "radix_off", "radix=off", "no-radix", "no_radix", "noradix"))


def _label(row: dict[str, Any]) -> str:
    return str(row.get("tag") or row.get("backend") or "run")


def _concurrency(row: dict[str, Any]) -> int:
    """--max-concurrency, or the number of prompts when unbounded (all may be in flight)."""
    return int(row.get("max_concurrency") or row.get("num_prompts") or row.get("completed") or 0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def plot_throughput(serve: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in serve:
        series[_label(row)][_concurrency(row)].append(float(row["output_throughput"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(series.items()):
        xs = sorted(points)
        ax.plot(xs, [_median(points[x]) for x in xs], marker="o", label=label)
    # Concurrency is swept in powers of two: a log axis spaces them evenly, ticks at the values run
    ticks = sorted({x for points in series.values() for x in points if x > 0})
    if ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("bench serve: throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "throughput_vs_concurrency.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(serve: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order: dict[str, tuple[str, int]] = {}
    for row in serve:
        name = f"{_label(row)} c={_concurrency(row)}"
        groups[name].append(row)
        order[name] = (_label(row), _concurrency(row))
    names = sorted(groups, key=order.__getitem__)  # by series, then by concurrency as a number
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    width = 0.8 / 3
    x = np.arange(len(names))
    for ax, (key, title) in zip(axes.flat, METRICS, strict=True):
        for j, stat in enumerate(("mean", "median", "p99")):
            vals = [_median([r[f"{stat}_{key}_ms"] for r in groups[n] if r.get(f"{stat}_{key}_ms") is not None])
                    for n in names]
            ax.bar(x + (j - 1) * width, vals, width, label=stat)
        ax.set_title(f"{title} (ms)")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("bench serve: latency percentiles")
    path = out / "latency_percentiles.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_radix(offline: list[dict[str, Any]], out: Path) -> Path | None:
    import matplotlib.pyplot as plt
    import numpy as np

    by_dataset: dict[str, dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
    for row in offline:
        state = radix_state(row)
        if state is not None and "output_throughput" in row:
            by_dataset[str(row.get("dataset", "?"))][state].append(float(row["output_throughput"]))
    if not by_dataset:
        return None
    names = sorted(by_dataset)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for j, (state, label) in enumerate(((True, "radix cache on"), (False, "radix cache off"))):
        vals = [_median(by_dataset[n][state]) for n in names]
        bars = ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    for i, n in enumerate(names):  # the ratio is the figure the goal is stated in
        on, off = _median(by_dataset[n][True]), _median(by_dataset[n][False])
        if on == on and off == off and off > 0:  # both measured (NaN != NaN)
            ax.annotate(f"{on / off:.1f}x", (i, max(on, off)), ha="center", va="bottom", xytext=(0, 12),
                        textcoords="offset points")
    ax.set_xticks(x, names)
    ax.margins(y=0.2)  # room above the bars for the ratio
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("bench offline: radix cache on vs off")
    ax.legend()
    path = out / "radix_cache.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(results: str | Path, out: str | Path) -> list[Path]:
    """Write every chart the results allow; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    rows = load_results(results)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    serve = [r for r in rows if r.get("kind") == "serve" and "output_throughput" in r]
    offline = [r for r in rows if r.get("kind") == "offline"]
    written: list[Path] = []
    if serve:
        written += [plot_throughput(serve, out), plot_latency(serve, out)]
    else:
        print("no bench serve runs: skipping throughput_vs_concurrency.png and latency_percentiles.png")
    radix = plot_radix(offline, out)
    if radix is None:
        print("no bench offline runs tagged radix on/off (or with radix_cache.enabled overrides): "
              "skipping radix_cache.png")
    else:
        written.append(radix)
    return written


def cmd_plot(args: argparse.Namespace) -> int:
    written = make_plots(args.results, args.out)
    for path in written:
        print(path)
    return 0 if written else 1
