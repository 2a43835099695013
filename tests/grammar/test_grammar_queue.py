"""Constrained decoding in the scheduler: the grammar queue keeps a slow compile off the
critical path, compiled grammars are cached, failures fail their own request only, overlap mode
stays correct, and an unknown backend fails at start listing the installed ones."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from framework.config.loader import resolve_config
from framework.engine.engine import Engine
from framework.errors import ConfigError
from framework.grammar.base import GrammarError
from framework.hookspecs import hookimpl

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"type": "boolean"}},
          "required": ["n", "b"], "additionalProperties": False}
GATE = threading.Event()


class GatedBackend:
    """The xgrammar backend, with compiles that wait for GATE (a slow compile, on demand), and a
    regex that compiles to an error after passing validation (a backend failure)."""

    def __init__(self, tokenizer, vocab_size, options=None):
        from plugins.grammar.xgrammar_backend import XGrammarBackend

        self.inner = XGrammarBackend(tokenizer, vocab_size)
        self.compiles = 0

    def validate(self, spec):
        self.inner.validate(spec)

    def compile(self, spec):
        self.compiles += 1
        if spec.kind == "regex" and spec.value == "fail":
            raise GrammarError("regex", "this backend refuses it at compile time")
        GATE.wait(30)
        return self.inner.compile(spec)

    def matcher(self, compiled, stop_token_ids):
        return self.inner.matcher(compiled, stop_token_ids)


class GatedPlugin:
    @hookimpl
    def register_grammar_backends(self, register):
        register("gated", GatedBackend)


@pytest.fixture
def gated(register_plugin):
    register_plugin(GatedPlugin(), name="gated-grammar")
    GATE.clear()
    yield
    GATE.set()


def _engine(tiny_model, *extra):
    return Engine(overrides=[f"model.path={tiny_model}", "kv_cache.max_total_tokens=2048", "device.num_threads=1",
                             *extra], progress=False)


def _valid(text):
    jsonschema.validate(json.loads(text), SCHEMA)


def test_slow_compile_does_not_stall_other_requests(tiny_model, gated):
    eng = _engine(tiny_model, "grammar.backend=gated")
    slow = eng.submit("a", {"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": 1, "max_new_tokens": 40})
    fast = eng.submit("b", {"max_new_tokens": 8, "ignore_eos": True})
    for _ in range(20):
        eng.step()
    states = eng._states
    assert states[fast].finished and len(states[fast].output_ids) == 8
    assert not states[slow].finished and states[slow].output_ids == []
    assert eng.scheduler.grammar.pending  # still waiting for its compile, not holding KV
    GATE.set()
    while not states[slow].finished:
        eng.step()
    assert states[slow].finish_reason["type"] == "stop"
    _valid(states[slow].text)
    # the same schema again: the cached grammar, no second compile
    backend = eng.scheduler.grammar.manager.backend
    again = eng.generate("c", {"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": 2, "max_new_tokens": 40})
    _valid(again["text"])
    assert backend.compiles == 1 and eng.scheduler.grammar.manager.hits >= 1
    assert eng.leak_report()["leaked"] == 0


def test_compile_failure_fails_only_its_request(tiny_model, gated):
    GATE.set()
    eng = _engine(tiny_model, "grammar.backend=gated")
    with pytest.raises(Exception, match="refuses it at compile time"):
        eng.generate("a", {"regex": "fail", "max_new_tokens": 4})
    ok = eng.generate("b", {"regex": "[ab]{3}", "temperature": 1.0, "seed": 0, "max_new_tokens": 8})
    assert re.fullmatch("[ab]{3}", ok["text"])


@pytest.mark.parametrize(("backend", "overlap"), [("xgrammar", False), ("xgrammar", True), ("llguidance", False)])
def test_mixed_batch_many_seeds(tiny_model, backend, overlap):
    pytest.importorskip(backend)
    eng = _engine(tiny_model, f"scheduler.overlap={str(overlap).lower()}", f"grammar.backend={backend}")
    prompts = ["x"] * 12
    params = []
    for seed in range(12):
        if seed % 3 == 0:
            params.append({"max_new_tokens": 12, "temperature": 1.0, "seed": seed})
        elif seed % 3 == 1:
            params.append({"json_schema": SCHEMA, "max_new_tokens": 40, "temperature": 1.0, "seed": seed})
        else:
            params.append({"regex": r"[0-9]{2}-[a-z]{1,5}", "max_new_tokens": 16, "temperature": 1.0, "seed": seed})
    results = eng.generate(prompts, params)
    for p, r in zip(params, results, strict=True):
        reason = r["meta_info"]["finish_reason"]["type"]
        if "json_schema" in p:
            assert reason == "stop"
            _valid(r["text"])
        elif "regex" in p:
            assert reason == "stop" and re.fullmatch(r"[0-9]{2}-[a-z]{1,5}", r["text"])
    assert eng.leak_report()["leaked"] == 0


@pytest.mark.parametrize(("key", "value", "kind"), [
    ("grammar.backend", "nope", "grammar backend"),
    ("server.tool_call_parser", "nope", "tool parser"),
    ("server.reasoning_parser", "nope", "reasoning parser"),
])
def test_unknown_name_fails_at_start_listing_installed(key, value, kind):
    with pytest.raises(ConfigError) as err:
        resolve_config(None, [f"{key}={value}"])
    assert f"{key}: unknown {kind} 'nope'" in str(err.value) and "Installed:" in str(err.value)


def test_none_backend_refuses_constraints(tiny_model):
    eng = _engine(tiny_model, "grammar.backend=none")
    with pytest.raises(Exception, match="grammar.backend is none"):
        eng.generate("a", {"regex": "a+", "max_new_tokens": 4})
    assert resolve_config(None, []).grammar.backend == "xgrammar"  # auto: the real backend when installed


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("kind", "value"), [
    ("json_schema", "{not json"), ("json_schema", '{"type": "nope"}'), ("regex", "a("), ("ebnf", "root ::= ("),
])
def test_backends_refuse_malformed_constraints_naming_the_field(backend, kind, value):
    pytest.importorskip(backend)
    from framework.grammar.base import GrammarSpec
    from framework.plugins import get_registry

    comp = get_registry().get("grammar_backend", backend)
    impl = comp.factory(None, 384, comp.make_options(None))
    with pytest.raises(GrammarError) as err:
        impl.validate(GrammarSpec(kind, value))
    assert err.value.field == kind and err.value.message


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_jump_forward_keeps_outputs_valid_and_saves_steps(tiny_model, backend):
    pytest.importorskip(backend)
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 4},
                                               "is_registered": {"type": "boolean"}},
              "required": ["first_name", "is_registered"], "additionalProperties": False}
    params = [{"json_schema": schema, "temperature": 1.0, "seed": s, "max_new_tokens": 60} for s in range(8)]
    runs = {}
    for jump in (False, True):
        eng = _engine(tiny_model, f"grammar.backend={backend}", f"grammar.jump_forward={str(jump).lower()}")
        steps = 0
        for p in params:
            rid = eng.submit("x", p)
            while not eng._states[rid].finished:
                eng.step()
                steps += 1
            state = eng._states[rid]
            assert state.finish_reason["type"] == "stop", state.text
            jsonschema.validate(json.loads(state.text), schema)
        runs[jump] = (steps, eng.scheduler.grammar.jumped_tokens)
        assert eng.leak_report()["leaked"] == 0 and eng.leak_report()["held_by_requests"] == 0
    (plain_steps, plain_jumped), (jump_steps, jumped) = runs[False], runs[True]
    assert plain_jumped == 0 and jumped > 0
    # every jumped token saves a decode step; each jump costs one prefill step
    assert jump_steps < plain_steps, runs
