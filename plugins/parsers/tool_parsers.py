"""Built-in tool-call parsers: the JSON styles of Llama 3, Qwen 2.5 / Hermes and Mistral."""

from __future__ import annotations

import json
from typing import Any

from framework.hookspecs import hookimpl
from framework.parsing.tool_calls import ToolCall, ToolParser, decode_json_sequence


def _calls(values: list[Any]) -> list[ToolCall] | None:
    calls = [ToolCall.from_json(v) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``, several separated by
    ``;`` (the ``<|python_tag|>`` before them is a special token, gone from the text)."""

    start_marker = "{"

    def complete_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        values, rest = decode_json_sequence(section)
        calls = _calls(values)
        if final and (calls is None or not calls or section[rest:].strip()):
            return None
        if calls is None:
            good = []
            for v in values:
                call = ToolCall.from_json(v)
                if call is None:
                    break
                good.append(call)
            return good
        return calls


class HermesToolParser(ToolParser):
    """Qwen 2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
    (a last block left open at the end of the output counts)."""

    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def complete_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = section.find(self.start_marker, pos)
            if start < 0:
                break
            body_at = start + len(self.start_marker)
            end = section.find(self.end_marker, body_at)
            if end < 0 and not final:
                break
            body = section[body_at:] if end < 0 else section[body_at:end]
            try:
                call = ToolCall.from_json(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return None if final else calls
            calls.append(call)
            if end < 0:
                break
            pos = end + len(self.end_marker)
        if final and not calls:
            return None
        return calls


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v0.3 tokenizers) or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+)."""

    start_marker = "[TOOL_CALLS]"

    def complete_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        body = section[len(self.start_marker):].lstrip()
        if body.startswith("["):
            values, rest = decode_json_sequence(body)
            ok = len(values) == 1 and isinstance(values[0], list) and not body[rest:].strip()
            calls = _calls(values[0]) if ok else None
            if final:
                return calls or None
            return calls or []
        calls = []
        parts = section.split(self.start_marker)[1:]
        for i, part in enumerate(parts):
            name, sep, args = part.partition("[ARGS]")
            values, rest = decode_json_sequence(args)
            last = i == len(parts) - 1
            if not sep or len(values) != 1 or args[rest:].strip() or not name.strip():
                if last and not final:
                    break  # still arriving
                return None if final else calls
            calls.append(ToolCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
        if final and not calls:
            return None
        return calls


@hookimpl
def register_tool_parsers(register: Any) -> None:
    register("llama3_json", lambda options=None: Llama3JsonToolParser())
    register("hermes", lambda options=None: HermesToolParser())
    register("qwen25", lambda options=None: HermesToolParser())
    register("mistral", lambda options=None: MistralToolParser())
