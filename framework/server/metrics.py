"""Prometheus metrics of the HTTP server, and the built-in plugin that mounts ``GET /metrics``.

:class:`ServerMetrics` is fed by the tokenizer manager (per-request counters and latencies, seen
from the HTTP process, which is what a client experiences) and by the scheduler's load reports
(queue length, running requests, KV usage, prefix-cache hit rate). It uses its own
``CollectorRegistry`` so that two servers in one process (tests) do not collide.

The route itself is contributed through the ``extend_http_routes`` hook by :data:`plugin`, which
``pyproject.toml`` declares as a built-in entry point: the server's own metrics use the same hook
a third-party plugin would.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from framework.hookspecs import hookimpl
from framework.server.sglang_metrics import SGLangMetrics

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Time-to-first-token histogram buckets, in seconds."""
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Time-per-output-token histogram buckets, in seconds."""
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""End-to-end request latency histogram buckets, in seconds."""

PREFIX = "plugserve"


class ServerMetrics:
    """The server's Prometheus collectors; with ``sglang_names`` also SGLang's names, labelled
    ``model_name`` (see :mod:`framework.server.sglang_metrics`)."""

    def __init__(self, model_name: str = "", sglang_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Gauge(f"{PREFIX}_num_queue_requests", "Requests waiting in the scheduler", registry=r)
        self.running = Gauge(f"{PREFIX}_num_running_requests", "Requests running in the scheduler", registry=r)
        self.kv_usage = Gauge(f"{PREFIX}_kv_cache_usage", "Fraction of KV cache tokens in use", registry=r)
        self.kv_used = Gauge(f"{PREFIX}_kv_cache_used_tokens", "KV cache tokens in use", registry=r)
        self.hit_rate = Gauge(f"{PREFIX}_prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens seen", registry=r)
        self.retractions = Gauge(f"{PREFIX}_num_retractions", "Decode retractions since start", registry=r)
        self.sglang = SGLangMetrics(r, model_name) if sglang_names else None

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        if self.sglang is not None:
            self.sglang.first_token(seconds)

    def tokens(self, count: int, previous_at: float | None, now: float) -> None:
        """``count`` streamed tokens of one request at ``now`` (its previous ones at ``previous_at``)."""
        if self.sglang is not None:
            self.sglang.tokens(count, previous_at, now)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                 created: float, first_token_at: float | None) -> None:
        """Record a finished (or aborted) request; times are ``time.monotonic()`` values."""
        now = time.monotonic()
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(now - created)
        tpot = None
        if first_token_at is not None and completion_tokens > 1:
            tpot = (now - first_token_at) / (completion_tokens - 1)
            self.tpot.observe(tpot)
        if self.sglang is not None:
            self.sglang.finished(prompt_tokens, completion_tokens, cached_tokens, now - created, tpot)

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def update_load(self, load: dict[str, Any]) -> None:
        """Scheduler gauges from a load report (see ``SchedulerLoop.load``)."""
        self.queue.set(load.get("num_waiting", 0))
        self.running.set(load.get("num_running", 0))
        used, total = load.get("kv_used_tokens", 0), load.get("kv_total_tokens", 0)
        self.kv_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)
        self.hit_rate.set(load.get("prefix_cache_hit_rate", 0.0))
        self.retractions.set(load.get("num_retractions", 0))
        if self.sglang is not None:
            self.sglang.update_load(load.get("num_running", 0), load.get("num_waiting", 0), used,
                                    used / total if total else 0.0, load.get("prefix_cache_hit_rate", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: refresh the scheduler gauges, then render the Prometheus text format."""
    server = request.app.state.server
    await server.manager.refresh_load()
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class MetricsPlugin:
    """Built-in plugin: mounts ``GET /metrics`` through ``extend_http_routes``."""

    @hookimpl
    def extend_http_routes(self, config: Any) -> list:
        """The /metrics route (it reads the server state the app keeps in ``app.state.server``)."""
        return [Route("/metrics", metrics_endpoint, methods=["GET"])]


plugin = MetricsPlugin()
