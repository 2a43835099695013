"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from framework.server.chat_output import ChatOutputPlan, ChoiceStream, final_message, prepare_chat, stream_finish_reason
from framework.server.chat_template import render_chat
from framework.server.chat_tools import template_messages
from framework.server.group_response import released_on_error, request_errors, stream_events, wait_all
from framework.server.http_utils import parse_model, require_bearer, sse
from framework.server.image_inputs import chat_content
from framework.server.images import ImageSource
from framework.server.openai_format import chat_logprobs, completion_logprobs, finish_reason, matched_stop, usage
from framework.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAISampling
from framework.server.request_builder import attach_bootstrap, new_rid, require, sub_rids
from framework.server.state import ServerState
from framework.server.structured import response_format_fields, response_format_names
from framework.server.tokenizer_manager import Event, RequestGroup

_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


async def list_models(request: Request) -> Response:
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    return JSONResponse({"object": "list", "data": [server.model_card()]})


def _check_common(server: ServerState, body: OpenAISampling) -> None:
    server.check_model(body.model)
    server.builder.check_priority(body.priority)
    require(body.stream_options is None or bool(body.stream),
            "stream_options is only allowed when stream is true", "stream_options")


def _usage_flags(body: OpenAISampling) -> tuple[bool, bool]:
    opts = body.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


async def _completion_prompts(server: ServerState, prompt: Any, n: int) -> list[tuple[str | None, list[int]]]:
    """(text, ids) of each prompt: a string, a list of strings, token ids (text None), or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    require(len(prompt) > 0, "prompt must not be empty", "prompt")
    server.builder.check_sequence_count(len(prompt), len(prompt) * n)  # before tokenizing any
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, await server.builder.tokenize(p)))
        else:
            server.builder.check_ids(p, "prompt")
            out.append((None, list(p)))
    return out


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    body = await parse_model(request, CompletionRequest, server.body_limits)
    _check_common(server, body)
    require(body.suffix is None, "suffix is not supported by this server", "suffix")
    require(body.image_data is None, "/v1/completions takes no images: send them as image_url parts to "
            "/v1/chat/completions, or as image_data to /generate", "image_data")
    require(body.best_of in (None, body.n), "best_of must equal n on this server", "best_of")
    lp_num = body.logprobs
    if lp_num is not None:
        server.builder.check_top_logprobs(lp_num, "logprobs")
        server.require_tokenizer("logprobs", "logprobs (they report token texts)")
    if body.echo:
        server.require_tokenizer("echo", "echo")
    require(not (body.echo and lp_num is not None), "echo together with logprobs is not supported", "echo")
    # OpenAI and vLLM: at least one token, except that echo with max_tokens 0 returns the prompt alone.
    require(body.max_tokens != 0 or bool(body.echo),
            "max_tokens must be >= 1 (0 is allowed only with echo, to get the prompt back)", "max_tokens")
    n, group_rid = body.n, body.rid or new_rid()
    prompts = await _completion_prompts(server, body.prompt, n)
    rids = sub_rids(group_rid, len(prompts) * max(n, 1))
    subs = []
    for i, (_, ids) in enumerate(prompts):
        server.builder.check_ids(ids, "prompt")
        fmt = response_format_fields(body.response_format, body.sampling())
        params = server.builder.sampling_params({"max_new_tokens": body.max_tokens, **body.sampling(), **fmt},
                                                default_max_tokens=16,
                                                names={**_NAMES, **response_format_names(body.response_format)})
        server.builder.check_length(ids, params, "prompt", "max_tokens")
        subs += server.builder.expand(rids[i * n:(i + 1) * n], ids, params, return_logprob=lp_num is not None,
                                      top_logprobs_num=lp_num or 0, priority=body.priority)
    attach_bootstrap(subs, body)
    echo = None
    if body.echo:
        texts = [text if text is not None else server.tokenizer.decode(ids) for text, ids in prompts]
        echo = [t for t in texts for _ in range(n)]
    head = {"id": f"cmpl-{group_rid}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name}
    group = await server.manager.submit(group_rid, subs, body.data_parallel_rank)
    if body.stream:
        return await released_on_error(server.manager, group, _stream_completion(
            request, server, group, head, n, lp_num is not None, echo, body))
    await wait_all(request, server.manager, group)
    request_errors(group)
    choices = []
    for i, st in enumerate(group.states):
        lp = completion_logprobs(st, server.token_text, 0, len(st.output_ids), 0) if lp_num is not None else None
        choices.append({"index": i, "text": (echo[i] if echo else "") + st.text, "logprobs": lp,
                        "finish_reason": finish_reason(st), "matched_stop": matched_stop(st)})
    return JSONResponse({**head, "choices": choices, "usage": usage(group.states, n)})


async def _stream_completion(request: Request, server: ServerState, group: RequestGroup, head: dict[str, Any],
                             n: int, logprobs: bool, echo: list[str] | None, body: CompletionRequest) -> Response:
    include_usage, continuous = _usage_flags(body)
    sent = [0] * len(group.states)
    chars = [0] * len(group.states)

    def render(ev: Event) -> list[str]:
        st = group.states[ev.index]
        text = ev.delta
        if echo is not None and chars[ev.index] == 0 and echo[ev.index]:
            text = echo[ev.index] + text
        lp = None
        if logprobs:
            end = len(st.output_logprobs)
            lp = completion_logprobs(st, server.token_text, sent[ev.index], end, chars[ev.index])
            sent[ev.index] = end
        chars[ev.index] += len(text)
        if not text and not (lp and lp["tokens"]) and not ev.finished:
            return []
        # Events can queue up behind a slow client: the state may already be finished while
        # this event is not the last one, so the finish reason goes with the finishing event only.
        choice = {"index": ev.index, "text": text, "logprobs": lp,
                  "finish_reason": finish_reason(st) if ev.finished else None,
                  "matched_stop": matched_stop(st) if ev.finished else None}
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if continuous:
            chunk["usage"] = usage(group.states, n)
        return [sse(chunk)]

    def tail() -> list[str]:
        return [sse({**head, "choices": [], "usage": usage(group.states, n)})] if include_usage else []

    return stream_events(server.manager, group, render, tail)


def message_dict(index: int, msg: ChatMessage, images: list[ImageSource] | None = None,
                 refuse_images: str = "this route takes text only") -> dict[str, Any]:
    """A message as the chat template sees it: text parts joined, image parts (appended to
    ``images``; None: refused with ``refuse_images``) as ``{"type": "image"}`` parts."""
    out = msg.model_dump(exclude_none=True)
    content = msg.content
    if isinstance(content, list):
        out["content"], found = chat_content(index, content, refuse_images if images is None else None)
        if images is not None:
            images += found
    elif content is None:
        out["content"] = ""
    return out


async def _chat_prompt(server: ServerState, body: ChatCompletionRequest,
                       tools: Any) -> tuple[list[int], dict[str, Any] | None]:
    """The rendered prompt's ids (padded image spans with images) and what the scheduler gets."""
    frontend = server.images if server.images is not None and server.images.enabled else None
    images: list[ImageSource] | None = [] if frontend is not None else None
    refusal = f"this model ({server.images.architecture if server.images else 'text-only'}) does not take images"
    messages = template_messages([message_dict(i, m, images, refusal) for i, m in enumerate(body.messages)])
    ids = await server.builder.tokenize_rendered(render_chat(server.tokenizer, messages, tools=tools))
    if frontend is None or not images:
        server.builder.check_ids(ids, "messages")
        return ids, None
    # Tokenized exactly as a text-only chat, then each placeholder expanded to its image's span.
    ids, mm = await frontend.process(ids, images, "messages")
    return ids, frontend.wire(mm)


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    body = await parse_model(request, ChatCompletionRequest, server.body_limits)
    _check_common(server, body)
    server.require_tokenizer("messages", "a chat request (the chat template renders text)")
    plan, constraint, constraint_names = prepare_chat(body, server.tool_parser, server.reasoning_parser)
    top = body.top_logprobs
    if top is not None:
        require(bool(body.logprobs), "top_logprobs requires logprobs to be true", "top_logprobs")
        server.builder.check_top_logprobs(top, "top_logprobs")
    ids, mm = await _chat_prompt(server, body, plan.tools.tools)
    use_completion = body.max_completion_tokens is not None
    max_name = "max_completion_tokens" if use_completion else "max_tokens"
    max_tokens = body.max_completion_tokens if use_completion else body.max_tokens
    require(max_tokens != 0, f"{max_name} must be >= 1", max_name)  # as OpenAI: a reply has a token
    params = server.builder.sampling_params({"max_new_tokens": max_tokens, **body.sampling(), **constraint}, None,
                                            len(ids), names={**_NAMES, "max_new_tokens": max_name, **constraint_names})
    server.builder.check_length(ids, params, "messages", max_name)
    n, group_rid = body.n, body.rid or new_rid()
    server.builder.check_sequence_count(1, n)
    subs = server.builder.expand(sub_rids(group_rid, n), ids, params, return_logprob=bool(body.logprobs),
                                 top_logprobs_num=top or 0, priority=body.priority, mm_inputs=mm)
    attach_bootstrap(subs, body)
    head = {"id": f"chatcmpl-{group_rid}", "created": int(time.time()), "model": server.model_name}
    group = await server.manager.submit(group_rid, subs, body.data_parallel_rank)
    if body.stream:
        return await released_on_error(server.manager, group, _stream_chat(
            request, server, group, head, bool(body.logprobs), body, plan))
    await wait_all(request, server.manager, group)
    request_errors(group)
    choices = []
    for i, st in enumerate(group.states):
        lp = chat_logprobs(st, server.token_text, 0, len(st.output_ids)) if body.logprobs else None
        message, reason = final_message(plan, st.text, finish_reason(st))
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": reason, "matched_stop": matched_stop(st)})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage(group.states, n)})


async def _stream_chat(request: Request, server: ServerState, group: RequestGroup, head: dict[str, Any],
                       logprobs: bool, body: ChatCompletionRequest, plan: ChatOutputPlan) -> Response:
    include_usage, continuous = _usage_flags(body)
    head = {**head, "object": "chat.completion.chunk"}
    streams = [ChoiceStream(plan) for _ in group.states]
    sent = [0] * len(group.states)
    started: set[int] = set()

    def chunk(index: int, delta: dict[str, Any], lp: Any, reason: str | None) -> str:
        data: dict[str, Any] = {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                                     "finish_reason": reason}]}
        if continuous:
            data["usage"] = usage(group.states, len(group.states))
        return sse(data)

    def render(ev: Event) -> list[str]:
        i, st = ev.index, group.states[ev.index]
        out = []
        if i not in started:  # OpenAI opens each choice with the role
            started.add(i)
            out.append(chunk(i, {"role": "assistant", "content": ""}, None, None))
        lp = None
        if logprobs:
            end = len(st.output_logprobs)
            lp = chat_logprobs(st, server.token_text, sent[i], end)
            sent[i] = end
        deltas = streams[i].feed(ev.delta) if ev.delta else []
        if ev.finished:
            deltas += streams[i].finish()
        if lp and lp["content"] and not deltas:
            deltas = [{"content": ""}]  # the logprobs of held-back text still go out now
        for j, delta in enumerate(deltas):
            out.append(chunk(i, delta, lp if j == 0 else None, None))
        if ev.finished:
            out.append(chunk(i, {}, None, stream_finish_reason(streams[i], finish_reason(st))))
        return out

    def tail() -> list[str]:
        if not include_usage:
            return []
        return [sse({**head, "choices": [], "usage": usage(group.states, len(group.states))})]

    return stream_events(server.manager, group, render, tail)


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
