"""The constrained-decoding parts of a scheduler step: admitting requests whose grammar compiled,
and jump-forward (``grammar.jump_forward``). They use only the scheduler's public API."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

from framework.scheduler.finish import check_finished
from framework.scheduler.request import FinishReason

if TYPE_CHECKING:
    from framework.scheduler.scheduler import Scheduler


def admit_compiled(s: Scheduler) -> None:
    """Requests whose grammar is compiled join the waiting queue (a failed compile fails its
    request); with nothing else to run, wait a moment for a compile instead of spinning."""
    if not s.grammar.pending:
        return
    if s.settings.parallel.tp_size > 1:
        # Every tensor-parallel rank must admit the same requests at the same step, and compile
        # threads finish at different times on each: wait for them all (off the fast path).
        futures = [r.grammar_future for r in s.grammar.pending if r.grammar_future is not None]
        concurrent.futures.wait(futures)
    elif not (s.waiting or s.running or s.chunked or s.loop.has_work()):
        s.grammar.wait(s.settings.grammar.queue_poll_s)
    for req, error in s.grammar.poll():
        if error is None:
            s.waiting.append(req)
        else:
            req.finished_reason = FinishReason("abort", message=error)
            s.finish(req, error=error)


def jump_forward(s: Scheduler) -> None:
    """``grammar.jump_forward``: a running constrained request whose grammar forces its next
    tokens gets them without sampling, leaves the decode batch and re-queues at the front, so
    one prefill computes their KV (its own KV goes to the prefix cache and is matched again)."""
    if not s.settings.grammar.jump_forward or s.loop.has_work():
        return
    for req in [r for r in s.running if r.grammar is not None]:
        tokens = s.grammar.jump_forward(req)
        if not tokens:
            continue
        req.output_ids.extend(tokens)
        s.running.remove(req)
        reason = FinishReason("stop") if req.grammar.is_terminated() else None
        reason = reason or check_finished(req, s.context_len, s.tokenizer)
        if reason is not None:
            req.finished_reason = reason
            s.finish(req)
            continue
        s.kv.release(req)
        s.waiting.insert(0, req)
        s.emit(req)
