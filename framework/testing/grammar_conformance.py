"""A conformance kit for grammar backends (``register_grammar_backends``).

A backend author runs it from their own test suite::

    from framework.testing.grammar_conformance import assert_conformant

    def test_my_backend_conforms():
        assert_conformant("my_backend")        # or assert_conformant(MyBackend, MyOptions())

The backend is built over the kit's locally trained byte-level BPE tokenizer
(:func:`framework.testing.tiny_models.build_tokenizer`) with a model vocabulary larger than the
tokenizer's, and driven the way the scheduler drives it: fill the bitmask, mask random logits
with :func:`framework.sampling.grammar_mask.apply_token_bitmask`, sample, ``accept_token``, until
the matcher terminates. Outputs are judged by references nobody here wrote (``jsonschema``,
``re.fullmatch``). The checks:

- ``validate``: well-formed constraints pass ``validate``; malformed ones (not JSON, a bad regex,
  a bad EBNF grammar) raise ``GrammarError`` naming their field;
- ``json_schema``, ``regex``, ``ebnf``: over many seeds, every output that terminated is valid
  (and most terminate: the grammars are small and bounded);
- ``structural_tag``: triggered sections are valid against their schema (skipped when the backend
  refuses structural tags with a ``GrammarError``);
- ``vocab_padding``: ids past the tokenizer's vocabulary are never allowed;
- ``refuses_disallowed``: ``accept_token`` of a token the bitmask excludes returns False and
  leaves the matcher where it was;
- ``shared_compiled``: two matchers over one compiled grammar advance independently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from framework.grammar.base import GrammarError, GrammarSpec
from framework.sampling.grammar_mask import allowed_tokens, apply_token_bitmask, full_bitmask
from framework.testing.conformance_common import CheckFailed, ConformanceReport, resolve_component, run_check

__all__ = ["CHECKS", "assert_conformant", "run_conformance"]

CHECKS = ("validate", "json_schema", "regex", "ebnf", "structural_tag", "vocab_padding", "refuses_disallowed",
          "shared_compiled")
EXTRA_VOCAB = 16
"""The kit's model vocabulary exceeds the tokenizer's by this many ids (as real models' do)."""
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
REGEX = r"(ab|cd)[0-9]{1,3}-[a-z]{2}"
EBNF = 'root ::= ("yes" | "no") " " [0-9] "!"'
EBNF_AS_REGEX = r"(yes|no) [0-9]!"


class _Kit:
    def __init__(self, factory: Any, options: Any, seeds: int) -> None:
        from framework.testing.tiny_models import build_tokenizer

        self.tokenizer = build_tokenizer()
        self.vocab = len(self.tokenizer) + EXTRA_VOCAB
        self.stop = [self.tokenizer.eos_token_id]
        self.backend = factory(self.tokenizer, self.vocab, options)
        self.seeds = seeds

    def matcher(self, kind: str, value: str) -> Any:
        spec = GrammarSpec(kind, value)
        self.backend.validate(spec)
        return self.backend.matcher(self.backend.compile(spec), self.stop)

    def mask(self, matcher: Any) -> torch.Tensor:
        bitmask = full_bitmask(1, self.vocab)
        matcher.fill_bitmask(bitmask, 0)
        return bitmask

    def generate(self, matcher: Any, seed: int, max_tokens: int = 64, prefix: str = "") -> tuple[str, bool]:
        """(text, terminated) of one sampled run through ``matcher``, after forcing ``prefix``."""
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for token in self.tokenizer.encode(prefix, add_special_tokens=False):
            if not matcher.accept_token(token):
                raise CheckFailed(f"the matcher refused {self._text(out + [token])!r}, which its grammar allows")
            out.append(token)
        for _ in range(max_tokens):
            scores = apply_token_bitmask(torch.randn(1, self.vocab, generator=gen) * 3, self.mask(matcher))
            if torch.isinf(scores).all():
                raise CheckFailed(f"seed {seed}: the bitmask allows no token after {self._text(out)!r}")
            token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
            if not matcher.accept_token(token):
                raise CheckFailed(f"seed {seed}: accept_token({token}) refused a token its own bitmask allowed")
            out.append(token)
            if matcher.is_terminated():
                return self._text(out), True
        return self._text(out), False

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop])

    def outputs_valid(self, kind: str, value: str, judge: Callable[[str], None]) -> str:
        finished = 0
        for seed in range(self.seeds):
            text, done = self.generate(self.matcher(kind, value), seed)
            if done:
                finished += 1
                judge(text)
        if finished < self.seeds * 3 // 4:
            raise CheckFailed(f"only {finished}/{self.seeds} runs terminated within 64 tokens")
        return f"{finished}/{self.seeds} sampled outputs terminated, all valid"


def _fullmatch(pattern: str) -> Callable[[str], None]:
    def judge(text: str) -> None:
        if not re.fullmatch(pattern, text):
            raise CheckFailed(f"{text!r} does not fullmatch {pattern!r}")
    return judge


def _json_valid(schema: dict[str, Any]) -> Callable[[str], None]:
    import jsonschema

    def judge(text: str) -> None:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise CheckFailed(f"{text!r} is not valid against the schema: {exc}") from None
    return judge


def _check_validate(kit: _Kit) -> str:
    for kind, value in (("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("ebnf", EBNF)):
        kit.backend.validate(GrammarSpec(kind, value))
    bad = [("json_schema", "{not json"), ("regex", "a("), ("ebnf", "root ::= (")]
    for kind, value in bad:
        try:
            kit.backend.validate(GrammarSpec(kind, value))
        except GrammarError as exc:
            if exc.field != kind:
                raise CheckFailed(f"{kind} {value!r}: the GrammarError names {exc.field!r}, not {kind!r}") from None
            continue
        raise CheckFailed(f"validate accepted the malformed {kind} {value!r}")
    return f"{len(bad)} malformed constraints refused naming their field"


def _check_structural_tag(kit: _Kit) -> str:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    tag = json.dumps({"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]})
    try:
        kit.backend.validate(GrammarSpec("structural_tag", tag))
    except GrammarError:
        return "SKIP: the backend refuses structural tags"
    judge = _json_valid(schema)
    sections = 0
    for seed in range(kit.seeds):
        # The free text before the trigger is forced; from the trigger on, the schema rules.
        text, _ = kit.generate(kit.matcher("structural_tag", tag), seed, max_tokens=48, prefix="call <f>")
        for section in re.findall(r"<f>(.*?)</f>", text, re.S):
            judge(section)
            sections += 1
    if sections < kit.seeds // 2:
        raise CheckFailed(f"only {sections}/{kit.seeds} triggered sections were closed within 48 tokens")
    return f"{sections} triggered sections, all valid"


def _check_vocab_padding(kit: _Kit) -> str:
    matcher = kit.matcher("regex", REGEX)
    for step in range(4):
        allowed = allowed_tokens(kit.mask(matcher), kit.vocab)[0]
        if allowed[len(kit.tokenizer):].any():
            raise CheckFailed(f"step {step}: ids past the tokenizer's vocabulary are allowed")
        token = int(allowed.nonzero()[0])
        matcher.accept_token(token)
    return f"ids {len(kit.tokenizer)}..{kit.vocab - 1} never allowed"


def _check_refuses_disallowed(kit: _Kit) -> str:
    matcher = kit.matcher("regex", REGEX)
    allowed = allowed_tokens(kit.mask(matcher), kit.vocab)[0]
    refused = int((~allowed[:len(kit.tokenizer)]).nonzero()[0])
    if matcher.accept_token(refused):
        raise CheckFailed(f"accept_token({refused}) accepted a token the bitmask excludes")
    if not torch.equal(allowed_tokens(kit.mask(matcher), kit.vocab)[0], allowed):
        raise CheckFailed("a refused token changed the matcher's state")
    text, done = kit.generate(matcher, 0)
    if done:
        _fullmatch(REGEX)(text)
    return "refused and unchanged"


def _check_shared_compiled(kit: _Kit) -> str:
    spec = GrammarSpec("regex", REGEX)
    compiled = kit.backend.compile(spec)
    first, second = kit.backend.matcher(compiled, kit.stop), kit.backend.matcher(compiled, kit.stop)
    text_a, _ = kit.generate(first, 1)
    before = allowed_tokens(kit.mask(second), kit.vocab)
    fresh = allowed_tokens(kit.mask(kit.backend.matcher(compiled, kit.stop)), kit.vocab)
    if not torch.equal(before, fresh):
        raise CheckFailed(f"advancing one matcher (to {text_a!r}) changed another over the same compiled grammar")
    text_b, done = kit.generate(second, 2)
    if done:
        _fullmatch(REGEX)(text_b)
    return "independent"


def run_conformance(factory: Any, options: Any = None, checks: Iterable[str] = CHECKS,
                    seeds: int = 12) -> ConformanceReport:
    """Check a grammar backend (a registered name, or ``factory(tokenizer, vocab_size, options)``)."""
    factory, options, name = resolve_component("grammar_backend", factory, options, "grammar.backend")
    wanted = list(checks)
    unknown = set(wanted) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown grammar checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    kit = _Kit(factory, options, seeds)
    fns: dict[str, Callable[[], str]] = {
        "validate": lambda: _check_validate(kit),
        "json_schema": lambda: kit.outputs_valid("json_schema", json.dumps(SCHEMA), _json_valid(SCHEMA)),
        "regex": lambda: kit.outputs_valid("regex", REGEX, _fullmatch(REGEX)),
        "ebnf": lambda: kit.outputs_valid("ebnf", EBNF, _fullmatch(EBNF_AS_REGEX)),
        "structural_tag": lambda: _check_structural_tag(kit),
        "vocab_padding": lambda: _check_vocab_padding(kit),
        "refuses_disallowed": lambda: _check_refuses_disallowed(kit),
        "shared_compiled": lambda: _check_shared_compiled(kit),
    }
    report = ConformanceReport("grammar backend", name)
    for check in wanted:
        result = run_check(check, fns[check])
        if result.passed and result.detail.startswith("SKIP: "):
            result.skipped, result.detail = True, result.detail[len("SKIP: "):]
        report.results.append(result)
    return report


def assert_conformant(factory: Any, options: Any = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` listing every failing check."""
    return run_conformance(factory, options, **kwargs).raise_for_failures()
