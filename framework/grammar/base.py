"""The grammar-backend plugin kind (``register_grammar_backends``): what a backend implements.

A request may carry one constraint (:class:`GrammarSpec`): a JSON schema, a regular expression,
an EBNF grammar or a structural tag. The backend turns it into a compiled grammar (expensive,
tokenizer-dependent, cached and shared across requests) and each request gets its own
:class:`GrammarMatcher` over it, which the scheduler advances one sampled token at a time and asks
for the next token bitmask.

Bitmask format (the core's contract with every backend): an int32 tensor of shape
``[batch, ceil(vocab_size / 32)]``; bit ``j`` of word ``w`` set means token ``32 * w + j`` is
allowed. It is xgrammar's and llguidance's format, and :mod:`framework.sampling.grammar_mask`
applies it to the logits.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""The sampling-parameter fields that carry a constraint (SGLang's names); at most one per request."""


class GrammarError(ValueError):
    """A constraint the backend cannot use; ``field`` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: ``kind`` is one of :data:`GRAMMAR_FIELDS`, ``value`` its text (a JSON
    schema or structural tag as JSON text). Hashable: the compile cache is keyed by it."""

    kind: str
    value: str

    def json_value(self) -> Any:
        """The value parsed as JSON (``json_schema`` and ``structural_tag``); GrammarError if it is not."""
        try:
            return json.loads(self.value)
        except ValueError as exc:
            raise GrammarError(self.kind, f"not valid JSON: {exc}") from None


def spec_of(params: Any) -> GrammarSpec | None:
    """The constraint of a :class:`~framework.sampling.params.SamplingParams`, if it has one."""
    for kind in GRAMMAR_FIELDS:
        value = getattr(params, kind, None)
        if value is not None:
            return GrammarSpec(kind, value)
    return None


class GrammarMatcher(ABC):
    """The state of one request's grammar: which tokens may come next."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (state unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 CPU bitmask (module docstring)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request must stop."""

    def jump_forward_tokens(self) -> list[int]:
        """Tokens every continuation must start with (jump-forward decoding), not yet accepted;
        [] when none are forced or the backend cannot tell. Never stop or special tokens."""
        return []


class GrammarBackend(ABC):
    """A grammar backend. Factory: ``factory(tokenizer, vocab_size, options) -> GrammarBackend``;
    ``vocab_size`` is the model's (it may exceed the tokenizer's: those ids are never allowed).

    :meth:`validate` runs in the HTTP process on every constrained request, so it must be cheap
    and must not need the tokenizer's vocabulary; :meth:`compile` runs on a worker thread of the
    scheduler process and may be slow; both raise :class:`GrammarError` naming the field.
    """

    @abstractmethod
    def validate(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if ``spec`` is malformed (bad JSON, bad schema, bad regex, ...)."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar: immutable, shared by every request with the same spec."""

    @abstractmethod
    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher over ``compiled``; ``stop_token_ids`` end the output once it is complete."""
