"""OpenAI tool calling on the chat route: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

``tool_choice``:

- ``none``: the tools still reach the chat template; the output is plain content.
- ``auto`` (the default with tools): the server's tool-call parser (``server.tool_call_parser``)
  finds calls in the output; without a parser it is a 400, as in vLLM.
- ``required``: the grammar backend constrains the output to a JSON array of
  ``{"name", "parameters"}`` objects, one per call, each name one of the tools and its parameters
  valid against that tool's schema (at most one call with ``parallel_tool_calls: false``).
- a named function: the output is constrained to that function's parameters; it is the call's
  ``arguments``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from framework.parsing.tool_calls import ToolCall
from framework.sampling.constraints import CONSTRAINT_FIELDS
from framework.server.errors import bad_request

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    mode: str
    """``none``, ``auto``, ``required`` or ``named``."""
    tools: list[dict[str, Any]] | None
    """The tools as the chat template receives them (None without tools)."""
    parallel: bool = True
    name: str | None = None
    """The forced function (mode ``named``)."""
    schema: str | None = None
    """The JSON schema that constrains the output (modes ``required`` and ``named``)."""


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by function name; 400 naming the bad entry."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise bad_request(f"tool type {tool.get('type')!r} is not supported: only function", f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool needs function.name", f"tools.{i}.function.name")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise bad_request("function.parameters must be a JSON schema object", f"tools.{i}.function.parameters")
        by_name[fn["name"]] = params
    return by_name


def plan_tools(body: Any, parser: Any, parser_names: list[str]) -> ToolPlan:
    """The request's :class:`ToolPlan`; 400 for a bad ``tools`` / ``tool_choice``."""
    tools, choice = body.tools or None, body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan("none", None)
    by_name = _check_tools(tools)
    if choice in (None, "auto"):
        if parser is None:
            raise bad_request("tool_choice auto needs a tool-call parser: start the server with "
                              f"server.tool_call_parser=<name> (installed: {', '.join(parser_names)}), "
                              "or send tool_choice required, none or a named function", "tool_choice")
        return ToolPlan("auto", tools, parallel)
    if choice == "none":
        return ToolPlan("none", tools, parallel)
    taken = [name for name in CONSTRAINT_FIELDS if getattr(body, name, None) is not None]
    fmt = body.response_format
    if taken or (fmt and fmt.get("type") != "text"):
        raise bad_request("a forced tool call cannot be combined with response_format or another constraint",
                          "tool_choice")
    if choice == "required":
        return ToolPlan("required", tools, parallel, schema=json.dumps(required_schema(by_name, parallel)))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in by_name:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice.function.name")
        return ToolPlan("named", tools, parallel, name=name, schema=json.dumps(by_name[name]))
    raise bad_request(f"tool_choice {choice!r} is not one of none, auto, required or a named function", "tool_choice")


def required_schema(by_name: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <a tool>, "parameters": <its schema>}``."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in by_name.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls of a constrained (required / named) output; None if it is not complete JSON
    (the output ran out of tokens: it is returned as content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        return [ToolCall(plan.name or "", json.dumps(value, ensure_ascii=False))]
    calls = [ToolCall.from_json(v) for v in value] if isinstance(value, list) else [None]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` with their ``arguments`` as objects, as Hugging Face chat
    templates expect (OpenAI clients send them as JSON text)."""
    for msg in messages:
        calls = msg.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # leave it as text: the template shows what the client sent
    return messages
