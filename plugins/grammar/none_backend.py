"""The ``none`` grammar backend: constrained decoding switched off. Every constrained request is
refused with a 400 that names its field, so nothing is ever silently left unconstrained."""

from __future__ import annotations

from typing import Any

from framework.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec
from framework.hookspecs import Capabilities, hookimpl


class NoGrammarBackend(GrammarBackend):
    """Refuses every constraint."""

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, options: Any = None) -> None:
        pass

    def validate(self, spec: GrammarSpec) -> None:
        raise GrammarError(spec.kind, "constrained decoding is off on this server (grammar.backend is none)")

    def compile(self, spec: GrammarSpec) -> Any:
        self.validate(spec)

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        raise GrammarError("grammar", "constrained decoding is off on this server (grammar.backend is none)")


@hookimpl
def register_grammar_backends(register: Any) -> None:
    # Priority 0: what ``auto`` falls back to when no real backend is installed.
    register("none", NoGrammarBackend, capabilities=Capabilities(auto_priority={"cpu": 0, "cuda": 0}))
