"""Built-in observer plugin: logs prefill batches and decode throughput, as SGLang's scheduler does.

It is the built-in user of ``on_batch_scheduled`` / ``on_batch_finished``; the log level of the
``plugserve.batches`` logger controls it (DEBUG by default so tests stay quiet).
"""

from __future__ import annotations

import logging

from framework.hookspecs import hookimpl
from framework.scheduler.stats import BatchStats

logger = logging.getLogger("plugserve.batches")


class BatchLogger:
    """Aggregates decode steps and logs one line per ``interval`` steps."""

    interval = 40

    def __init__(self) -> None:
        self._decode_tokens = 0
        self._decode_time = 0.0
        self._decode_steps = 0

    @hookimpl
    def on_batch_scheduled(self, batch: BatchStats) -> None:
        """Log each prefill batch."""
        if batch.mode in ("prefill", "mixed") and logger.isEnabledFor(logging.INFO):
            logger.info(
                "%s batch: #req %d, #new-token %d, #cached-token %d, kv usage %.2f, "
                "#running %d, #queue %d",
                batch.mode, batch.num_requests, batch.num_new_tokens, batch.num_cached_tokens,
                batch.kv_usage, batch.num_running, batch.num_waiting,
            )

    @hookimpl
    def on_batch_finished(self, batch: BatchStats, elapsed_s: float) -> None:
        """Accumulate decode steps and log the throughput every ``interval`` steps."""
        if batch.mode != "decode":
            return
        self._decode_tokens += batch.num_new_tokens
        self._decode_time += elapsed_s
        self._decode_steps += 1
        if self._decode_steps >= self.interval:
            if logger.isEnabledFor(logging.INFO) and self._decode_time > 0:
                logger.info(
                    "decode: #running %d, kv usage %.2f, gen throughput %.1f tok/s, #queue %d",
                    batch.num_requests, batch.kv_usage,
                    self._decode_tokens / self._decode_time, batch.num_waiting,
                )
            self._decode_tokens, self._decode_time, self._decode_steps = 0, 0.0, 0


plugin = BatchLogger()
