"""Parsing untrusted JSON bodies: every way a body can break the parser or what runs after it is
a 400 naming the problem, never a 500.

Python's ``json`` accepts more than JSON and fails on some JSON in ways that are not
``JSONDecodeError``; each is closed here:

- ``NaN``, ``Infinity`` and ``-Infinity`` literals (not JSON) are refused, and so is a number such
  as ``1e999`` that only fits a float as infinity;
- an integer literal longer than Python's int-to-string limit (4,300 digits) raises
  ``ValueError``, and any integer beyond 64 bits is refused wherever it appears, since nothing
  downstream (msgpack, torch, a seed) can hold it;
- nesting deeper than ``max_depth`` is refused: the C scanner raises ``RecursionError`` at about
  1,000 levels, and pydantic and the chat template recurse again over whatever it returns;
- a ``\\ud800`` escape decodes to a lone surrogate, which is not a Unicode scalar value: it cannot
  be encoded as UTF-8 (the response naming it would fail), tokenized, or sent to the scheduler.
"""

from __future__ import annotations

import json
import math
from typing import Any

from framework.server.errors import APIError, bad_request

INT_LIMIT = 1 << 64
"""Integers must satisfy ``-2**64 < x < 2**64``; each field then checks its own narrower range."""


def parse_json_body(body: bytes, max_depth: int) -> Any:
    """The JSON value of ``body`` once it passed every check above (``APIError`` 400 otherwise)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8: {exc}", code="invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except APIError:
        raise
    except ValueError as exc:  # JSONDecodeError, and int() of a literal over 4,300 digits
        raise bad_request(f"the body is not valid JSON: {_short(str(exc))}", code="invalid_json") from None
    check_json_value(value, max_depth)
    return value


def check_json_value(value: Any, max_depth: int) -> None:
    """Depth, string and integer checks over a parsed value, without recursion (a deep value must
    not be able to exhaust the stack of the check meant to stop it)."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            _check_int(item, path)
        elif isinstance(item, list):
            if depth > max_depth:
                raise _too_deep(max_depth, path)
            if _flat_ints(item):
                continue  # token ids: checked at C speed
            stack.extend((v, depth + 1, (*path, i)) for i, v in enumerate(item))
        elif isinstance(item, dict):
            if depth > max_depth:
                raise _too_deep(max_depth, path)
            for key, v in item.items():
                _check_string(key, path, is_key=True)
                stack.append((v, depth + 1, (*path, key)))


def _flat_ints(items: list[Any]) -> bool:
    """True if every item is an int (not a bool) within the 64-bit bound."""
    if not items or not all(type(v) is int for v in items):
        return False
    return -INT_LIMIT < min(items) and max(items) < INT_LIMIT


def _check_string(s: str, path: tuple[Any, ...], is_key: bool = False) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"a key of '{param_name(path)}'" if is_key and path else "a key" if is_key else f"'{param_name(path)}'"
        raise bad_request(
            f"{where} is not valid Unicode: it holds a lone surrogate (U+{ord(s[exc.start]):04X}) at "
            f"character {exc.start}; strings must be sequences of Unicode scalar values",
            param_name(path) or None, "invalid_unicode",
        ) from None


def _check_int(value: int, path: tuple[Any, ...]) -> None:
    if not -INT_LIMIT < value < INT_LIMIT:
        name = param_name(path)
        raise bad_request(f"'{name}' is out of range: integers must be within 64 bits (|x| < 2**64)",
                          name or None, "invalid_value")


def param_name(path: tuple[Any, ...]) -> str:
    """A JSON path as OpenAI's dotted ``param`` (``messages.0.content``)."""
    return ".".join(str(p) for p in path)


def _refuse_constant(name: str) -> Any:
    raise bad_request(f"the body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise bad_request(f"the body is not valid JSON: the number {_short(literal)} is out of range",
                          code="invalid_json")
    return value


def _too_deep(max_depth: int, path: tuple[Any, ...] = ()) -> APIError:
    where = f" at '{param_name(path)}'" if path else ""
    return bad_request(f"the body is nested too deeply{where}: at most {max_depth} levels of arrays and objects",
                       param_name(path) or None, "json_too_deep")


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
