"""The server's metrics under SGLang's Prometheus names (``server.sglang_metric_names``).

SGLang's dashboards query names such as ``sglang:num_running_reqs`` and
``sglang:time_to_first_token_seconds`` with a ``model_name`` label; with the switch on, plugserve
exports those next to its own ``plugserve_*`` names, from the same observations, so a Grafana
board built for SGLang works unchanged. The names and types follow SGLang's production metrics
documentation; the values are plugserve's own (e.g. ``sglang:gen_throughput`` is measured over the
last :data:`GEN_THROUGHPUT_WINDOW_S` seconds of streamed tokens, seen from the HTTP process).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 25.0, 30.0)
"""SGLang's time-to-first-token buckets, in seconds (so its dashboards' quantiles line up)."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
"""SGLang's end-to-end latency buckets, in seconds."""
TOKEN_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5)
"""Buckets of the per-token latencies (time per output token, inter-token latency), in seconds."""
GEN_THROUGHPUT_WINDOW_S = 5.0
"""``sglang:gen_throughput`` is the tokens streamed over this many seconds, divided by it."""
PREFIX = "sglang:"


class SGLangMetrics:
    """SGLang-named collectors in ``registry``, every one labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        label = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, names, registry=registry).labels(**label)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, names, registry=registry).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry).labels(**label)

        self.num_running_reqs = gauge("num_running_reqs", "The number of running requests")
        self.num_queue_reqs = gauge("num_queue_reqs", "The number of requests in the waiting queue")
        self.num_used_tokens = gauge("num_used_tokens", "The number of used tokens")
        self.token_usage = gauge("token_usage", "The token usage")
        self.cache_hit_rate = gauge("cache_hit_rate", "The cache hit rate")
        self.gen_throughput = gauge("gen_throughput", "The generate throughput (token/s)")
        self.gen_throughput.set_function(self._throughput)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of prompt tokens served from the prefix cache.")
        self.num_requests = counter("num_requests", "Number of requests processed.")
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             E2E_BUCKETS)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def _throughput(self) -> float:
        cutoff = time.monotonic() - GEN_THROUGHPUT_WINDOW_S
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / GEN_THROUGHPUT_WINDOW_S

    def tokens(self, count: int, previous_at: float | None, now: float) -> None:
        """``count`` tokens of one request arrived at ``now``; its previous ones at ``previous_at``
        (None for its first): each new token is ``(now - previous_at) / count`` after the last."""
        self._recent.append((now, count))
        if previous_at is not None and count > 0:
            gap = (now - previous_at) / count
            for _ in range(count):
                self.itl.observe(gap)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, e2e_s: float,
                 tpot_s: float | None) -> None:
        self.num_requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def update_load(self, running: int, waiting: int, used: int, usage: float, hit_rate: float) -> None:
        self.num_running_reqs.set(running)
        self.num_queue_reqs.set(waiting)
        self.num_used_tokens.set(used)
        self.token_usage.set(usage)
        self.cache_hit_rate.set(hit_rate)
