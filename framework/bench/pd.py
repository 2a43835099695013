"""``plugserve bench pd``: one serving workload against a unified server, then against a prefill
server + a decode server + ``plugserve router``, all started by the command on 127.0.0.1.

The two setups run one after the other (never side by side), each from a cold start with the
same model, overrides and requests, so the only difference is disaggregation: the KV transfer,
the bootstrap handshake and the router's extra hop. Reported per setup: median and p99 of the
end-to-end latency and of TTFT (and the rest of ``bench serve``'s summary), and PD / unified.
On one machine the prefill and decode servers share its cores, which a real deployment does not.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRANSFER_BACKENDS = ("nccl", "mooncake", "nixl")
COMPARED = ("median_e2e_latency_ms", "p99_e2e_latency_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "output_throughput")


def add_pd_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench pd`` (called from framework/bench/cli.py with its model arguments)."""
    from framework.bench.datasets import add_dataset_args

    p = bench_sub.add_parser("pd", help="one workload against a unified server vs prefill + decode + router")
    common(p)  # overrides (KEY=VALUE) go to every server
    add_dataset_args(p)
    p.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default="nccl")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) before each run")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to become healthy")
    p.add_argument("--log-dir", help="where the servers' logs go (default: a temporary directory)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=cmd_pd)


class Process:
    """A ``plugserve`` subcommand in its own process, its output in a log file."""

    def __init__(self, args: list[str], port: int, log: Path, *, command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        # ``command``: run that instead of ``plugserve ARGS`` (a peer's server, e.g. vLLM's)
        self.port, self.log = port, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command or [sys.executable, "-m", "framework.cli.main", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench: {self.log.name[:-4]} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"bench: {self.log.name[:-4]} not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(args: argparse.Namespace, model: str | None) -> list[str]:
    """``serve`` arguments shared by every server: --config, the model, the user's overrides."""
    base = ["serve", *(["--config", args.config] if args.config else [])]
    return [*base, *([f"model.path={model}"] if model else []), "server.log_level=warning", *args.overrides]


def start_unified(args: argparse.Namespace, model: str | None, logs: Path) -> list[Process]:
    port = _free_port()
    return [Process([*server_args(args, model), f"server.port={port}"], port, logs / "unified.log")]


def start_pd(args: argparse.Namespace, model: str | None, logs: Path) -> list[Process]:
    """Prefill, decode, router (the router last in the list: it is waited for first, and stopped first)."""
    p_port, d_port, b_port, r_port = (_free_port() for _ in range(4))
    pd = [f"disaggregation.transfer_backend={args.transfer_backend}"]
    prefill = Process([*server_args(args, model), *pd, f"server.port={p_port}", "disaggregation.mode=prefill",
                       f"disaggregation.bootstrap_port={b_port}"], p_port, logs / "prefill.log")
    decode = Process([*server_args(args, model), *pd, f"server.port={d_port}", "disaggregation.mode=decode",
                      "memory_pool.name=decode_prealloc"], d_port, logs / "decode.log")
    router = Process(["router", "--prefill", prefill.url, str(b_port), "--decode", decode.url, "--port", str(r_port)],
                     r_port, logs / "router.log")
    return [prefill, decode, router]


def measure(args: argparse.Namespace, procs: list[Process], requests: list[Any] | None) -> tuple[dict, list]:
    """Wait for the processes, run the workload against the last one; (summary, requests)."""
    from framework.bench.datasets import load_requests
    from framework.bench.serving import run_workload
    from framework.bench.serving_metrics import format_summary, summarize

    for p in reversed(procs):
        p.wait_healthy(args.start_timeout)
    if requests is None:
        requests = load_requests(args, _tokenizer(procs[0].url))
    outputs, duration = asyncio.run(run_workload(
        procs[-1].url, requests, "plugserve", request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        warmup=args.warmup, progress=not args.disable_tqdm))
    result = summarize(outputs, duration)
    print(format_summary(result), flush=True)
    return result, requests


def _tokenizer(url: str) -> Any:
    """The server's own tokenizer (it runs on this machine), for the dataset's vocabulary."""
    import httpx
    from transformers import AutoTokenizer

    info = httpx.get(f"{url}/model_info", timeout=30).json()
    return AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])


def ratios(unified: dict[str, Any], pd: dict[str, Any]) -> dict[str, float | None]:
    """PD / unified for the compared figures (None where either is missing or zero)."""
    out: dict[str, float | None] = {}
    for key in COMPARED:
        a, b = unified.get(key), pd.get(key)
        out[key] = round(b / a, 3) if a and b is not None else None
    return out


def format_table(unified: dict[str, Any], pd: dict[str, Any], ratio: dict[str, float | None]) -> str:
    lines = [f"{'':<26}{'unified':>12}{'pd':>12}{'pd/unified':>12}", "-" * 62]
    for key in COMPARED:
        r = ratio[key]
        lines.append(f"{key:<26}{unified.get(key) or 0:>12.2f}{pd.get(key) or 0:>12.2f}"
                     f"{'-' if r is None else f'{r:.3f}':>12}")
    return "\n".join(lines)


def cmd_pd(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment
    from framework.bench.random_model import make_random_model

    model = args.model_path
    if args.random_model:
        model = str(make_random_model(args.random_model, tempfile.gettempdir() + "/plugserve-bench-models"))
    shown = model
    if shown is None:  # the config's model (the embedded default unless --config / overrides name one)
        from framework.config.loader import resolve_config

        shown = str(resolve_config(args.config, list(args.overrides)).model.path)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="plugserve-bench-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    requests = None
    for name, start in (("unified", start_unified), ("pd", start_pd)):
        print(f"== {name} (logs in {logs})", flush=True)
        procs = start(args, model, logs)
        try:
            results[name], requests = measure(args, procs, requests)
        finally:
            for p in reversed(procs):
                p.stop()
    ratio = ratios(results["unified"], results["pd"])
    print()
    print(format_table(results["unified"], results["pd"], ratio))
    append_result(args.output, {
        "kind": "pd", "tag": args.tag, "model": shown, "overrides": list(args.overrides),
        "transfer_backend": args.transfer_backend, "dataset": args.dataset, "num_prompts": len(requests or []),
        "request_rate": "inf" if args.request_rate == math.inf else args.request_rate,
        "max_concurrency": args.max_concurrency, **environment(), "unified": results["unified"],
        "pd": results["pd"], "pd_over_unified": ratio,
    })
    ok = all(r["completed"] > 0 and r["failed"] == 0 for r in results.values())
    return 0 if ok else 1
