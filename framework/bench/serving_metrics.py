"""Per-request measurements of ``bench serve`` and their summary (throughputs, latency percentiles).

The definitions follow SGLang's and vLLM's ``bench_serving`` so figures compare across them:
TTFT is request start to the first streamed token, TPOT is ``(latency - ttft) / (output_tokens - 1)``
per request, ITL is the gap between consecutive streamed chunks (a chunk may carry several
tokens), and end-to-end latency is request start to the last byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """What one streamed request measured; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    sent_at: float = 0.0
    """``time.perf_counter()`` when the request was sent; ``run_workload`` makes it seconds since the
    measured run's start, so a request log shows which requests waited behind which."""


def tpot(o: RequestOutput) -> float | None:
    """Seconds per output token after the first, or None for a failed or one-token request (no
    such time: counting it as zero would flatter the mean)."""
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.success and o.output_tokens > 1 else None


def request_records(outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    """One JSON-ready dict per request, in request order: when it was sent, its TTFT, TPOT and
    end-to-end latency (ms), its token counts and its error. A summary's p99 names no request;
    these say whether a tail came from one stalled request or from a wave queued behind others."""
    records = []
    for i, o in enumerate(outputs):
        per_token = tpot(o)
        records.append({"index": i, "sent_s": round(o.sent_at, 4), "success": o.success,
                        "ttft_ms": round(o.ttft * 1000.0, 2) if o.success else None,
                        "tpot_ms": None if per_token is None else round(per_token * 1000.0, 3),
                        "e2e_latency_ms": round(o.latency * 1000.0, 2) if o.success else None,
                        "max_itl_ms": round(max(o.itl) * 1000.0, 2) if o.itl else None,
                        "prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens,
                        "error": o.error or None})
    return records


def _stats(values: list[float], name: str, scale: float = 1000.0) -> dict[str, float | None]:
    """mean / median / p99 of ``values`` in milliseconds (None when nothing was measured)."""
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    import numpy as np  # lazily: the CLI imports this module to build its parser

    arr = np.asarray(values, dtype=float) * scale
    return {
        f"mean_{name}_ms": round(float(arr.mean()), 3),
        f"median_{name}_ms": round(float(np.median(arr)), 3),
        f"p99_{name}_ms": round(float(np.percentile(arr, 99)), 3),
    }


def summarize(outputs: list[RequestOutput], duration_s: float) -> dict[str, Any]:
    """The figures of one run: completed requests, throughputs, TTFT / TPOT / ITL / E2E stats."""
    done = [o for o in outputs if o.success]
    in_tokens = sum(o.prompt_tokens for o in done)
    out_tokens = sum(o.output_tokens for o in done)
    tpots = [t for t in map(tpot, done) if t is not None]
    duration_s = max(duration_s, 1e-9)
    errors = [o.error for o in outputs if not o.success]
    return {
        "completed": len(done),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": round(duration_s, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration_s, 3),
        "input_throughput": round(in_tokens / duration_s, 2),
        "output_throughput": round(out_tokens / duration_s, 2),
        **_stats([o.ttft for o in done], "ttft"),
        **_stats(tpots, "tpot"),
        **_stats([gap for o in done for gap in o.itl], "itl"),
        **_stats([o.latency for o in done], "e2e_latency"),
    }


def format_summary(result: dict[str, Any]) -> str:
    """A human-readable table of a summary (the JSON line has the same figures)."""
    lines = [f"{'completed requests':<28}{result['completed']} (failed {result['failed']})",
             f"{'duration (s)':<28}{result['duration_s']}",
             f"{'request throughput (req/s)':<28}{result['request_throughput']}",
             f"{'input throughput (tok/s)':<28}{result['input_throughput']}",
             f"{'output throughput (tok/s)':<28}{result['output_throughput']}"]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")):
        mean, med, p99 = (result[f"{k}_{name}_ms"] for k in ("mean", "median", "p99"))
        lines.append(f"{label + ' (ms) mean/median/p99':<28}{mean} / {med} / {p99}")
    if result.get("first_error"):
        lines.append(f"first error: {result['first_error']}")
    return "\n".join(lines)
