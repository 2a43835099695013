"""What both PD sides share: building the configured transfer backend, and the first-token
metadata that travels with the KV pages (msgpack, never pickle)."""

from __future__ import annotations

from typing import Any

import msgspec

from framework.disaggregation.base import KVLayout, TransferBackend
from framework.disaggregation.heads import ModelIdentity, RankShard


class FirstToken(msgspec.Struct, omit_defaults=True):
    """The prefill server's sample at the end of the prompt, and the prompt's logprobs."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    mrope_position_delta: int | None = None
    """M-RoPE models, prompts with images: decode positions are ``p + delta`` (the decode server
    never runs the vision encoder, so it learns the delta here)."""


def encode_first_token(meta: FirstToken) -> bytes:
    return msgspec.msgpack.encode(meta)


def decode_first_token(data: bytes) -> FirstToken:
    return msgspec.msgpack.decode(data, type=FirstToken)


def build_backend(settings: Any, role: str, kv_cache: Any, layout: KVLayout | None = None) -> TransferBackend:
    """The ``disaggregation.transfer_backend`` plugin over this server's KV cache, or over
    ``layout`` (a head slice of it) when given (its options were validated when the config was
    resolved)."""
    from framework.plugins import get_registry

    dcfg = settings.disaggregation
    comp = get_registry().get("transfer_backend", dcfg.transfer_backend, key="disaggregation.transfer_backend")
    return comp.factory(role, layout or KVLayout.from_cache(kv_cache), comp.make_options(dcfg.transfer_options))


def room_of(req: Any) -> int:
    room = getattr(req, "bootstrap_room", None)
    if room is None:
        raise ValueError("a request to a prefill or decode server needs bootstrap_room (send it through the router)")
    return int(room)


def rank_kv(scheduler: Any) -> tuple[KVLayout, RankShard]:
    """This rank's whole KV layout (with the model identity) and its place in its TP group."""
    from framework.distributed.state import get_tensor_parallel

    identity = ModelIdentity.of_runner(scheduler.runner)
    tp = get_tensor_parallel()
    return (KVLayout.from_cache(scheduler.runner.kv_cache, identity),
            RankShard.of(identity.num_kv_heads, tp.rank, tp.size))


def registration(shard: RankShard, identity: ModelIdentity | None, session: str, peer_session: str | None,
                 links: dict[str, Any]) -> dict[str, Any]:
    """What a rank registers with the bootstrap service: its TP rank, size and KV heads, the model
    identity, the side's session ids and its links' endpoints (by peer rank)."""
    return {"shard": shard.to_json(), "identity": None if identity is None else identity.to_json(),
            "pd_session": session, "pd_peer_session": peer_session, "links": links}
