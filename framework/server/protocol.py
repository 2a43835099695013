"""Request bodies of the HTTP API as pydantic models (they also generate /openapi.json).

The OpenAI models forbid unknown fields and are strict about types, as OpenAI is: a typo such as
``max_token`` is a 400 naming the field, not a silently ignored setting. Fields OpenAI accepts but
plugserve does not implement (``suffix``, ``best_of`` != n, ...) are declared, so that setting them gets a
clear "not supported" instead of "unrecognized". SGLang's extras (``top_k``, ``min_p``, ``rid``,
...) are accepted on both OpenAI routes, as SGLang and vLLM accept them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from framework.sampling.params import INT64_MAX, INT64_MIN

Stop = str | list[str] | None
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""Integers that cross to the scheduler: each field's own range is checked where it is used
(``SamplingParams.validate``, the server's limits); this bound keeps every one encodable."""
Port = Annotated[int, Field(ge=1, le=65535)]
Room = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A PD bootstrap room: SGLang's routers draw it from [0, 2**63); transfer headers hold it as int64."""
LogprobStart = Annotated[int, Field(ge=-1, le=INT64_MAX)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    """Send a last chunk with the usage of the whole request (its ``choices`` is empty)."""
    continuous_usage_stats: bool | None = None
    """vLLM's extension: usage in every chunk."""
    include_obfuscation: bool | None = None
    """Accepted for compatibility; plugserve never pads chunks."""


class SGLangRequestFlags(StrictModel):
    """Fields that SGLang's own request structs always serialize, so clients built on them send
    them on every request (sglang-router in ``--pd-disaggregation`` mode does, with their
    defaults). Flags for features plugserve lacks accept their default value only, so asking for
    the feature is still a 400 that names the field."""

    return_hidden_states: Literal[False] = False
    no_stop_trim: Literal[False] = False
    """SGLang: keep the matched stop string in the output (plugserve always trims it)."""


class SGLangExtras(SGLangRequestFlags):
    """Sampling fields beyond OpenAI's that SGLang's OpenAI routes accept."""

    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    rid: str | None = Field(default=None, description="Request id (for /abort_request); default: random")
    bootstrap_host: str | None = None
    bootstrap_port: Port | None = None
    bootstrap_room: Room | None = Field(default=None, description="PD disaggregation (set by the router)")
    json_schema: str | dict[str, Any] | None = Field(default=None, description="Constrain the output to JSON valid "
                                                     "against this schema (SGLang; JSON text or an object)")
    regex: str | None = Field(default=None, description="Constrain the output to fully match this regex (SGLang)")
    ebnf: str | None = Field(default=None, description="Constrain the output to this EBNF grammar (SGLang)")
    structural_tag: str | dict[str, Any] | None = Field(default=None, description="SGLang's structural tag")
    priority: Int64 | None = Field(default=None, description="Scheduling priority; needs a policy that reads it "
                                   "(scheduler.policy=priority), else only null or 0 are accepted")
    data_parallel_rank: Int64 | None = Field(default=None, description="Run on this data-parallel replica "
                                             "(SGLang; sglang-router --dp-aware); default: the load balancer picks")
    custom_logit_processor: str | None = Field(default=None, description="The name of a registered logit "
                                               "processor (needs server.enable_custom_logit_processor; never code)")
    custom_params: dict[str, Any] | None = Field(default=None, description="That processor's parameters (SGLang)")

    def sglang_sampling(self) -> dict[str, Any]:
        return {
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids, "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf,
            "structural_tag": self.structural_tag,
            "custom_logit_processor": self.custom_logit_processor, "custom_params": self.custom_params,
        }


class OpenAISampling(SGLangExtras):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def sampling(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature, "top_p": self.top_p, "n": self.n, "stop": self.stop,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "seed": self.seed, "logit_bias": self.logit_bias, **self.sglang_sampling(),
        }


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    best_of: Int64 | None = None
    response_format: dict[str, Any] | None = None
    """SGLang accepts OpenAI's structured-output field on completions too."""
    suffix: str | None = None
    image_data: Any = None
    """Declared so that images sent here get a 400 that says where to send them instead."""


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message; fields beyond these pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    continue_final_message: Literal[False] = False
    separate_reasoning: bool | None = None
    """With a reasoning parser (server.reasoning_parser): false keeps the reasoning in content."""
    stream_reasoning: bool | None = None
    """false: the reasoning goes out in one stream delta once it is complete."""


class GenerateRequest(StrictModel):
    """``POST /generate`` (SGLang's native API): one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[Int64] | list[list[Int64]] | None = None
    image_data: str | list[str] | list[str | list[str] | None] | None = Field(
        default=None,
        description="Images of a multimodal model: each a data: URL, base64, an http(s) URL "
        "(server.allow_remote_images) or a local path (server.allow_image_paths); one or a list for one "
        "prompt, one entry (null, an image or a list) per prompt for a batch. The prompt holds the model's "
        "image placeholder once per image",
    )
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        default=None,
        description="SamplingParams fields: max_new_tokens, min_new_tokens, temperature, top_p, top_k, "
        "min_p, repetition_penalty, frequency_penalty, presence_penalty, stop, stop_token_ids, ignore_eos, "
        "skip_special_tokens, spaces_between_special_tokens, n, seed, logit_bias, json_schema, regex, ebnf, "
        "structural_tag, custom_params (one dict, or one per prompt)",
    )
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: Int64 | list[Int64] = 0
    logprob_start_len: LogprobStart | list[LogprobStart] = -1
    return_text_in_logprobs: bool = False
    """Logprob entries become [logprob, token_id, token_text]."""
    token_ids_logprob: list[Int64] | list[list[Int64]] | None = None
    """Logprobs of these token ids at every output position (one list, or one per prompt)."""
    custom_logit_processor: str | list[str | None] | None = None
    """The name of a registered logit processor (one, or one per prompt), with its parameters in
    ``sampling_params.custom_params``; needs ``server.enable_custom_logit_processor``. SGLang's
    dill-serialized code is refused (see docs/api.md)."""
    priority: Int64 | None = None
    data_parallel_rank: Int64 | None = None
    """Run on this data-parallel replica (sglang-router ``--dp-aware`` sets it); default: the balancer picks."""
    rid: str | list[str] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: Port | None = None
    bootstrap_room: Room | None = Field(default=None, description="PD disaggregation (set by the router)")
    # SGLang's GenerateReqInput fields that sglang-router always sends (see SGLangRequestFlags)
    model: str | None = None
    """Ignored: a plugserve server serves one model."""
    log_metrics: bool = True
    no_logs: bool = False
    background: Literal[False] = False
    return_hidden_states: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False


class TokenizeRequest(StrictModel):
    """``POST /v1/tokenize`` and ``/tokenize`` (vLLM's and SGLang's shapes): a prompt (or a list of
    prompts, SGLang) or chat ``messages`` (vLLM, rendered with the chat template)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for ``prompt``, false for ``messages`` (the template holds its special tokens)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """``POST /v1/detokenize`` and ``/detokenize``: token ids (or a list of id lists) to text."""

    model: str | None = None
    tokens: list[Int64] | list[list[Int64]]
    skip_special_tokens: bool = False
    """false: every token is decoded, special ones included (as vLLM does)."""


class AbortRequest(StrictModel):
    """``POST /abort_request``."""

    rid: str | None = None
    abort_all: bool = False


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/abort_request": AbortRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
}
"""The POST routes and their bodies (for /openapi.json)."""
