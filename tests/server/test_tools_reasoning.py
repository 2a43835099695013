"""Tool calling and reasoning output through the real ``openai`` client against a real server.

The server runs the tiny random model with a chat template that renders tools (checked against
transformers' own rendering), the ``hermes`` tool-call parser and the ``qwen3`` reasoning parser.
A random model never writes a tool call or ``<think>`` by itself, so the tests either force the
call with the grammar (``tool_choice`` required / named: what the server must enforce) or pin
the output's shape with a ``regex`` and check that the parsers take it apart as the regex says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import API_KEY, Server, engine_overrides, served

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t['function'] | tojson }}{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(6)


@pytest.fixture(scope="module")
def tools_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tool-rendering chat template."""
    import shutil

    path = tmp_path_factory.mktemp("tools-model") / "tiny-tools"
    shutil.copytree(tiny_model, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tools_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory.mktemp("tools-server"), [
        *engine_overrides(tools_model), "server.tool_call_parser=hermes", "server.reasoning_parser=qwen3",
        "model.served_model_name=tiny"], API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as c:
        yield c


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_chat_template_receives_tools(client, tools_model):
    tok = AutoTokenizer.from_pretrained(tools_model)
    expected = tok.encode(tok.apply_chat_template(MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    with_tools = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                                max_tokens=2)
    without = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert with_tools.usage.prompt_tokens == len(expected) > without.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_many_seeds(client, parallel):
    finished = 0
    for seed in SEEDS:
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=120)
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _check_call(call)
    assert finished >= len(SEEDS) // 2


def test_named_tool_choice(client):
    for seed in SEEDS:
        r = client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI: a forced function ends with stop
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)


def _stream_calls(client, **kwargs) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls accumulated from stream deltas as OpenAI clients accumulate them."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "the id comes once, in the call's first delta"
                slot["id"], slot["name"] = tc.id, tc.function.name
                assert tc.type == "function"
            slot["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return calls, reason, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas(client, choice):
    for seed in SEEDS[:3]:
        calls, reason, content = _stream_calls(client, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=120)
        if reason == "length":
            continue
        assert reason == ("tool_calls" if choice == "required" else "stop")
        assert calls and content == ""
        assert sorted(calls) == list(range(len(calls)))
        for slot in calls.values():
            assert slot["id"].startswith("call_")
            jsonschema.validate(json.loads(slot["arguments"]), SCHEMAS[slot["name"]])


THINK_CALL = (r"<think>([a-z ]{1,12})</think>"
              r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>')


def test_auto_tool_call_and_reasoning_parsed(client):
    """The output is pinned to reasoning + a Hermes tool call; the parsers must take it apart."""
    for seed in SEEDS[:3]:
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=240, extra_body={"regex": THINK_CALL})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)
        thinking = choice.message.reasoning_content
        assert re.fullmatch("[a-z ]{1,12}", thinking)
        assert not choice.message.content
        calls, reason, content = _stream_calls(client, temperature=1.0, seed=seed, max_tokens=240,
                                               extra_body={"regex": THINK_CALL})
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", json.loads(call.function.arguments))]


REASONED = r"<think>([a-z ]{1,16})</think>([a-z]{1,16})"


@pytest.mark.parametrize("stream", [False, True, "whole reasoning"])
def test_reasoning_content_and_separate_reasoning(client, stream):
    for seed in SEEDS[:3]:
        kwargs = dict(model="tiny", messages=MSGS, temperature=1.0, seed=seed, max_tokens=60,
                      extra_body={"regex": REASONED})
        if stream:
            reasoning, content, pieces = "", "", 0
            extra = {"regex": REASONED, "stream_reasoning": stream is True}
            for chunk in client.chat.completions.create(stream=True, **{**kwargs, "extra_body": extra}):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    piece = getattr(delta, "reasoning_content", None) or ""
                    pieces += bool(piece)
                    reasoning += piece
                    content += delta.content or ""
            if stream == "whole reasoning":
                assert pieces == 1  # stream_reasoning false: the reasoning arrives in one delta
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            reasoning, content = message.reasoning_content, message.content
        whole = client.chat.completions.create(**{**kwargs, "extra_body": {"regex": REASONED,
                                                                          "separate_reasoning": False}})
        m = re.fullmatch(REASONED, whole.choices[0].message.content)  # same seed: the same text
        assert m, whole.choices[0].message.content
        assert (reasoning, content) == (m.group(1), m.group(2))


def test_tool_result_round_trip(client):
    """The client's next turn (the assistant's call, then the tool's result) renders and runs."""
    first = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=60, seed=0,
                                           temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    follow = [*MSGS, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice="none",
                                            max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_errors(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=MSGS, tool_choice="required")


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_malformed_tool_fields_are_400s(server, body, param):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers(), timeout=30,
                   json={"model": "tiny", "messages": MSGS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_odd_tool_calls_in_history_do_not_break_the_template(server):
    import httpx

    msgs = [*MSGS, {"role": "assistant", "content": "", "tool_calls": 5}, {"role": "user", "content": "again"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers(), timeout=30,
                   json={"model": "tiny", "messages": msgs, "max_tokens": 2})
    assert r.status_code in (200, 400), r.text  # the template decides; never a 500
