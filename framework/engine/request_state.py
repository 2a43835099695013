"""Client-side state of one request: detokenized text, stop-string trimming, meta info.

Used by the in-process Engine and by the HTTP server's tokenizer manager alike: both receive
``RequestOutput`` deltas from a scheduler and turn them into text and SGLang-style ``meta_info``.
"""

from __future__ import annotations

import time
from typing import Any

from framework.multimodal.inputs import is_pad_id
from framework.sampling.detokenizer import IncrementalDetokenizer, StopStringMatcher
from framework.sampling.params import SamplingParams
from framework.scheduler.outputs import RequestOutput

#: Keys of generation_config.json that serve as sampling defaults (as vLLM does by default).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def make_sampling_params(
    user: dict[str, Any] | SamplingParams | None, generation_defaults: dict[str, Any]
) -> SamplingParams:
    """User parameters over the model's generation_config defaults over SamplingParams' own."""
    if isinstance(user, SamplingParams):
        return user
    merged = {k: generation_defaults[k] for k in GENERATION_DEFAULT_KEYS if generation_defaults.get(k) is not None}
    merged.update({k: v for k, v in (user or {}).items() if v is not None})
    return SamplingParams.from_dict(merged)


class RequestState:
    """Accumulates the deltas of one request into its text, ids, logprobs and meta info."""

    def __init__(
        self,
        rid: str,
        tokenizer: Any,
        prompt_ids: list[int],
        params: SamplingParams,
        return_logprob: bool = False,
        token_ids_logprob: list[int] | None = None,
    ) -> None:
        self.rid = rid
        self.params = params
        self.return_logprob = return_logprob
        self.token_ids_logprob = token_ids_logprob
        # No tokenizer (model.skip_tokenizer_init): ids in, ids out, and the text stays empty.
        # Image pad ids (>= 2**30) are no tokenizer entries: left out of the decoding context.
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, [t for t in prompt_ids if not is_pad_id(t)], params.skip_special_tokens,
            params.spaces_between_special_tokens
        )
        self.stops = StopStringMatcher(list(params.stop)) if params.stop else None
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.text = ""
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.output_token_ids_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[Any] | None = None
        self.input_token_ids_logprobs: list[Any] | None = None
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False
        self.finish_reason: dict[str, Any] | None = None
        self.error: str | None = None
        self._stopped_by_string = False

    def apply(self, out: RequestOutput) -> str:
        """Take one delta; return the text it adds (never a split stop string)."""
        if out.new_token_ids:
            self.last_token_at = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
        self.output_ids.extend(out.new_token_ids)
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.new_logprobs:
            self.output_logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            self.output_top_logprobs.extend(out.new_top_logprobs)
        if out.new_token_ids_logprobs:
            self.output_token_ids_logprobs.extend(out.new_token_ids_logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs
            self.input_token_ids_logprobs = out.input_token_ids_logprobs
        detok = self.detok if not self._stopped_by_string else None
        delta = detok.add(out.new_token_ids) if detok is not None else ""
        if out.finished and detok is not None:
            delta += detok.flush()
        if self.stops is not None and not self._stopped_by_string:
            delta = self.stops.feed(delta)
            if self.stops.stopped:
                self._stopped_by_string = True
            elif out.finished:
                delta += self.stops.flush()
        self.text += delta
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.error = out.error
        return delta

    def abort(self, message: str) -> None:
        """Finish now with reason abort and ``message`` as the error (the server ends a request
        this way when its scheduler will not: shutdown past the grace period)."""
        if self.finished:
            return
        self.finished = True
        self.finish_reason = {"type": "abort", "message": message}
        self.error = message

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info for this request so far."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": time.monotonic() - self.created,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid] for lp, tid in zip(self.output_logprobs, self.output_ids, strict=False)
            ]
            if self.output_top_logprobs:
                meta["output_top_logprobs"] = [[[lp, t] for t, lp in row] for row in self.output_top_logprobs]
            if self.token_ids_logprob:
                # SGLang's shape: per output position, [logprob, token_id] of each requested id.
                meta["output_token_ids_logprobs"] = [[[lp, t] for t, lp in row]
                                                     for row in self.output_token_ids_logprobs]
            if self.input_logprobs is not None:
                # SGLang's shape: [logprob, token_id] per prompt token from logprob_start_len on
                # (the first prompt token has no logprob: None).
                ids = self.prompt_ids[len(self.prompt_ids) - len(self.input_logprobs):]
                meta["input_token_logprobs"] = [[lp, t] for lp, t in zip(self.input_logprobs, ids, strict=True)]
            if self.input_top_logprobs:
                meta["input_top_logprobs"] = [
                    None if row is None else [[lp, t] for t, lp in row] for row in self.input_top_logprobs
                ]
            if self.input_token_ids_logprobs:
                meta["input_token_ids_logprobs"] = [
                    None if row is None else [[lp, t] for t, lp in row] for row in self.input_token_ids_logprobs
                ]
        return meta

    def result(self) -> dict[str, Any]:
        """The SGLang /generate response body of a finished request."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info()}
