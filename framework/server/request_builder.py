"""From validated HTTP fields to scheduler requests: tokenize, merge sampling defaults, check.

Everything the HTTP process can check without the scheduler is checked here, so most bad
requests get their 400 without a round trip: sampling parameters (``SamplingParams.validate``),
``n`` and top-logprob limits, and the context length the scheduler reported when it became
ready. The scheduler checks again at admission (its AdmissionError also becomes a 400).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from framework.config.schema import ServerConfig
from framework.engine.request_state import make_sampling_params
from framework.plugins import get_registry
from framework.sampling.logit_processor import check_custom_logit_processor
from framework.sampling.params import SamplingParams, choice_seed
from framework.server.errors import APIError, bad_request
from framework.server.structured import check_grammar
from framework.server.tokenizer_manager import SubRequest

OFFLOAD_TOKENIZE_CHARS = 20_000
"""Texts longer than this are tokenized in a worker thread, so one huge prompt does not stall
every other stream on the event loop."""


def new_rid() -> str:
    return uuid.uuid4().hex


class RequestBuilder:
    """Turns prompts and user sampling fields into :class:`SubRequest` lists."""

    def __init__(self, tokenizer: Any, generation_defaults: dict[str, Any], model_info: dict[str, Any],
                 server: ServerConfig) -> None:
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults
        self.context_len = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.server = server
        self.priority_scheduling = bool(model_info.get("priority_scheduling"))
        """The scheduler's policy orders by ``priority`` (it says so in its Ready info)."""
        self.grammar: Any = None
        """The grammar backend that validates constraints before they are queued (the launcher sets it)."""

    async def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a raw prompt, exactly as the in-process Engine encodes it."""
        if self.tokenizer is None:
            raise bad_request("a text prompt needs a tokenizer, and this server runs without one "
                              "(model.skip_tokenizer_init=true): send token ids", param, "no_tokenizer")
        if len(text) > OFFLOAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    async def tokenize_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat template (it already holds any BOS it wants)."""
        if len(text) > OFFLOAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {self.vocab_size})", param, "invalid_value")

    def sampling_params(self, user: dict[str, Any], default_max_tokens: int | None = None,
                        prompt_len: int = 0, names: dict[str, str] | None = None) -> SamplingParams:
        """User fields over the model's generation_config defaults, validated (400 on error).

        ``default_max_tokens`` of None means "the rest of the context" (OpenAI chat's default).
        ``names`` maps SamplingParams field names to what the client called them (``max_tokens``)
        so that error messages name the client's own field.
        """
        fields = dict(user)
        if fields.get("max_new_tokens") is None:
            fields["max_new_tokens"] = (
                default_max_tokens if default_max_tokens is not None else max(self.context_len - prompt_len, 1)
            )
        try:
            params = make_sampling_params(fields, self.generation_defaults)
            params.validate(self.vocab_size)
            check_custom_logit_processor(params.custom_logit_processor, params.custom_params,
                                         self.server.enable_custom_logit_processor, get_registry())
        except (ValueError, TypeError) as exc:
            message = str(exc)
            for ours, theirs in (names or {}).items():
                message = message.replace(ours, theirs)
            param = message.split(" ", 1)[0] if message else None
            raise bad_request(message, param, "invalid_value") from None
        if params.stop and self.tokenizer is None:
            raise bad_request("stop strings need a tokenizer, and this server runs without one "
                              "(model.skip_tokenizer_init=true): use stop_token_ids", "stop", "no_tokenizer")
        check_grammar(self.grammar, params, names)  # a malformed schema or regex: 400 naming the field
        if params.n > self.server.max_n:
            raise bad_request(f"n must be <= {self.server.max_n} on this server, got {params.n}", "n", "invalid_value")
        return params

    def check_sequence_count(self, num_prompts: int, total: int) -> None:
        """400 when prompts x ``n`` exceeds ``server.max_sequences_per_request`` (each sequence is
        a scheduler request; checked before any prompt is tokenized where the count is known)."""
        limit = self.server.max_sequences_per_request
        if total > limit:
            raise bad_request(
                f"this request asks for {total} sequences ({num_prompts} prompt(s) x n); this server allows at "
                f"most {limit} per request (server.max_sequences_per_request): split it into several requests",
                "n" if num_prompts == 1 else "prompt", "too_many_sequences",
            )

    def check_top_logprobs(self, value: int, param: str) -> None:
        limit = self.server.max_top_logprobs
        if not 0 <= value <= limit:
            raise bad_request(f"{param} must be in [0, {limit}] on this server, got {value}", param, "invalid_value")

    def check_priority(self, priority: int | None) -> None:
        """400 for a non-zero ``priority`` unless the schedule policy reads it (as vLLM refuses it
        without priority scheduling): a priority that silently does nothing would mislead."""
        if priority not in (None, 0) and not self.priority_scheduling:
            raise bad_request(f"priority {priority} needs a schedule policy that orders by priority "
                              "(e.g. scheduler.policy=priority); this server's does not", "priority", "invalid_value")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """``token_ids_logprob``: ids in the vocabulary, at most ``server.max_top_logprobs`` of them
        (each costs a logprob per output token, like a top logprob)."""
        limit = self.server.max_top_logprobs
        if len(ids) > limit:
            raise bad_request(f"{param} has {len(ids)} ids; this server allows at most {limit} "
                              "(server.max_top_logprobs)", param, "invalid_value")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {self.vocab_size})", param, "invalid_value")

    def check_length(self, ids: list[int], params: SamplingParams, param: str, max_param: str) -> None:
        """The scheduler's admission rule, answered here: prompt + output within the context."""
        if params.max_new_tokens > self.context_len:
            raise bad_request(
                f"{max_param} is {params.max_new_tokens}, but this model's context length is {self.context_len}",
                max_param, "invalid_value",
            )
        if len(ids) >= self.context_len:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this model's context length is {self.context_len}",
                param, "context_length_exceeded",
            )
        if len(ids) + params.max_new_tokens > self.context_len:
            raise bad_request(
                f"the prompt ({len(ids)} tokens) + {max_param} ({params.max_new_tokens}) exceeds this model's "
                f"context length of {self.context_len}; lower {max_param}",
                max_param, "context_length_exceeded",
            )

    def expand(self, rids: list[str], ids: list[int], params: SamplingParams, *, return_logprob: bool = False,
               top_logprobs_num: int = 0, logprob_start_len: int = -1, priority: int | None = None,
               token_ids_logprob: list[int] | None = None, mm_inputs: dict[str, Any] | None = None) -> list[SubRequest]:
        """The ``n`` scheduler requests of one prompt; seeded ones use seed, seed + 1, ... as the
        Engine does, so choice i of a seeded request is reproducible on its own."""
        subs = []
        wants_logprobs = return_logprob or top_logprobs_num > 0 or logprob_start_len >= 0 or bool(token_ids_logprob)
        for i, rid in enumerate(rids):
            sub = SamplingParams.from_dict({**params.to_dict(), "n": 1})
            if params.seed is not None:
                sub.seed = choice_seed(params.seed, i)
            subs.append(SubRequest(
                rid=rid, input_ids=ids, params=sub,
                return_logprob=wants_logprobs,
                top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, priority=priority,
                token_ids_logprob=token_ids_logprob or None, mm_inputs=mm_inputs,
            ))
        return subs


def attach_bootstrap(subs: list[SubRequest], body: Any) -> None:
    """PD disaggregation: copy the router's bootstrap fields onto the (single) request."""
    if body.bootstrap_room is None:
        return
    require(len(subs) == 1, "a request with bootstrap_room must have one prompt and n = 1", "bootstrap_room")
    subs[0].bootstrap_host = body.bootstrap_host
    subs[0].bootstrap_port = body.bootstrap_port
    subs[0].bootstrap_room = body.bootstrap_room


def sub_rids(group_rid: str, count: int) -> list[str]:
    """Scheduler request ids of a group: the group's own id when it has one request."""
    return [group_rid] if count == 1 else [f"{group_rid}-{i}" for i in range(count)]


def require(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise APIError(400, message, param=param, code="invalid_value")
