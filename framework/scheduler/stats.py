"""What the scheduler's observation hooks receive: small, plain records (cheap to build)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchStats:
    """A batch about to run (``on_batch_scheduled``) or just finished (``on_batch_finished``)."""

    mode: str
    """"prefill", "decode" or "mixed" (a prefill with the running requests' decode rows in it)."""
    num_requests: int
    num_new_tokens: int
    """Tokens computed by this forward."""
    num_cached_tokens: int
    """Prefill only: prompt tokens served from the prefix cache."""
    kv_used_tokens: int
    kv_total_tokens: int
    num_waiting: int
    num_running: int

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0


@dataclass
class RequestStats:
    """A finished (or aborted, or failed) request (``on_request_finished``)."""

    rid: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float
