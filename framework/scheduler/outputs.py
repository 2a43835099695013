"""What the scheduler reports back per request: token deltas, logprobs, finish state.

These are msgspec structs: the server sends them from the scheduler process to the HTTP process
as msgpack, which is compact and safe to decode (no pickle).
"""

from __future__ import annotations

import msgspec


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
    error: str | None = None
    """Set when the request failed (finish_reason type ``abort``): the message for the client."""
