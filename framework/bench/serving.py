"""``plugserve bench serve``: an asyncio client that streams a workload from a running server.

Backends: ``plugserve`` streams SGLang's native ``POST /generate`` (so it also measures an SGLang
server), ``openai`` streams ``POST /v1/completions`` of any OpenAI-compatible server (vLLM,
SGLang, llama.cpp's server, plugserve), prompts sent as token id lists or as text. Token counts
come from the server (``meta_info`` / ``usage``), never from re-tokenising on the client, because
the client's tokenizer may differ from the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from framework.bench.datasets import BenchRequest, add_dataset_args, load_requests
from framework.bench.serving_metrics import RequestOutput, format_summary, request_records, summarize

if TYPE_CHECKING:  # aiohttp is imported where used: the CLI imports this module to build its parser
    import aiohttp

TIMEOUT_S = 6 * 3600.0
"""A whole benchmark request may queue for a long time behind others; only a dead server fails it."""

LINE_LIMIT = 1 << 24
"""Longest SSE line the client reads (a /generate event carries every output id so far)."""

# Why aiohttp (what vLLM's benchmark_serving uses) and not httpx: on a 2-core host the client shares
# the cores with the server it measures. With httpx it used ~135 us of CPU per streamed token (2.2 s
# for 256 requests x 64 tokens at 64 streams, 1.6x the plugserve HTTP process's CPU), with aiohttp's
# C parser ~42 us. Whatever the client takes, the server's OpenMP threads lose, and more: a thread
# it deschedules holds the other one up at the next barrier.


def add_serve_command(bench_sub: Any, common_output: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench serve`` (called from framework/bench/cli.py)."""
    p = bench_sub.add_parser("serve", help="stream a workload from a running server (online serving benchmark)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--backend", choices=["plugserve", "openai"], default="plugserve",
                   help="plugserve: POST /generate (also SGLang); openai: POST /v1/completions")
    p.add_argument("--model", help="model name for /v1/completions (default: the first of /v1/models)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the server's /model_info tokenizer_path)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="openai backend: send prompts as token id lists or as decoded text")
    p.add_argument("--api-key", help="sent as a Bearer token")
    p.add_argument("--admin-key", help="if given, POST /flush_cache after the warm-up (so it gives no cache hits)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not measured) before the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy; e.g. 1.0 measures sampling too)")
    p.add_argument("--disable-tqdm", action="store_true")
    add_requests_log_argument(p)
    common_output(p)
    p.set_defaults(func=cmd_serve)


def add_requests_log_argument(p: argparse.ArgumentParser) -> None:
    """``--requests-log`` (``bench serve``, ``bench serve-compare``)."""
    p.add_argument("--requests-log", help="JSONL file every request's timings are appended to (one line each)")


def append_requests_log(path: str | None, outputs: list[RequestOutput], fields: dict[str, Any]) -> None:
    """One line per request (:func:`request_records`) with ``fields`` in front; nothing without ``path``."""
    from framework.bench.offline import append_result

    for record in request_records(outputs) if path else []:
        append_result(path, {**fields, **record})


def _sse_payloads(line: bytes) -> Any | None:
    """The JSON of one ``data:`` line, None for keep-alives, blank lines and ``[DONE]``."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return None if data in (b"", b"[DONE]") else json.loads(data)


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    return f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"


async def send_generate(client: aiohttp.ClientSession, req: BenchRequest, headers: dict[str, str],
                        temperature: float = 0.0) -> RequestOutput:
    """Stream one request from ``/generate``; every event carries all output ids so far."""
    import aiohttp

    out = RequestOutput(prompt_tokens=len(req.input_ids))
    body = {"input_ids": req.input_ids, "stream": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": req.output_len, "ignore_eos": True}}
    start = last = out.sent_at = time.perf_counter()
    seen = 0
    try:
        async with client.post("/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = await _error_text(resp)
                return out
            async for line in resp.content:
                event = _sse_payloads(line)
                if event is None:
                    continue
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    return out
                now = time.perf_counter()
                n = len(event.get("output_ids") or [])
                if n > seen:  # an event may repeat the state (e.g. only finish_reason changed)
                    if seen == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    seen, last = n, now
                meta = event.get("meta_info") or {}
                out.prompt_tokens = int(meta.get("prompt_tokens", out.prompt_tokens))
                out.output_tokens = int(meta.get("completion_tokens", n))
        out.latency = time.perf_counter() - start
        out.success = out.output_tokens > 0
        if not out.success:
            out.error = "no output tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def send_completion(client: aiohttp.ClientSession, req: BenchRequest, headers: dict[str, str], model: str,
                          prompt: str | list[int], temperature: float = 0.0) -> RequestOutput:
    """Stream one request from ``/v1/completions``, usage from the final chunk (``include_usage``)."""
    import aiohttp

    out = RequestOutput(prompt_tokens=len(req.input_ids))
    # ignore_eos is an SGLang / vLLM extension: without it a random model may stop early and the
    # workload would not be the same from one server to the next.
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = out.sent_at = time.perf_counter()
    chunks = 0
    usage: dict[str, Any] = {}
    try:
        async with client.post("/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = await _error_text(resp)
                return out
            async for line in resp.content:
                chunk = _sse_payloads(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:300]
                    return out
                usage = chunk.get("usage") or usage
                if any(c.get("text") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    chunks, last = chunks + 1, now
        out.latency = time.perf_counter() - start
        out.prompt_tokens = int(usage.get("prompt_tokens", out.prompt_tokens))
        out.output_tokens = int(usage.get("completion_tokens", chunks))  # chunks: servers without usage
        out.success = out.output_tokens > 0 and chunks > 0
        if not out.success:
            out.error = "no output text streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run_workload(base_url: str, requests: list[BenchRequest], backend: str = "plugserve", *,
                       request_rate: float = math.inf, max_concurrency: int | None = None, warmup: int = 1,
                       model: str | None = None, prompts: list[str | list[int]] | None = None,
                       api_key: str | None = None, admin_key: str | None = None, seed: int = 0,
                       progress: bool = True, temperature: float = 0.0) -> tuple[list[RequestOutput], float]:
    """Send the warm-up, then every request (Poisson arrivals, bounded concurrency); return the
    outputs in request order and the wall time of the measured part. ``temperature``: every
    request's (0: greedy; above 0 the server samples from the whole vocabulary each step)."""
    import aiohttp
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = prompts if prompts is not None else [r.input_ids for r in requests]
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: max_concurrency bounds them
    async with aiohttp.ClientSession(base_url=base_url, connector=connector, read_bufsize=LINE_LIMIT,
                                     timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as client:
        if backend == "openai" and model is None:
            async with client.get("/v1/models", headers=headers) as resp:
                resp.raise_for_status()
                model = (await resp.json())["data"][0]["id"]

        async def one(i: int) -> RequestOutput:
            if backend == "openai":
                return await send_completion(client, requests[i], headers, model or "", prompts[i], temperature)
            return await send_generate(client, requests[i], headers, temperature)

        if warmup > 0 and requests:  # first requests pay for lazy initialisation on the server: keep them out
            # Reversed workload prompts: the same shapes, but no shared prefix for the radix cache
            # to hand the measured requests.
            async def warm_one(i: int) -> RequestOutput:
                r = requests[i % len(requests)]
                ids = list(reversed(r.input_ids))
                if backend == "openai":
                    text = prompts[i % len(requests)]
                    prompt = text[::-1] if isinstance(text, str) else ids
                    return await send_completion(client, BenchRequest(ids, r.output_len), headers, model or "", prompt,
                                                 temperature)
                return await send_generate(client, BenchRequest(ids, r.output_len), headers, temperature)

            warm = await asyncio.gather(*(warm_one(i) for i in range(warmup)))
            failed = [w.error for w in warm if not w.success]
            if failed:  # the run would fail the same way: stop before measuring nothing
                raise SystemExit(f"bench serve: the warm-up request failed: {failed[0]}")
            if admin_key:  # also drop whatever an earlier run left in the server's prefix cache
                async with client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_key}"}) as resp:
                    if resp.status != 200:
                        print(f"warning: /flush_cache answered {resp.status}: the run may get cache hits")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=not progress, desc="bench serve")

        async def limited(i: int) -> RequestOutput:
            if sem is None:
                result = await one(i)
            else:
                async with sem:
                    result = await one(i)
            bar.update(1)
            return result

        rng = random.Random(seed)
        tasks = []
        start = time.perf_counter()
        for i in range(len(requests)):
            tasks.append(asyncio.create_task(limited(i)))
            if request_rate != math.inf and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson process: exponential gaps
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    for o in outputs:
        o.sent_at -= start
    return list(outputs), duration


def _tokenizer(args: argparse.Namespace) -> Any:
    """--tokenizer, else the path the server reports in /model_info (a server on this machine)."""
    import httpx
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            info = httpx.get(f"{args.base_url}/model_info", headers=headers, timeout=30).json()
            path = info.get("tokenizer_path") or info.get("model_path")
        except (httpx.HTTPError, ValueError) as exc:
            raise SystemExit(f"cannot read the server's /model_info ({exc}): pass --tokenizer") from exc
        if not path:
            raise SystemExit("the server did not report a tokenizer path: pass --tokenizer")
    return AutoTokenizer.from_pretrained(path)


def cmd_serve(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment

    tokenizer = _tokenizer(args)
    requests = load_requests(args, tokenizer)
    prompts: list[str | list[int]] = [r.input_ids for r in requests]
    if args.backend == "openai" and args.prompt_format == "text":
        prompts = [tokenizer.decode(r.input_ids) for r in requests]
    outputs, duration = asyncio.run(run_workload(
        args.base_url, requests, args.backend, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, warmup=args.warmup, model=args.model, prompts=prompts,
        api_key=args.api_key, admin_key=args.admin_key, seed=args.seed, progress=not args.disable_tqdm,
        temperature=args.temperature))
    result = summarize(outputs, duration)
    print(format_summary(result))
    append_requests_log(args.requests_log, outputs, {"tag": args.tag})
    rate = args.request_rate
    append_result(args.output, {
        "kind": "serve", "tag": args.tag, "backend": args.backend, "base_url": args.base_url,
        "dataset": args.dataset, "num_prompts": len(requests), "prompt_format": args.prompt_format,
        # JSON has no infinity: "inf" keeps the line parseable by any reader
        "request_rate": "inf" if rate == math.inf else rate, "max_concurrency": args.max_concurrency,
        "temperature": args.temperature, **environment(), **result,
    })
    return 0 if result["completed"] > 0 else 1
