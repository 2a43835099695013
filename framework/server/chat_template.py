"""Rendering a tokenizer's chat template, always inside a jinja2 sandbox.

Chat templates ship with model checkpoints: they are untrusted code. transformers'
``apply_chat_template`` compiles them in an ``ImmutableSandboxedEnvironment`` (checked here at
run time, not assumed: :func:`transformers_sandboxes`); if a transformers version ever stops doing
so, or the check cannot be made, plugserve renders the template itself in its own sandbox.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from framework.server.errors import bad_request


@functools.cache
def transformers_sandboxes() -> bool:
    """True when transformers compiles chat templates in an immutable jinja2 sandbox."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return False
    try:
        env = _compile_jinja_template("{{ 1 }}").environment
    except Exception:
        return False
    return isinstance(env, ImmutableSandboxedEnvironment)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _sandbox() -> ImmutableSandboxedEnvironment:
    # The same conventions as Hugging Face chat templates: trimmed blocks, loop controls,
    # raise_exception() and strftime_now().
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render_in_sandbox(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      special_tokens: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> str:
    """Render ``template`` in plugserve's own sandbox (the fallback path)."""
    compiled = _sandbox().from_string(template)
    return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **special_tokens)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for ``messages`` (and ``tools``, which templates that support tool calling
    render); template problems are the client's 400, never a 500."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages", "no_chat_template")
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()))
    try:
        if transformers_sandboxes():
            text = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        else:
            text = render_in_sandbox(template, messages, add_generation_prompt, _special_tokens(tokenizer), tools)
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as exc:
        # TemplateError covers SecurityError (a sandbox violation) and raise_exception(); the
        # others come from templates doing string arithmetic on unexpected message shapes.
        raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce text", "messages")
    return text


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: getattr(tokenizer, n, None) for n in names}
