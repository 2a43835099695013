"""SGLang's native ``POST /generate``: text or token ids, one or a batch, JSON or SSE.

The response of one prompt is ``{"text", "output_ids", "meta_info"}`` (a list for a batch, or for
``n > 1``), exactly what the in-process ``Engine.generate`` returns. Streamed events carry the text
and ids so far (SGLang's default: clients print ``text[len(previous):]``), plus ``index`` in a
batch.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from framework.engine.request_state import RequestState
from framework.server.group_response import request_errors, stream_events, wait_all
from framework.server.http_utils import finite, parse_model, require_bearer, sse
from framework.server.image_inputs import generate_image_sources
from framework.server.openai_format import TokenText
from framework.server.protocol import GenerateRequest
from framework.server.request_builder import attach_bootstrap, new_rid, require, sub_rids
from framework.server.state import ServerState
from framework.server.tokenizer_manager import Event, SubRequest

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` (capped by what the context leaves after the prompt)."""
_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs",
                 "output_token_ids_logprobs", "input_token_ids_logprobs")


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A per-request field given once (applies to all) or as a list of one value per prompt."""
    if isinstance(value, list):
        require(len(value) == count, f"{name} has {len(value)} entries for {count} prompts", name)
        return value
    return [value] * count


async def _prompts(server: ServerState, body: GenerateRequest) -> tuple[list[list[int]], list[Any], bool]:
    """Each prompt's ids, what the scheduler gets of its images (None: none), and whether the
    request was a single prompt. Prompts with images are padded by the model's processor."""
    require((body.text is None) != (body.input_ids is None), "give exactly one of text and input_ids", "text")
    if body.text is not None:
        raw: list[Any] = [body.text] if isinstance(body.text, str) else body.text
        single = isinstance(body.text, str)
        require(len(raw) > 0, "text must not be an empty list", "text")
        server.builder.check_sequence_count(len(raw), len(raw))  # before tokenizing any
    else:
        ids = body.input_ids or []
        single = not ids or isinstance(ids[0], int)
        raw = [list(ids)] if single else [list(p) for p in ids]  # type: ignore[arg-type]
        require(len(raw) > 0, "input_ids must not be an empty list", "input_ids")
    where = "input_ids" if body.input_ids is not None else "text"
    images = generate_image_sources(body.image_data, len(raw), not single)
    frontend = server.require_images("image_data") if any(images) else None
    if frontend is not None:
        frontend.loader.check_count(sum(map(len, images)), "image_data")
    prompts: list[list[int]] = []
    wires: list[Any] = []
    for prompt, sources in zip(raw, images, strict=True):
        ids = await server.builder.tokenize(prompt, "text") if isinstance(prompt, str) else prompt
        if sources and frontend is not None:  # the model's image token, once per image, becomes its span
            ids, mm = await frontend.process(ids, sources, where)
            wires.append(frontend.wire(mm))
        else:
            server.builder.check_ids(ids, where)
            wires.append(None)
        prompts.append(ids)
    return prompts, wires, single


async def generate(request: Request) -> Response:
    """``POST /generate``."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    body = await parse_model(request, GenerateRequest, server.body_limits)
    _check_sglang_fields(server, body)
    prompts, wires, single = await _prompts(server, body)
    count = len(prompts)
    sampling = _with_processor(_per_prompt(body.sampling_params or {}, count, "sampling_params"),
                               _per_prompt(body.custom_logit_processor, count, "custom_logit_processor"))
    want_lp = _per_prompt(body.return_logprob, count, "return_logprob")
    top_nums = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    user_rids = _per_prompt(body.rid, count, "rid") if isinstance(body.rid, list) else None
    token_ids = body.token_ids_logprob
    per_prompt_ids = token_ids if token_ids and isinstance(token_ids[0], list) else [token_ids] * count
    require(len(per_prompt_ids) == count, f"token_ids_logprob has {len(per_prompt_ids)} lists for {count} prompts",
            "token_ids_logprob")
    group_rid = body.rid if isinstance(body.rid, str) else new_rid()

    where = "input_ids" if body.input_ids is not None else "text"
    plans = []
    for i, ids in enumerate(prompts):
        default = max(1, min(DEFAULT_MAX_NEW_TOKENS, server.builder.context_len - len(ids)))
        plans.append((ids, server.builder.sampling_params(sampling[i], default)))
    total = sum(p.n for _, p in plans)
    server.builder.check_sequence_count(len(plans), total)
    for i, (ids, params) in enumerate(plans):
        server.builder.check_length(ids, params, where, "max_new_tokens")
        server.builder.check_top_logprobs(top_nums[i], "top_logprobs_num")
        require(starts[i] >= -1, "logprob_start_len must be >= -1", "logprob_start_len")
        server.builder.check_token_ids(per_prompt_ids[i] or [], "token_ids_logprob")
    rids = sub_rids(group_rid, total)
    subs: list[SubRequest] = []
    for i, (ids, params) in enumerate(plans):
        mine = rids[len(subs):len(subs) + params.n]
        if user_rids is not None:
            mine = sub_rids(user_rids[i], params.n)
        subs += server.builder.expand(mine, ids, params, return_logprob=bool(want_lp[i]),
                                      top_logprobs_num=top_nums[i], logprob_start_len=starts[i],
                                      priority=body.priority, token_ids_logprob=per_prompt_ids[i],
                                      mm_inputs=wires[i])
    attach_bootstrap(subs, body)
    text_of = server.token_text if body.return_text_in_logprobs else None
    batch = not (single and len(subs) == 1)
    group = await server.manager.submit(group_rid, subs, body.data_parallel_rank)

    if body.stream:
        # Events may queue up while the client reads; each renders the state as it is now, so
        # an event that adds nothing since the last one sent is skipped.
        sent = [(-1, False)] * len(group.states)

        def render(ev: Event) -> list[str]:
            st = group.states[ev.index]
            now = (len(st.output_ids), st.finished)
            if now == sent[ev.index]:
                return []
            sent[ev.index] = now
            out = _result(st, text_of)
            if batch:
                out["index"] = ev.index
            return [sse(out)]

        return stream_events(server.manager, group, render, lambda: [])

    await wait_all(request, server.manager, group)
    request_errors(group)
    results = [_result(st, text_of) for st in group.states]
    return JSONResponse(results if batch else results[0])


def _check_sglang_fields(server: ServerState, body: GenerateRequest) -> None:
    """SGLang's request fields that need more than the sampling parameters."""
    if body.return_text_in_logprobs:
        server.require_tokenizer("return_text_in_logprobs", "return_text_in_logprobs")
    server.builder.check_priority(body.priority)


def _with_processor(sampling: list[Any], processors: list[Any]) -> list[Any]:
    """Each prompt's sampling dict with SGLang's top-level ``custom_logit_processor`` (a name;
    checked with the other sampling fields) moved inside, as the scheduler reads it."""
    out = []
    for fields, name in zip(sampling, processors, strict=True):
        if name is not None and isinstance(fields, dict):
            inner = fields.get("custom_logit_processor")
            require(inner is None or inner == name, "custom_logit_processor is given both in the request and in "
                    "sampling_params, with different values", "custom_logit_processor")
            fields = {**fields, "custom_logit_processor": name}
        out.append(fields)
    return out


def _result(state: RequestState, text_of: TokenText | None) -> dict[str, Any]:
    """The SGLang result, with JSON-safe logprobs (and token texts when asked)."""
    result = state.result()
    meta = result["meta_info"]
    for key in _LOGPROB_KEYS:
        if key in meta:
            meta[key] = _clean(meta[key], text_of)
    return result


def _clean(value: Any, text_of: TokenText | None) -> Any:
    """[logprob, token_id] pairs with -inf replaced and, optionally, the token text appended."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) and not isinstance(value[0], list):
        pair = [finite(value[0]), value[1]]
        return pair + [text_of(value[1])] if text_of is not None else pair
    if isinstance(value, list):
        return [_clean(v, text_of) for v in value]
    if isinstance(value, float):
        return finite(value)
    return value


ROUTES = [Route("/generate", generate, methods=["POST"])]
