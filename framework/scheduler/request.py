"""A request inside the scheduler: its tokens, sampling parameters, KV state and outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.multimodal.inputs import MultimodalInputs, is_pad_id
from framework.sampling.params import SamplingParams


@dataclass
class FinishReason:
    """Why a request stopped: ``stop`` (EOS, stop token or stop string), ``length`` or ``abort``."""

    type: str
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler tracks it.

    Compared by identity (``eq=False``): two requests are never the same because their fields are.
    The scheduler's ``in`` checks over its lists ran the generated field-by-field ``__eq__`` ~2,000
    times a 64-stream mixed step, ~2 us each.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    """Prompt logprobs are returned from this prompt position on (-1: none)."""
    arrival_time: float = field(default_factory=time.monotonic)
    group: str | None = None
    """The HTTP request (batch or ``n`` choices) this one came in with; fair admission takes
    waiting requests round-robin across groups. None: a group of its own."""
    priority: int | None = None
    """Scheduling priority for policies that read it (None: the policy's default)."""
    token_ids_logprob: list[int] | None = None
    """Report the logprobs of these token ids at every output position (SGLang's field)."""
    mm_inputs: MultimodalInputs | None = None
    """Images of a multimodal prompt: their spans in ``input_ids`` hold pad ids (``>= 2**30``,
    never a vocabulary index), their pixels and M-RoPE positions ride along to the model. Kept
    through retraction: a re-prefill encodes the images again."""

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    grammar: Any = None
    """Constrained decoding: the request's :class:`~framework.grammar.base.GrammarMatcher`."""
    grammar_future: Any = None
    """While its grammar compiles: the compile's future (the request is in the grammar queue)."""

    # KV state. ``kv_len`` positions of ``req_to_token[req_pool_idx]`` hold valid slots; the first
    # ``prefix_len`` of them belong to the prefix cache (locked through ``last_node``).
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (reported to the client)."""
    extend_len: int = 0
    """Tokens this request computes in the batch being built (prefill chunk size)."""
    retractions: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    """PD disaggregation: the prefill server's bootstrap service and this request's room."""

    # Outputs (logprobs are of the raw model distribution).
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    """Per prompt position from ``logprob_start_len`` on, (id, logprob) of each ``token_ids_logprob``."""
    first_token_time: float | None = None
    sent_len: int = 0
    """Output tokens already reported to the caller."""
    sent_input_logprobs: int = 0

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before it can sample its next token."""
        return self.input_ids + self.output_ids

    @property
    def text_input_ids(self) -> list[int]:
        """``input_ids`` without image pad ids: what may index a vocabulary-sized tensor
        (repetition penalty, detokenizer context). The list itself for a text-only prompt."""
        if self.mm_inputs is None:
            return self.input_ids
        return [t for t in self.input_ids if not is_pad_id(t)]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_prefilling(self) -> bool:
        """True until every token of ``fill_ids`` has KV (a chunked prefill is mid-way)."""
        return self.kv_len < self.seq_len

    def kv_indices(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """The request's KV slots by position (int64)."""
        assert self.req_pool_idx is not None
        return req_to_token[self.req_pool_idx, : self.kv_len].to(torch.int64)

    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    def max_cacheable_prefix(self) -> int:
        """Longest prefix that may come from the cache: at least one token must be computed to
        get logits, and prompt logprobs need hidden states from ``logprob_start_len`` on."""
        limit = len(self.fill_ids) - 1
        if self.wants_prompt_logprobs() and not self.prompt_logprobs_done():
            # The logprob of prompt token i comes from the logits at position i - 1.
            limit = min(limit, max(self.logprob_start_len, 1) - 1)
        return max(limit, 0)

    def prompt_logprobs_done(self) -> bool:
        return len(self.input_logprobs) >= len(self.input_ids) - max(self.logprob_start_len, 0)
