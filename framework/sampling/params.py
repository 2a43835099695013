"""Per-request sampling parameters (the OpenAI / vLLM / SGLang set).

A :class:`SamplingParams` is created in the HTTP process, validated there, and crosses to the
scheduler process as msgpack, so :meth:`SamplingParams.to_dict` only produces plain JSON types
and :meth:`SamplingParams.from_dict` refuses keys it does not know (a typo in a client field must
fail loudly instead of being silently ignored).

Logprob options are deliberately not here: they are request-level (they change what is returned,
not which token is chosen).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

from framework.sampling.constraints import CONSTRAINT_FIELDS, check_constraints, normalize_constraint
from framework.sampling.logit_bias import check_logit_bias, normalize_logit_bias

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are treated as greedy. Dividing logits by a near-zero temperature
overflows float32 to inf and softmax then yields NaN; vLLM uses the same cut-off."""


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""Integer parameters must fit a signed 64-bit integer (vLLM's range for ``seed``): that is what
msgpack, torch and the seed mixer can hold."""


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a seeded request with ``n`` choices: ``seed + index``,
    wrapped around within int64, so choice ``i`` is reproducible on its own with that seed and
    a seed near the top of the range still gives ``n`` distinct valid seeds."""
    return (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


def _is_int(value: object) -> bool:
    # bool is an int subclass, but ``"n": true`` from a client is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not (isinstance(value, float) and math.isnan(value))


@dataclass
class SamplingParams:
    """How one request chooses its next tokens and when it stops.

    ``temperature == 0`` (or below :data:`GREEDY_TEMPERATURE_EPS`) and ``top_k == 1`` both mean
    greedy decoding. ``top_k`` of ``-1`` or ``0`` disables top-k (``0`` is normalised to ``-1``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    """EOS and ``stop_token_ids`` are masked out until this many tokens were generated."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """HF/CTRL semantics over prompt and output tokens: positive logits divided, negative multiplied."""
    frequency_penalty: float = 0.0
    """OpenAI semantics: subtract ``penalty * count`` for each token already in the output."""
    presence_penalty: float = 0.0
    """OpenAI semantics: subtract ``penalty`` once for each token already in the output."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the returned text ends right before the first one (it is not included)."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    """With a seed, the request's tokens do not depend on what else shares its batch."""
    logit_bias: dict[int, float] | None = None
    """OpenAI semantics: token id -> bias in [-100, 100] added to the raw logits before every other
    step (``framework.sampling.logit_bias``). Clients' string keys (``{"50256": -100}``) become ints."""
    json_schema: str | None = None
    """Constrained decoding (``framework.sampling.constraints``): the output is JSON valid against
    this schema (JSON text). At most one of ``json_schema``, ``regex``, ``ebnf``, ``structural_tag``."""
    regex: str | None = None
    """Constrained decoding: the output fully matches this regular expression."""
    ebnf: str | None = None
    """Constrained decoding: the output is a sentence of this EBNF grammar (GBNF syntax, ``root`` rule)."""
    structural_tag: str | None = None
    """Constrained decoding: SGLang's structural tag (JSON text): free text, with each trigger's
    section constrained by its schema."""
    custom_logit_processor: str | None = None
    """SGLang's field, as a name: the registered logit processor (``register_logit_processors``)
    applied to this request's logits (``framework.sampling.logit_processor``; never code)."""
    custom_params: dict[str, Any] | None = None
    """The JSON object passed to that processor for this request (SGLang's ``custom_params``)."""

    def __post_init__(self) -> None:
        # Clients commonly send a single stop string, and top_k=0 as "off" (vLLM accepts both).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        for name in CONSTRAINT_FIELDS:
            setattr(self, name, normalize_constraint(name, getattr(self, name)))

    # ----------------------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (no randomness is consumed)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the field, the bad value and the allowed range.

        ``vocab_size`` enables the range check of ``stop_token_ids``.
        """
        self._check_types()
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "seed"):
            value = getattr(self, name)
            _require(value is None or INT64_MIN <= value <= INT64_MAX, name, value, "within int64 [-2**63, 2**63 - 1]")
        _require(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        _require(self.min_new_tokens >= 0, "min_new_tokens", self.min_new_tokens, ">= 0")
        _require(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            self.min_new_tokens,
            f"<= max_new_tokens ({self.max_new_tokens})",
        )
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(math.isfinite(self.temperature), "temperature", self.temperature, "finite")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 or 0 (off) or >= 1")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        rep = self.repetition_penalty
        _require(rep > 0, "repetition_penalty", rep, "> 0")
        _require(math.isfinite(rep), "repetition_penalty", rep, "finite")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, value, "in [-2, 2]")
        _require(self.n >= 1, "n", self.n, ">= 1")
        for s in self.stop:
            _require(len(s) > 0, "stop", self.stop, "non-empty strings")
        for tid in self.stop_token_ids:
            upper = f"{vocab_size})" if vocab_size is not None else "inf)"
            ok = tid >= 0 and (vocab_size is None or tid < vocab_size)
            _require(ok, "stop_token_ids", tid, f"in [0, {upper}")
        check_logit_bias(self.logit_bias, vocab_size)
        check_constraints(self)

    def _check_types(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        numbers = ("temperature", "top_p", "min_p", "repetition_penalty")
        for name in (*numbers, "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if _is_int(value) and not -1e300 < value < 1e300:  # math.isfinite of a huge int overflows
                raise ValueError(f"{name} must be a finite number, got an integer of {len(str(abs(value)))} digits")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")
        if self.custom_logit_processor is not None and not isinstance(self.custom_logit_processor, str):
            raise ValueError(f"custom_logit_processor must be a processor name (a string), "
                             f"got {type(self.custom_logit_processor).__name__}")
        if self.custom_params is not None and not (
                isinstance(self.custom_params, dict) and all(isinstance(k, str) for k in self.custom_params)):
            raise ValueError(f"custom_params must be a JSON object, got {type(self.custom_params).__name__}")

    # ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (ints, floats, bools, strings, lists, None): msgpack-safe; nothing
        mutable is shared with this object.

        Field by field rather than :func:`dataclasses.asdict`, which deep-copies every value and
        took ~0.2 ms per call in the HTTP process (twice per request, on its first token's path);
        only ``custom_params`` can hold nested containers."""
        out = {name: getattr(self, name) for name in _FIELD_NAMES}
        if self.custom_params is not None:
            out["custom_params"] = copy.deepcopy(self.custom_params)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        # JSON object keys are strings; __post_init__ turns them back into token ids.
        out["logit_bias"] = {str(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; missing keys take defaults, unknown keys are an error."""
        unknown = sorted(set(data).difference(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known parameters are {sorted(_FIELD_NAMES)}")
        return cls(**data)


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
