"""What the scheduler reports back per request: token deltas, logprobs, finish state.

These are msgspec structs: the server sends them from the scheduler process to the HTTP process
as msgpack, which is compact and safe to decode (no pickle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from framework.scheduler.request import Req


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since its last report (a delta), and its state."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished: bool = False
    finish_reason: dict | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[float | None] | None = None
    """Prompt logprobs (sent once, with the first output); None for the first prompt token."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[int, float]] | None] | None = None
    new_token_ids_logprobs: list[list[tuple[int, float]]] | None = None
    """Per new token, (token id, logprob) of each of the request's ``token_ids_logprob``."""
    error: str | None = None
    """Set when the request failed (finish_reason type ``abort``): the message for the client."""


def delta_of(r: Req) -> RequestOutput:
    """The request's new tokens (and logprobs) since its last report; marks them reported. Prompt
    logprobs go out once, with the first delta after they are complete."""
    start = r.sent_len
    out = RequestOutput(
        rid=r.rid,
        new_token_ids=r.output_ids[start:],
        prompt_tokens=len(r.input_ids),
        completion_tokens=len(r.output_ids),
        cached_tokens=r.cached_tokens,
        finished=r.finished,
        finish_reason=r.finished_reason.to_dict() if r.finished_reason else None,
    )
    if r.return_logprob:
        out.new_logprobs = r.output_logprobs[start:]
        if r.top_logprobs_num:
            out.new_top_logprobs = r.output_top_logprobs[start:]
        if r.token_ids_logprob:
            out.new_token_ids_logprobs = r.output_token_ids_logprobs[start:]
        if r.sent_input_logprobs == 0 and r.input_logprobs:
            out.input_logprobs = list(r.input_logprobs)
            out.input_top_logprobs = list(r.input_top_logprobs) if r.top_logprobs_num else None
            out.input_token_ids_logprobs = list(r.input_token_ids_logprobs) if r.token_ids_logprob else None
            r.sent_input_logprobs = len(r.input_logprobs)
    r.sent_len = len(r.output_ids)
    return out
