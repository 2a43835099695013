"""Tokenizer routes and the model card: ``/v1/tokenize``, ``/v1/detokenize`` (with SGLang's and
vLLM's unversioned ``/tokenize`` and ``/detokenize``) and ``/v1/models/{id}``.

The tokenize answer is the shape vLLM and SGLang share, ``{"tokens", "count", "max_model_len"}``
(lists of both for a list of prompts, as SGLang answers); vLLM's ``token_strs`` is added when
``return_token_strs`` is set. Detokenize answers with both vLLM's key (``prompt``) and SGLang's
(``text``), so clients of either read it unchanged. Tokenizing runs the very code the generation
routes use, so ``count`` is the prompt length a completion request would have.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from framework.server.chat_template import render_chat
from framework.server.errors import APIError
from framework.server.http_utils import parse_model, require_bearer
from framework.server.openai_routes import message_dict
from framework.server.protocol import DetokenizeRequest, TokenizeRequest
from framework.server.request_builder import require
from framework.server.state import ServerState


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the card, or OpenAI's 404 for a model this server does not serve
    (the model's path is accepted as its id too, as in the generation routes)."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    server.check_model(request.path_params["model_id"])
    return JSONResponse(server.model_card())


def _check_model_field(server: ServerState, name: str | None) -> None:
    # vLLM makes ``model`` optional on these routes; when given it must name this model.
    if name is not None:
        server.check_model(name)


async def tokenize(request: Request) -> Response:
    """``POST /v1/tokenize`` (and ``/tokenize``)."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    body = await parse_model(request, TokenizeRequest, server.body_limits)
    _check_model_field(server, body.model)
    require((body.prompt is None) != (body.messages is None), "give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        server.require_tokenizer("messages", "tokenizing chat messages")
        require(len(body.messages) > 0, "messages must not be empty", "messages")
        text = render_chat(server.tokenizer, [message_dict(i, m) for i, m in enumerate(body.messages)],
                           add_generation_prompt=body.add_generation_prompt)
        ids = [await _encode(server, text, bool(body.add_special_tokens))]
        single = True
    else:
        server.require_tokenizer("prompt", "tokenizing a prompt")
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
        require(len(prompts) > 0, "prompt must not be an empty list", "prompt")
        server.builder.check_sequence_count(len(prompts), len(prompts))
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = [await _encode(server, p, add) for p in prompts]
        single = isinstance(body.prompt, str)
    out: dict[str, Any] = {
        "tokens": ids[0] if single else ids,
        "count": len(ids[0]) if single else [len(i) for i in ids],
        "max_model_len": server.builder.context_len,
    }
    if body.return_token_strs:
        strs = [server.tokenizer.convert_ids_to_tokens(i) for i in ids]
        out["token_strs"] = strs[0] if single else strs
    return JSONResponse(out)


async def _encode(server: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    # The generation routes' own calls: a raw prompt with the model's special tokens, a rendered
    # chat template without (it already holds them).
    if add_special_tokens:
        return await server.builder.tokenize(text)
    return await server.builder.tokenize_rendered(text)


async def detokenize(request: Request) -> Response:
    """``POST /v1/detokenize`` (and ``/detokenize``)."""
    server: ServerState = request.app.state.server
    require_bearer(request, server.api_key)
    body = await parse_model(request, DetokenizeRequest, server.body_limits)
    _check_model_field(server, body.model)
    server.require_tokenizer("tokens", "detokenizing")
    single = not body.tokens or isinstance(body.tokens[0], int)
    lists: list[list[int]] = [body.tokens] if single else body.tokens  # type: ignore[list-item]
    vocab = server.builder.vocab_size
    for i, ids in enumerate(lists):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            where = "tokens" if single else f"tokens.{i}"
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param=where, code="invalid_value")
    texts = [server.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
    text: str | list[str] = texts[0] if single else texts
    return JSONResponse({"prompt": text, "text": text})


ROUTES = [
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/v1/tokenize", tokenize, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/v1/detokenize", detokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
