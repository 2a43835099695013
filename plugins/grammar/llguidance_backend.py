"""The ``llguidance`` grammar backend (optional: ``pip install 'plugserve[llguidance]'``): JSON
schema, regex and EBNF (GBNF, converted to llguidance's Lark dialect) through Guidance's Rust
matcher, with bitmasks in the same int32 layout as xgrammar's. Structural tags are refused."""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import Any

import torch

from framework.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec
from framework.hookspecs import Capabilities, hookimpl


@dataclass
class LLGuidanceOptions:
    """Options of the llguidance backend (``grammar.options``)."""

    whitespace_flexible: bool = False
    """JSON: allow any whitespace between tokens (llguidance's default is flexible; off, a model
    cannot spend its token budget on whitespace inside the JSON)."""


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("llguidance") is None:
        return "the llguidance package is not installed (pip install llguidance)"
    return None


class LLGuidanceMatcher(GrammarMatcher):
    """One request's ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any, fill: Any) -> None:
        self._m = matcher
        self._fill = fill

    def accept_token(self, token_id: int) -> bool:
        # consume_token of a refused token puts the matcher in an error state for good; the
        # interface wants a refusal that leaves it usable, so ask first (the conformance kit's
        # refuses_disallowed check caught this).
        if self._m.validate_tokens([int(token_id)]) < 1:
            return False
        return bool(self._m.consume_token(int(token_id))) and not self._m.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        # is_stopped() is also true in an error state; accept_token reports errors itself.
        return bool(self._m.is_stopped()) and not self._m.is_error()

    def jump_forward_tokens(self) -> list[int]:
        return [] if self._m.is_stopped() else list(self._m.compute_ff_tokens())


class LLGuidanceBackend(GrammarBackend):
    """Grammars as llguidance grammar strings; each matcher builds its parser from one."""

    def __init__(self, tokenizer: Any, vocab_size: int, options: LLGuidanceOptions | None = None) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.options = options or LLGuidanceOptions()
        self._tokenizers: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()

    def _grammar(self, spec: GrammarSpec) -> str:
        matcher = self.llg.LLMatcher
        if spec.kind == "json_schema":
            spec.json_value()
            grammar = matcher.grammar_from_json_schema(
                spec.value, overrides={"whitespace_flexible": self.options.whitespace_flexible})
        elif spec.kind == "regex":
            grammar = matcher.grammar_from_regex(spec.value)
        elif spec.kind == "ebnf":
            from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

            try:
                grammar = matcher.grammar_from_lark(any_to_lark(spec.value))
            except (GbnfToLarkError, ValueError) as exc:
                raise GrammarError("ebnf", str(exc).strip().splitlines()[0]) from None
        else:
            raise GrammarError(spec.kind, "not supported by the llguidance grammar backend (use xgrammar)")
        error = matcher.validate_grammar(grammar)
        if error:
            raise GrammarError(spec.kind, error.strip().splitlines()[0])
        return grammar

    def validate(self, spec: GrammarSpec) -> None:
        try:
            self._grammar(spec)
        except GrammarError:
            raise
        except Exception as exc:  # llguidance raises ValueError and friends on malformed input
            raise GrammarError(spec.kind, str(exc).strip().splitlines()[0] if str(exc).strip() else
                               type(exc).__name__) from None

    def compile(self, spec: GrammarSpec) -> Any:
        self.validate(spec)
        return self._grammar(spec)  # llguidance builds the parser lazily, per matcher

    def _tokenizer(self, stop_token_ids: list[int]) -> Any:
        key = tuple(stop_token_ids)
        with self._lock:
            if key not in self._tokenizers:
                import llguidance.hf

                eos = list(stop_token_ids) or None
                self._tokenizers[key] = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                     eos_token=eos)
            return self._tokenizers[key]

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        m = self.llg.LLMatcher(self._tokenizer(stop_token_ids), compiled)
        if m.is_error():
            raise GrammarError("grammar", m.get_error())
        return LLGuidanceMatcher(m, self.llg.torch.fill_next_token_bitmask)


@hookimpl
def register_grammar_backends(register: Any) -> None:
    register("llguidance", LLGuidanceBackend, config=LLGuidanceOptions,
             capabilities=Capabilities(auto_priority={"cpu": 10, "cuda": 10}, unavailable_reason=unavailable_reason))
