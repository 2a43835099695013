"""The tool-call parser plugin kind (``register_tool_parsers``) and OpenAI's tool-call shapes.

A :class:`ToolParser` finds the calls in a completion's text: ``parse`` on the whole text, and
``complete_calls`` on a growing tool-call section while streaming (only the calls whose text is
finished). :class:`ToolCallStream` drives either through a stream: content before the parser's
``start_marker`` streams as it comes (a partial marker is held back), calls go out as each one
completes, and whatever the parser could not read goes out as content at the end, so the stream
and the whole parse agree.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from framework.parsing.markers import partial_suffix


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's ``arguments``)."""

    name: str
    arguments: str

    @classmethod
    def from_json(cls, obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
        """A call from ``{"name": ..., "arguments" | "parameters": {...}}``; None if it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        return cls(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_call(call: ToolCall, call_id: str, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI's ``message.tool_calls`` entry (with ``index`` in stream deltas)."""
    out: dict[str, Any] = {"id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


def decode_json_sequence(text: str, separators: str = " \t\r\n;,") -> tuple[list[Any], int]:
    """JSON values one after another in ``text`` (separated by whitespace, ``;`` or ``,``): the
    values and where the undecoded rest starts (an unfinished or invalid value stops it)."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text):
            return values, pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return values, pos
        values.append(value)
        pos = end


class ToolParser(ABC):
    """A tool-call format. ``start_marker`` opens the calls; text before it is content."""

    start_marker: str = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; a section that cannot be read stays content."""
        idx = text.find(self.start_marker) if self.start_marker else -1
        if idx < 0:
            return text, []
        calls = self.complete_calls(text[idx:], final=True)
        if calls is None:
            return text, []
        return text[:idx], calls

    @abstractmethod
    def complete_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        """The finished calls in ``section`` (which starts at the marker). ``final``: the output is
        complete; return None if the section is not valid calls (it is then content)."""


class ToolCallStream:
    """Streams one choice's content and tool calls (see the module docstring)."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.p = parser
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # content characters already streamed
        self.section: int | None = None  # where the calls start, once the marker was seen
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content delta, calls completed by this delta)."""
        self.text += delta
        content = ""
        if self.section is None:
            marker = self.p.start_marker
            idx = self.text.find(marker, self.sent) if marker else -1
            if idx < 0:
                safe = len(self.text) - partial_suffix(self.text, marker)
                content, self.sent = self.text[self.sent:safe], max(self.sent, safe)
                return content, []
            content, self.sent, self.section = self.text[self.sent:idx], idx, idx
        found = self.p.complete_calls(self.text[self.section:], final=False) or []
        return content, self._new(found)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the last calls, or the unreadable section as content."""
        if self.section is None:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        found = self.p.complete_calls(self.text[self.section:], final=True)
        if found is None:
            if self.calls:
                return "", []  # calls already went out; the broken tail is dropped
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        return "", self._new(found)

    def _new(self, found: list[ToolCall]) -> list[ToolCall]:
        limit = len(found) if self.parallel else min(len(found), 1)
        new = found[len(self.calls):limit]
        self.calls.extend(new)
        return new
