"""OpenAI response pieces: finish reasons, usage, and the two logprobs formats.

Completions use the legacy format (``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``); chat uses ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
"""

from __future__ import annotations

import functools
from typing import Any

from framework.engine.request_state import RequestState
from framework.server.http_utils import finite


class TokenText:
    """The text of single token ids, as logprobs report them (cached: a vocabulary is small)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = functools.lru_cache(maxsize=65536)(
            lambda tid: tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def __call__(self, token_id: int) -> str:
        return self._decode(int(token_id))


def finish_reason(state: RequestState) -> str | None:
    if not state.finished:
        return None
    return (state.finish_reason or {}).get("type", "abort")


def matched_stop(state: RequestState) -> int | str | None:
    return (state.finish_reason or {}).get("matched") if state.finished else None


def usage(states: list[RequestState], n: int) -> dict[str, Any]:
    """Usage of a group of prompts x ``n`` choices (states ordered by prompt): each prompt is
    counted once however many choices it has, as OpenAI counts it."""
    firsts = states[::n]
    prompt_tokens = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }


def completion_logprobs(state: RequestState, text: TokenText, start: int, end: int,
                        text_offset: int) -> dict[str, Any]:
    """Legacy logprobs of output tokens ``start:end``; offsets count from ``text_offset``."""
    ids = state.output_ids[start:end]
    tokens = [text(t) for t in ids]
    offsets, pos = [], text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    tops = None
    if state.output_top_logprobs:
        tops = [{text(t): finite(lp) for t, lp in row} for row in state.output_top_logprobs[start:end]]
    return {
        "tokens": tokens,
        "token_logprobs": [finite(lp) for lp in state.output_logprobs[start:end]],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(state: RequestState, text: TokenText, start: int, end: int) -> dict[str, Any]:
    """Chat logprobs of output tokens ``start:end``."""
    content = []
    tops = state.output_top_logprobs
    for i in range(start, min(end, len(state.output_logprobs))):
        tok = text(state.output_ids[i])
        row = tops[i] if i < len(tops) else []
        content.append({
            "token": tok,
            "logprob": finite(state.output_logprobs[i]),
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": text(t), "logprob": finite(lp), "bytes": list(text(t).encode("utf-8"))} for t, lp in row
            ],
        })
    return {"content": content}
