"""Named logit processors: SGLang's ``custom_logit_processor``, without running request code.

SGLang lets a client send a processor as dill-serialized Python that the server unpickles and
runs. plugserve never does that: a processor is a plugin component (``register_logit_processors``)
that the operator installed, and a request only names it (``custom_logit_processor: "name"``)
and passes it JSON parameters (``custom_params``). Requests may use them only when the server
says so (``server.enable_custom_logit_processor``).

A processor is called once per sampling step with the rows of the batch that use it::

    processor(logits, params, output_ids) -> logits

``logits`` is a ``[rows, vocab]`` float32 tensor (after ``logit_bias``, before penalties and
temperature), ``params[i]`` the ``custom_params`` object of row ``i`` (or None) and
``output_ids[i]`` the tokens row ``i`` generated so far. It returns a tensor of the same shape
(it may modify ``logits`` in place). The ``config`` dataclass given at registration is the schema
of ``custom_params``: a request's object must construct it (unknown keys and a ``ValueError``
raised by the dataclass are a 400), so bad parameters fail before the request is queued.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from framework.registry import Registry

KIND = "logit_processor"
"""The registry kind of logit processors."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,127}")
"""What a processor name can look like; anything else is not a name (e.g. SGLang's serialized form)."""


class LogitProcessor(Protocol):
    """What a ``register_logit_processors`` factory returns (built once per process)."""

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any] | None],
                 output_ids: list[list[int]]) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------------
def check_custom_logit_processor(name: str | None, params: dict[str, Any] | None, enabled: bool,
                                 registry: Registry) -> None:
    """``ValueError`` whose message starts with the offending field, for a request that may not run.

    Refused: ``custom_params`` without a processor; any processor when ``enabled`` is false;
    SGLang's serialized-code form; a name nobody registered; parameters that do not construct the
    processor's ``config`` dataclass.
    """
    if name is None:
        if params is not None:
            raise ValueError("custom_params is read only by a custom_logit_processor, and the request names none")
        return
    if not enabled:
        raise ValueError("custom_logit_processor is disabled on this server: start it with "
                         "server.enable_custom_logit_processor=true to let requests name a registered processor")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(_serialized_refusal(name))
    if not registry.has(KIND, name):
        raise ValueError(f"custom_logit_processor {name!r} is not a registered logit processor; "
                         f"registered: {', '.join(registry.names(KIND)) or '(none)'}")
    options_cls = registry.get(KIND, name).options_cls
    if options_cls is not None:
        try:
            options_cls(**(params or {}))
        except (TypeError, ValueError) as exc:
            keys = ", ".join(f.name for f in dataclasses.fields(options_cls))
            raise ValueError(f"custom_params for {name!r} are invalid: {exc} (its parameters: {keys})") from None


def _serialized_refusal(value: object) -> str:
    """The 400 message for a value that is not a processor name (most likely SGLang's dill form)."""
    looks_sglang = False
    if isinstance(value, str):
        try:
            looks_sglang = isinstance(json.loads(value), dict)
        except ValueError:
            looks_sglang = len(value) > 128
    what = "SGLang's serialized processor (dill-pickled Python code)" if looks_sglang else "not a processor name"
    return (f"custom_logit_processor must be the name of a registered logit processor; this value is {what}. "
            "plugserve never runs code sent in a request: install the processor as a plugin "
            "(register_logit_processors) and send its name, with its parameters in custom_params")


# --------------------------------------------------------------------------------------------------
_instances: dict[str, tuple[Any, LogitProcessor]] = {}
"""Name -> (the factory that built it, the instance): rebuilt when another plugin's factory now
holds the name (plugins registered or removed since)."""


def resolve(name: str, registry: Registry) -> LogitProcessor:
    """The process's instance of processor ``name`` (built on first use, once per factory)."""
    factory = registry.get(KIND, name, key="custom_logit_processor").factory
    cached = _instances.get(name)
    if cached is None or cached[0] is not factory:
        cached = _instances[name] = (factory, factory())
    return cached[1]


@dataclass(eq=False)  # tensors inside: identity, not elementwise ==
class ProcessorGroup:
    """The rows of one batch that use one processor."""

    name: str
    rows: list[int]
    row_index: torch.Tensor
    """[rows] int64 on the logits' device."""
    params: list[dict[str, Any] | None]
    output_ids: list[list[int]]


def build_groups(names: list[str | None], params: list[dict[str, Any] | None], output_ids: list[list[int]],
                 device: torch.device) -> list[ProcessorGroup]:
    """One group per processor name used in the batch (rows in batch order); empty when none is."""
    by_name: dict[str, list[int]] = {}
    for row, name in enumerate(names):
        if name is not None:
            by_name.setdefault(name, []).append(row)
    return [
        ProcessorGroup(name, rows, torch.tensor(rows, dtype=torch.int64, device=device),
                       [params[r] for r in rows], [output_ids[r] for r in rows])
        for name, rows in by_name.items()
    ]


def apply_logit_processors(logits: torch.Tensor, groups: list[ProcessorGroup], registry: Registry) -> torch.Tensor:
    """``logits`` unchanged when no row uses a processor, else a copy with each group's rows replaced
    by what its processor returned (``logits`` itself is left unmodified)."""
    if not groups:
        return logits
    out = logits.clone()
    for group in groups:
        rows = out.index_select(0, group.row_index)
        result = resolve(group.name, registry)(rows, group.params, group.output_ids)
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(rows.shape):
            shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise RuntimeError(f"logit processor {group.name!r} returned {shape}, expected a tensor of "
                               f"shape {tuple(rows.shape)}")
        out.index_copy_(0, group.row_index, result.to(out.dtype))
    return out
