"""Structured output over HTTP on a real server: every constrained output is checked against a
reference nobody here wrote (jsonschema, re.fullmatch), over many seeds with sampling on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.conftest import sse_events

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}(\.[a-z]{1,3})?"
SEEDS = range(8)


def _check_choices(finishes_and_texts: list[tuple[str, str]], check) -> None:
    stopped = [text for reason, text in finishes_and_texts if reason == "stop"]
    # Most outputs must complete, or the check below would pass vacuously.
    assert len(stopped) >= len(finishes_and_texts) * 3 // 4, finishes_and_texts
    for text in stopped:
        check(text)


def _valid(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema)


def test_chat_json_schema_many_seeds(http):
    got = []
    for seed in SEEDS:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Describe a person."}],
                "temperature": 1.0, "seed": seed, "max_tokens": 96, "n": 2,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got += [(c["finish_reason"], c["message"]["content"]) for c in r.json()["choices"]]
    _check_choices(got, _valid(SCHEMA))


def test_chat_json_schema_streamed(http):
    got = []
    for seed in SEEDS:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "JSON please"}], "stream": True,
                "temperature": 1.0, "seed": seed, "max_tokens": 96,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
        chunks = [e for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        got.append((reason[-1], text))
    _check_choices(got, _valid(SCHEMA))


def test_completions_json_object_and_sglang_json_schema(http):
    got_obj, got_schema = [], []
    for seed in SEEDS:
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "temperature": 1.0, "seed": seed,
                                              "max_tokens": 64, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        got_obj.append((c["finish_reason"], c["text"]))
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "temperature": 1.0, "seed": seed,
                                              "max_tokens": 96, "json_schema": json.dumps(SCHEMA)})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        got_schema.append((c["finish_reason"], c["text"]))
    # json_object: any object; a random model may wander, so only the finished ones are checked,
    # and those must be objects.
    for reason, text in got_obj:
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
    _check_choices(got_schema, _valid(SCHEMA))


def test_generate_regex_many_seeds_and_stream(http):
    got = []
    for seed in SEEDS:
        r = http.post("/generate", json={"text": "pet:", "sampling_params": {
            "regex": REGEX, "temperature": 1.0, "seed": seed, "max_new_tokens": 32}})
        assert r.status_code == 200, r.text
        out = r.json()
        got.append((out["meta_info"]["finish_reason"]["type"], out["text"]))
    _check_choices(got, lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} does not match"))
    with http.stream("POST", "/generate", json={"text": "pet:", "stream": True, "sampling_params": {
            "regex": REGEX, "temperature": 1.0, "seed": 99, "max_new_tokens": 32}}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(REGEX, events[-1]["text"])


def test_generate_ebnf(http):
    grammar = 'root ::= ("yes" | "no" | "maybe " [0-9]) "!"'
    for seed in SEEDS:
        r = http.post("/generate", json={"text": "answer:", "sampling_params": {
            "ebnf": grammar, "temperature": 1.0, "seed": seed, "max_new_tokens": 16}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(r"(yes|no|maybe [0-9])!", out["text"]), out["text"]


def test_generate_structural_tag(http):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
           "triggers": ["<f>"]}
    r = http.post("/generate", json={"text": "call:", "sampling_params": {
        "structural_tag": json.dumps(tag), "temperature": 1.0, "seed": 1, "max_new_tokens": 24}})
    assert r.status_code == 200, r.text
    for section in re.findall(r"<f>(.*?)</f>", r.json()["text"]):
        jsonschema.validate(json.loads(section), schema)


def test_grammar_not_finished_within_max_tokens_is_length(http):
    long = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    r = http.post("/v1/chat/completions", json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0,
        "seed": 3, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": long}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "b"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/completions", {"prompt": "x", "regex": "a("}, "regex"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "json_schema": "{}"}, "regex"),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= "}, "ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(?P<n>a)"}}, "regex"),
])
def test_invalid_constraint_is_400_naming_the_field(http, route, body, param):
    if route != "/generate":
        body = {"model": "tiny-llama", **body}
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
