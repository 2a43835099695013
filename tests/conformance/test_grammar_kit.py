"""The grammar-backend conformance kit on every built-in real backend, and on deliberately broken
backends it must fail (including xgrammar without plugserve's fix for its raw control characters
in length-bounded JSON strings)."""

from __future__ import annotations

import pytest

from framework.testing.grammar_conformance import assert_conformant, run_conformance

pytest.importorskip("jsonschema")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_builtin_backends_conform(backend):
    pytest.importorskip(backend)
    report = assert_conformant(backend, seeds=16)
    assert report.result("json_schema").passed and report.result("regex").passed


def _xgrammar():
    pytest.importorskip("xgrammar")
    from plugins.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend


def test_a_backend_that_ignores_the_grammar_fails():
    base = _xgrammar()

    class Ignoring(base):  # type: ignore[misc, valid-type]
        def matcher(self, compiled, stop_token_ids):
            inner = super().matcher(compiled, stop_token_ids)

            class Loose:
                def fill_bitmask(self, bitmask, row):
                    pass  # leaves every token allowed

                def accept_token(self, token_id):
                    inner.accept_token(token_id)
                    return True

                def is_terminated(self):
                    return inner.is_terminated()

            return Loose()

    report = run_conformance(Ignoring)
    failed = {r.name for r in report.failures}
    assert {"json_schema", "regex", "ebnf", "vocab_padding", "refuses_disallowed"} <= failed, str(report)


def test_a_backend_that_validates_nothing_fails():
    base = _xgrammar()

    class Trusting(base):  # type: ignore[misc, valid-type]
        def validate(self, spec):
            return None

    report = run_conformance(Trusting, checks=["validate", "regex"])
    assert [r.name for r in report.failures] == ["validate"], str(report)


def test_xgrammar_without_the_control_character_fix_fails():
    base = _xgrammar()

    class Raw(base):  # type: ignore[misc, valid-type]
        def _without_raw_control_chars(self, grammar):
            return grammar

    report = run_conformance(Raw, checks=["json_schema"], seeds=24)
    assert not report.passed and "not valid" in report.result("json_schema").detail, str(report)
