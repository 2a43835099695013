"""Retraction: taking running requests back to the waiting queue (their KV to the prefix cache)
when KV runs out for the next decode step, or when generation is paused with ``retract``. They
use only the scheduler's public API."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from framework.scheduler.request import FinishReason, Req

if TYPE_CHECKING:
    from framework.scheduler.scheduler import Scheduler

logger = logging.getLogger("framework.scheduler.scheduler")


def retract(s: Scheduler, req: Req) -> None:
    """Take a running (or mid-prefill) request back to the front of the waiting queue; its
    computed KV goes to the prefix cache, and it is prefilled again later."""
    if req is s.chunked:
        s.chunked = None
        req.extend_len = 0
    elif req in s.running:
        s.running.remove(req)
    s.kv.release(req)
    req.retractions += 1
    s.num_retractions += 1
    s.waiting.insert(0, req)


def retract_all(s: Scheduler) -> int:
    """Retract every running request (``pause_generation`` mode retract); how many."""
    victims = list(s.running) + ([s.chunked] if s.chunked is not None else [])
    for req in sorted(victims, key=lambda r: r.arrival_time, reverse=True):
        retract(s, req)  # newest first, so the oldest ends up first in the queue
    return len(victims)


def make_room_for_decode(s: Scheduler) -> None:
    """Retract the newest requests until this step fits in KV; after a retraction, also keep
    ``retract_decode_steps`` steps of headroom so the batch does not retract again at once."""
    retracted = False
    while s.running:
        need = s.kv.decode_tokens_needed(s.running)
        with_headroom = need
        if retracted:
            headroom = s.cfg.retract_decode_steps * len(s.running) * s.kv.page_size
            with_headroom = max(need, min(headroom, s.kv.total_tokens() // 2))
        available = s.kv.available_tokens()
        if available >= with_headroom or (len(s.running) == 1 and available >= need):
            break
        if len(s.running) == 1:
            req = s.running.pop()
            req.finished_reason = FinishReason("abort", message="KV cache too small for this request")
            s.finish(req, error=req.finished_reason.message)
            break
        retract(s, max(s.running, key=lambda r: r.arrival_time))  # its KV stays cached, evictable
        retracted = True
    if retracted:
        s.new_token_ratio = s.cfg.init_new_token_ratio
        logger.info("retracted requests: %d running, %d waiting", len(s.running), len(s.waiting))


def fail_unrecomputable(s: Scheduler) -> None:
    """Finish, alone and with a clear error, each waiting request whose next prefill would need
    an image encoder input it does not have.

    A PD decode server receives an image request's KV but not its pixels. Retracted under KV
    pressure, the request is prefilled again from the prefix cache, where its images' KV normally
    still is; once evicted, nothing can recompute it, and a forward that tried would fail every
    request of its batch. Checked only for requests that lack pixels (rare), once per step."""
    for req in [r for r in s.waiting if r.mm_inputs is not None and r.mm_inputs.items]:
        need = req.mm_inputs.pixels_needed_until()
        if need == 0 or s.kv.match(req).prefix_len >= need:
            continue
        s.waiting.remove(req)
        req.finished_reason = FinishReason(
            "abort", message="this server has no pixels for the request's images (a PD decode server) and their "
                             "KV left the prefix cache after the request was retracted; send it again")
        s.finish(req, error=req.finished_reason.message)

