"""What both PD sides share: building the configured transfer backend, and the first-token
metadata that travels with the KV pages (msgpack, never pickle)."""

from __future__ import annotations

from typing import Any

import msgspec

from framework.disaggregation.base import KVLayout, TransferBackend


class FirstToken(msgspec.Struct, omit_defaults=True):
    """The prefill server's sample at the end of the prompt, and the prompt's logprobs."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None


def encode_first_token(meta: FirstToken) -> bytes:
    return msgspec.msgpack.encode(meta)


def decode_first_token(data: bytes) -> FirstToken:
    return msgspec.msgpack.decode(data, type=FirstToken)


def build_backend(settings: Any, role: str, kv_cache: Any) -> TransferBackend:
    """The ``disaggregation.transfer_backend`` plugin over this server's KV cache."""
    from framework.config.loader import validate_options
    from framework.plugins import get_registry

    dcfg = settings.disaggregation
    comp = get_registry().get("transfer_backend", dcfg.transfer_backend, key="disaggregation.transfer_backend")
    options = comp.make_options(validate_options(comp, dcfg.transfer_options, "disaggregation.transfer_options"))
    return comp.factory(role, KVLayout.from_cache(kv_cache), options)


def room_of(req: Any) -> int:
    room = getattr(req, "bootstrap_room", None)
    if room is None:
        raise ValueError("a request to a prefill or decode server needs bootstrap_room (send it through the router)")
    return int(room)


def make_pd_side(scheduler: Any) -> Any:
    """The scheduler's PD half for ``disaggregation.mode`` (None in unified mode)."""
    mode = scheduler.settings.disaggregation.mode
    if mode is None:
        return None
    if scheduler.cfg.overlap:
        from framework.errors import ConfigError

        raise ConfigError("scheduler.overlap is not supported with disaggregation.mode yet: set it to false")
    if mode.value == "prefill":
        from framework.disaggregation.prefill_side import PrefillSide

        return PrefillSide(scheduler)
    from framework.disaggregation.decode_side import DecodeSide

    return DecodeSide(scheduler)
