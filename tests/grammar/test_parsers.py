"""Tool-call and reasoning parsers: each format's documented shape, parsed whole and streamed
in every possible split (the stream must add up to the whole parse)."""

from __future__ import annotations

import json

import pytest

from framework.parsing.reasoning import ReasoningStream
from framework.parsing.tool_calls import ToolCall, ToolCallStream
from framework.plugins import get_registry


def _parser(kind, name):
    comp = get_registry().get(kind, name)
    return comp.factory(None)


ARGS = {"city": "Paris", "days": 3}
TOOL_CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", ARGS), ("get_time", {})]),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "",
     [("get_weather", ARGS)]),
    ("hermes", "No tools needed <tool_call>{broken</tool_call>",
     "No tools needed <tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {}}', "", [("get_weather", ARGS), ("get_time", {})]),
    ("llama3_json", "The answer is {not json} really", "The answer is {not json} really", []),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', "Sure",
     [("get_weather", ARGS)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", ARGS), ("get_time", {})]),
    ("mistral", "plain text [TOOL_CALLS] oops", "plain text [TOOL_CALLS] oops", []),
]


def _pairs(calls: list[ToolCall]):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), TOOL_CASES)
def test_tool_parsers_whole_and_streamed(name, text, content, calls):
    parser = _parser("tool_parser", name)
    got_content, got_calls = parser.parse(text)
    assert (got_content, _pairs(got_calls)) == (content, calls)
    for cut in range(len(text) + 1):
        for step in (1, 7):
            stream = ToolCallStream(parser)
            streamed_content, streamed_calls = "", []
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            for piece in pieces:
                c, new = stream.feed(piece)
                streamed_content += c
                streamed_calls += new
            c, new = stream.finish()
            assert (streamed_content + c, _pairs(streamed_calls + new)) == (content, calls), (cut, step)


def test_parallel_false_keeps_one_call():
    stream = ToolCallStream(_parser("tool_parser", "hermes"), parallel=False)
    text = TOOL_CASES[0][1]
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    assert [c.name for c in calls + more] == ["get_weather"]


REASONING_CASES = [
    ("qwen3", "<think>\nfirst, think</think>\n\nThe answer.", "\nfirst, think", "\n\nThe answer."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off before the end", "cut off before the end", ""),
    ("deepseek_r1", "reasoning without the opening tag</think>answer", "reasoning without the opening tag",
     "answer"),
    ("deepseek_r1", "<think>with it</think>answer", "with it", "answer"),
    ("deepseek_r1", "all reasoning, cut off", "all reasoning, cut off", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_parsers_whole_and_streamed(name, text, reasoning, content):
    parser = _parser("reasoning_parser", name)
    assert parser.split(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser)
        r1, c1 = stream.feed(text[:cut])
        r2, c2 = "", ""
        for ch in text[cut:]:
            r, c = stream.feed(ch)
            r2, c2 = r2 + r, c2 + c
        r3, c3 = stream.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning or "", content), cut
