"""Structured output on the HTTP side: ``response_format``, SGLang's constraint fields, and the
grammar backend's validation of every constraint before a request is queued.

Constraints travel to the scheduler as SamplingParams fields (``json_schema``, ``regex``,
``ebnf``, ``structural_tag``). OpenAI's ``response_format`` becomes one of them here. A malformed
constraint is a 400 naming the field the client used, answered without a round trip: the backend's
``validate`` is cheap (no vocabulary), the expensive compile happens in the scheduler process.
"""

from __future__ import annotations

import json
from typing import Any

from framework.config.schema import PlugserveConfig
from framework.grammar.base import GrammarError, spec_of
from framework.plugins import get_registry
from framework.sampling.constraints import CONSTRAINT_FIELDS
from framework.server.errors import bad_request

JSON_OBJECT_SCHEMA = json.dumps({"type": "object", "additionalProperties": True})
"""``response_format: {"type": "json_object"}``: any JSON object (the schema says so explicitly,
since strict schema modes close objects by default)."""


def load_output_plugins(settings: PlugserveConfig, tokenizer: Any, vocab_size: int) -> tuple[Any, Any, Any]:
    """(grammar backend, tool parser, reasoning parser) of this server; the parsers may be None."""
    registry = get_registry()
    comp = registry.get("grammar_backend", settings.grammar.backend, key="grammar.backend")
    grammar = comp.factory(tokenizer, vocab_size, comp.make_options(settings.grammar.options))
    parsers = []
    for key, kind in (("tool_call_parser", "tool_parser"), ("reasoning_parser", "reasoning_parser")):
        name = getattr(settings.server, key)
        if name is None:
            parsers.append(None)
            continue
        parser_comp = registry.get(kind, name, key=f"server.{key}")
        parsers.append(parser_comp.factory(parser_comp.make_options(None)))
    return grammar, parsers[0], parsers[1]


def response_format_fields(fmt: dict[str, Any] | None, given: dict[str, Any]) -> dict[str, Any]:
    """The constraint field that ``response_format`` stands for ({} for text or none). ``given``:
    the request's own constraint fields (combining both is a 400)."""
    if fmt is None:
        return {}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    others = [name for name in CONSTRAINT_FIELDS if given.get(name) is not None]
    if others:
        raise bad_request(f"response_format cannot be combined with {others[0]}", "response_format")
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":  # SGLang's extension
        return {"structural_tag": json.dumps({k: v for k, v in fmt.items() if k != "type"})}
    raise bad_request(f"response_format type {kind!r} is not supported: use text, json_object, json_schema "
                      "or structural_tag", "response_format.type")


def check_grammar(backend: Any, params: Any, names: dict[str, str] | None = None) -> None:
    """400 naming the client's field when the request's constraint is malformed."""
    spec = spec_of(params)
    if spec is None or backend is None:
        return
    try:
        backend.validate(spec)
    except GrammarError as exc:
        field = (names or {}).get(exc.field, exc.field)
        raise bad_request(f"{field}: {exc.message}", field, "invalid_value") from None


def response_format_names(fmt: dict[str, Any] | None) -> dict[str, str]:
    """How a grammar error names the client's field when the constraint came from ``response_format``."""
    kind = (fmt or {}).get("type")
    if kind == "json_schema":
        return {"json_schema": "response_format.json_schema.schema"}
    if kind in ("json_object", "structural_tag"):
        return {"json_schema": "response_format", "structural_tag": "response_format"}
    return {}


def installed(kind: str) -> list[str]:
    """The registered names of a component kind (for error messages)."""
    return get_registry().names(kind)
