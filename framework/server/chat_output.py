"""A chat choice's output as OpenAI shapes it: ``content``, ``reasoning_content``, ``tool_calls``.

:func:`final_message` builds the non-streamed message; :class:`ChoiceStream` turns text deltas
into stream deltas. Both run the same parsers (reasoning first, then tool calls on the content),
so a stream's deltas add up to the non-streamed message. An output constrained to JSON
(``tool_choice`` required or named, ``response_format``) skips the reasoning parser: the grammar
covers the whole output, so there is no reasoning section in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.parsing.reasoning import ReasoningParser, ReasoningStream
from framework.parsing.tool_calls import ToolCall, ToolCallStream, new_call_id, openai_tool_call
from framework.server.chat_tools import ToolPlan, forced_calls, plan_tools
from framework.server.structured import installed, response_format_fields, response_format_names


@dataclass
class ChatOutputPlan:
    """What to parse out of one chat request's choices."""

    tools: ToolPlan
    tool_parser: Any = None
    reasoning: ReasoningParser | None = None
    """The reasoning parser, or None when off (none configured, ``separate_reasoning: false``, or a
    constrained output)."""
    stream_reasoning: bool = True
    """SGLang's ``stream_reasoning``: false sends the reasoning in one delta once it is complete."""


def final_message(plan: ChatOutputPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a finished choice."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    content = text
    if plan.reasoning is not None:
        reasoning, content = plan.reasoning.split(text)
        message["reasoning_content"] = reasoning
        message["content"] = content
    calls: list[ToolCall] | None = None
    if plan.tools.mode in ("required", "named"):
        calls = forced_calls(plan.tools, content)
    elif plan.tools.mode == "auto" and plan.tool_parser is not None:
        content, found = plan.tool_parser.parse(content)
        calls = found[:1] if found and not plan.tools.parallel else found
    if calls:
        message["content"] = None if plan.tools.mode != "auto" else (content or None)
        message["tool_calls"] = [openai_tool_call(c, new_call_id()) for c in calls]
        if reason == "stop" and plan.tools.mode != "named":  # OpenAI: a forced function ends with "stop"
            reason = "tool_calls"
    return message, reason


@dataclass
class ChoiceStream:
    """Stream deltas of one choice (``feed`` each text delta, then ``finish``)."""

    plan: ChatOutputPlan
    reasoning: ReasoningStream | None = None
    tool_stream: ToolCallStream | None = None
    buffered: str = ""
    calls: int = 0
    named_id: str | None = None
    held_reasoning: str = ""

    def __post_init__(self) -> None:
        if self.plan.reasoning is not None:
            self.reasoning = ReasoningStream(self.plan.reasoning)
        if self.plan.tools.mode == "auto" and self.plan.tool_parser is not None:
            self.tool_stream = ToolCallStream(self.plan.tool_parser, self.plan.tools.parallel)

    @property
    def has_calls(self) -> bool:
        return self.calls > 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The stream deltas (``{"content"}``, ``{"reasoning_content"}``, ``{"tool_calls"}``) for ``delta``."""
        out: list[dict[str, Any]] = []
        content = delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta)
            out += self._reasoning(reasoning, done=bool(content) or self.reasoning.state == "content")
        out += self._content(content, final=False)
        return out

    def _reasoning(self, text: str, done: bool) -> list[dict[str, Any]]:
        if self.plan.stream_reasoning:
            return [{"reasoning_content": text}] if text else []
        self.held_reasoning += text
        if not done or not self.held_reasoning:
            return []
        held, self.held_reasoning = self.held_reasoning, ""
        return [{"reasoning_content": held}]

    def finish(self) -> list[dict[str, Any]]:
        """What was held back, once the choice is finished."""
        out: list[dict[str, Any]] = []
        content = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            out += self._reasoning(reasoning, done=True)
        out += self._content(content, final=True)
        return out

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        mode = self.plan.tools.mode
        if mode == "named":
            return self._named(text)
        if mode == "required":
            self.buffered += text
            if not final:
                return []
            calls = forced_calls(self.plan.tools, self.buffered)
            return self._calls(calls) if calls else [{"content": self.buffered}]
        if self.tool_stream is not None:
            content, calls = self.tool_stream.feed(text) if text else ("", [])
            if final:
                rest, more = self.tool_stream.finish()
                content, calls = content + rest, calls + more
            out = [{"content": content}] if content else []
            return out + self._calls(calls)
        return [{"content": text}] if text else []

    def _named(self, text: str) -> list[dict[str, Any]]:
        # The constrained output is the arguments themselves: stream them as they come.
        out = []
        if self.named_id is None and text:
            self.named_id = new_call_id()
            self.calls = 1
            header = openai_tool_call(ToolCall(self.plan.tools.name or "", ""), self.named_id, index=0)
            out.append({"tool_calls": [header]})
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            header = openai_tool_call(ToolCall(call.name, ""), new_call_id(), index=self.calls)
            out.append({"tool_calls": [header]})
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": call.arguments}}]})
            self.calls += 1
        return out


def stream_finish_reason(stream: ChoiceStream, reason: str | None) -> str | None:
    """The finish reason of a streamed choice (``tool_calls`` when it made calls, except a
    forced function, which ends with ``stop`` as in OpenAI)."""
    if stream.has_calls and reason == "stop" and stream.plan.tools.mode != "named":
        return "tool_calls"
    return reason


def prepare_chat(body: Any, tool_parser: Any, reasoning_parser: ReasoningParser | None) -> tuple[
        ChatOutputPlan, dict[str, Any], dict[str, str]]:
    """(output plan, constraint fields for the sampling parameters, names of those fields as the
    client gave them) of a chat request; 400 for bad tools, tool_choice or response_format."""
    tools = plan_tools(body, tool_parser, installed("tool_parser"))
    if tools.schema is not None:
        constraint, names = {"json_schema": tools.schema}, {"json_schema": "tool_choice"}
    else:
        constraint = response_format_fields(body.response_format, body.sampling())
        names = response_format_names(body.response_format)
    # A forced call or a response_format covers the whole output with JSON: no reasoning in it. A raw
    # regex / ebnf may spell out the reasoning markers itself, so the parser still runs then.
    use_reasoning = reasoning_parser is not None and body.separate_reasoning is not False and not constraint
    plan = ChatOutputPlan(tools, tool_parser, reasoning_parser if use_reasoning else None,
                          stream_reasoning=body.stream_reasoning is not False)
    return plan, constraint, names
