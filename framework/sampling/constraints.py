"""The constrained-decoding fields of :class:`~framework.sampling.params.SamplingParams`.

SGLang's names: ``json_schema`` (JSON text), ``regex``, ``ebnf`` and ``structural_tag`` (JSON
text); at most one per request. Here they are only normalised and type-checked: whether a schema
or regex is valid is the grammar backend's call (``framework.grammar``), made in the HTTP process
before the request is queued.
"""

from __future__ import annotations

import json
from typing import Any

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_JSON_FIELDS = ("json_schema", "structural_tag")


def normalize_constraint(name: str, value: Any) -> Any:
    """A schema or structural tag given as an object (a convenience SGLang lacks) becomes JSON text."""
    if name in _JSON_FIELDS and isinstance(value, dict | list):
        return json.dumps(value)
    return value


def check_constraints(params: Any) -> None:
    """ValueError naming the field: each set constraint is a non-empty string, and only one is set."""
    given = [name for name in CONSTRAINT_FIELDS if getattr(params, name) is not None]
    for name in given:
        value = getattr(params, name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if len(given) > 1:
        raise ValueError(f"{given[1]} cannot be combined with {given[0]}: give one constraint per request")
