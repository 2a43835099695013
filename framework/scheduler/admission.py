"""Whether the scheduler can take a request: the checks ``Scheduler.add_request`` runs first.

A request that can never run (bad ids or sampling parameters, too long for the context, a feature
this model or configuration lacks) gets :class:`AdmissionError`, which the server turns into an
HTTP 400 naming the problem; one the server cannot take *now* (memory released for RL, a full
waiting queue) gets :class:`UnavailableError`, an HTTP 503. Nothing is queued or allocated before
every check has passed, so a refused request leaves no state behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from framework.sampling.logit_processor import check_custom_logit_processor

if TYPE_CHECKING:
    from framework.scheduler.request import Req
    from framework.scheduler.scheduler import Scheduler


class AdmissionError(ValueError):
    """A request that can never run (too long, bad parameters): the client gets a 400."""


class UnavailableError(AdmissionError):
    """The server cannot take requests now (HTTP 503): memory released, queue full."""


class QueueFullError(UnavailableError):
    """The waiting queue is at ``scheduler.max_queued_requests`` (HTTP 503 with Retry-After)."""


def check_admission(sched: Scheduler, req: Req) -> None:
    """Raise :class:`AdmissionError` (or :class:`UnavailableError`) if ``sched`` cannot take ``req``."""
    if req.rid in sched.requests:
        raise AdmissionError(f"request id {req.rid!r} is already in use")
    if not req.input_ids:
        raise AdmissionError("the prompt is empty")
    sp = req.sampling_params
    vocab_size = sched.runner.vocab_size
    try:
        sp.validate(vocab_size)
        check_custom_logit_processor(sp.custom_logit_processor, sp.custom_params,
                                     sched.settings.server.enable_custom_logit_processor, sched.plugins.registry)
    except ValueError as exc:
        raise AdmissionError(str(exc)) from None
    if req.mm_inputs is not None:
        if req.mm_inputs.items and not getattr(sched.runner.model, "accepts_mm_inputs", False):
            raise AdmissionError(f"model {sched.runner.architecture} does not take images")
        problem = req.mm_inputs.check_ids(req.input_ids, vocab_size)
        if problem:
            raise AdmissionError(problem)
    elif any(not 0 <= t < vocab_size for t in req.input_ids):
        raise AdmissionError(f"input_ids must be in [0, {vocab_size})")
    _check_length(len(req.input_ids), sp.max_new_tokens, sched.context_len)
    if "released" in sched.holds:
        raise UnavailableError("the server's memory is released (release_memory_occupation); "
                               "resume_memory_occupation first")
    limit = sched.cfg.max_queued_requests
    if limit is not None and len(sched.waiting) >= limit:
        raise QueueFullError(f"the waiting queue is full ({limit} requests)")
    if req.priority not in (None, 0) and not getattr(sched.policy, "uses_priority", False):
        raise AdmissionError(f"priority {req.priority} needs a schedule policy that orders by priority "
                             f"(scheduler.policy={sched.cfg.policy!r} does not)")
    if sp.max_new_tokens == 0 and sched.pd is not None:
        raise AdmissionError("max_new_tokens must be >= 1 with prefill/decode disaggregation")


def _check_length(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    if prompt_len >= context_len:
        raise AdmissionError(f"the prompt has {prompt_len} tokens; this server's context length is {context_len}")
    total = prompt_len + max_new_tokens
    if total > context_len:
        # Like SGLang and vLLM: refuse instead of silently truncating the output.
        raise AdmissionError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                             f"exceeds the context length {context_len}")
