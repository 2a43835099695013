"""The ``xgrammar`` grammar backend (the library SGLang uses by default): JSON schema, regex,
EBNF and structural tags compiled against the tokenizer's vocabulary, with token bitmasks in the
core's int32 format and jump-forward strings."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from framework.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec
from framework.hookspecs import Capabilities, hookimpl

_OPEN_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass
class XGrammarOptions:
    """Options of the xgrammar backend (``grammar.options``)."""

    any_whitespace: bool = False
    """JSON: allow any whitespace between tokens. Off (xgrammar's compact separators ``", "`` and
    ``": "``), a model cannot spend its token budget on whitespace inside the JSON."""
    strict_mode: bool = True
    """JSON schema: properties and items not in the schema are refused unless the schema allows them."""
    max_threads: int = 1
    """xgrammar's own threads per compile (the scheduler already compiles on worker threads)."""


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("xgrammar") is None:
        return "the xgrammar package is not installed (pip install xgrammar)"
    return None


def _message(exc: Exception) -> str:
    """xgrammar's C++ error text without its log prefix (time, source file and line)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return _LOG_PREFIX.sub("", lines[0] if lines else type(exc).__name__)


class XGrammarMatcher(GrammarMatcher):
    """One request's xgrammar ``GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def jump_forward_tokens(self) -> list[int]:
        return [] if self._m.is_terminated() else list(self._m.find_jump_forward_tokens())


class XGrammarBackend(GrammarBackend):
    """Grammars through ``xgrammar.Grammar`` (validation, no vocabulary needed) and a
    ``GrammarCompiler`` over the tokenizer, built on the first compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, options: XGrammarOptions | None = None) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.options = options or XGrammarOptions()
        self._compiler: Any = None
        self._lock = threading.Lock()  # compile() runs on several worker threads

    def _grammar(self, spec: GrammarSpec) -> Any:
        xgr, opts = self.xgr, self.options
        try:
            if spec.kind == "json_schema":
                spec.json_value()  # our own "not valid JSON" message first
                grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=opts.any_whitespace,
                                                       strict_mode=opts.strict_mode)
                return self._without_raw_control_chars(grammar)
            if spec.kind == "regex":
                return xgr.Grammar.from_regex(spec.value)
            if spec.kind == "ebnf":
                return xgr.Grammar.from_ebnf(spec.value)
            if spec.kind == "structural_tag":
                return self._structural_tag(spec.json_value())
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError, its own errors
            raise GrammarError(spec.kind, _message(exc)) from None
        raise GrammarError(spec.kind, f"unknown constraint kind {spec.kind!r}")

    def _without_raw_control_chars(self, grammar: Any) -> Any:
        # xgrammar (0.2.9) writes strings with minLength/maxLength as ``[^"\\\r\n]{m,n}``, which
        # lets raw control characters (U+0000-U+001F) into a JSON string: invalid JSON that a test
        # with jsonschema caught. Close the class as its unbounded strings do.
        text = str(grammar)
        if _OPEN_STRING_CHARS not in text:
            return grammar
        return self.xgr.Grammar.from_ebnf(text.replace(_OPEN_STRING_CHARS, _JSON_STRING_CHARS))

    def _structural_tag(self, tag: Any) -> Any:
        xgr = self.xgr
        if isinstance(tag, dict) and "structures" in tag:
            # SGLang's format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
            try:
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                         for s in tag["structures"]]
            except (KeyError, TypeError):
                raise GrammarError("structural_tag", "each of structures needs begin, schema and end") from None
            return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
        return xgr.Grammar.from_structural_tag(json.dumps(tag))

    def validate(self, spec: GrammarSpec) -> None:
        self._grammar(spec)

    def compile(self, spec: GrammarSpec) -> Any:
        grammar = self._grammar(spec)
        with self._lock:
            if self._compiler is None:
                info = self.xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = self.xgr.GrammarCompiler(info, max_threads=self.options.max_threads)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(spec.kind, _message(exc)) from None

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None))


@hookimpl
def register_grammar_backends(register: Any) -> None:
    register("xgrammar", XGrammarBackend, config=XGrammarOptions,
             capabilities=Capabilities(auto_priority={"cpu": 20, "cuda": 20}, unavailable_reason=unavailable_reason))
