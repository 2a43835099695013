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
    """The ``disaggregation.transfer_backend`` plugin over this server's KV cache (its options were
    validated when the config was resolved)."""
    from framework.plugins import get_registry

    dcfg = settings.disaggregation
    comp = get_registry().get("transfer_backend", dcfg.transfer_backend, key="disaggregation.transfer_backend")
    return comp.factory(role, KVLayout.from_cache(kv_cache), comp.make_options(dcfg.transfer_options))


def room_of(req: Any) -> int:
    room = getattr(req, "bootstrap_room", None)
    if room is None:
        raise ValueError("a request to a prefill or decode server needs bootstrap_room (send it through the router)")
    return int(room)
