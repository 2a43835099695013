"""Messages between the HTTP process and the scheduler process, and their msgpack codec.

Both directions share one channel per scheduler process (``framework.server.channel``: a Unix
socket inside a private run directory, length-prefixed messages). Every
message is a tagged msgspec struct encoded as msgpack: compact, fast, and safe to decode (no
pickle), so a message can never run code in the receiving process.
"""

from __future__ import annotations

from typing import Any

import msgspec

from framework.scheduler.outputs import RequestOutput

# -- HTTP process -> scheduler process ----------------------------------------------------------


class GenerateReq(msgspec.Struct, tag="generate", omit_defaults=True):
    """One scheduler request (n == 1): token ids and plain-dict sampling parameters.

    Fields at their defaults are left out of the message: a text-only request pays nothing for
    ``mm_inputs``."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int | None = None
    token_ids_logprob: list[int] | None = None
    mm_inputs: dict[str, Any] | None = None
    """A multimodal prompt's images and M-RoPE positions, as ``MultimodalInputs.to_wire`` gives
    them (tensors as safetensors bytes: raw data + dtype + shape, never pickle)."""


class GenerateBatch(msgspec.Struct, tag="generate_batch"):
    """All the scheduler requests of one HTTP request (a batch, or ``n`` choices).

    They travel together so the scheduler admits or refuses them in one go: a request whose
    siblings were refused is withdrawn instead of half-running.
    """

    reqs: list[GenerateReq]


class Abort(msgspec.Struct, tag="abort"):
    """Abort requests by id (their KV is released at once)."""

    rids: list[str]


class Control(msgspec.Struct, tag="control"):
    """A control call answered by a :class:`ControlReply` with the same ``call_id``.

    ``kind`` is one of :data:`CONTROL_KINDS`.
    """

    call_id: int
    kind: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    """Arguments of the call (RL calls: tags, paths, tensor names; tensors as safetensors bytes)."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the scheduler loop and exit."""


class Delivered(msgspec.Struct, tag="delivered"):
    """The answer to an :class:`Outputs` message that asked for one (``ack_id`` > 0): every
    first token it carried has been written to its client (or its request is gone)."""

    ack_id: int


ROLLOUT_KINDS = ("pause_generation", "continue_generation", "release_memory_occupation",
                 "resume_memory_occupation", "update_weights_from_disk", "update_weights_from_tensor",
                 "init_weights_update_group", "update_weights_from_distributed",
                 "destroy_weights_update_group", "get_weights_by_name")
"""The RL calls (``framework.scheduler.rollout``), answered by ``framework.server.rollout_calls``."""

CONTROL_KINDS = ("flush_cache", "get_load", "server_info", *ROLLOUT_KINDS)

ToScheduler = GenerateBatch | Abort | Control | Shutdown | Delivered

# -- scheduler process -> HTTP process ----------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    """The model is loaded; ``info`` is what /model_info reports (context length, vocab, ...)."""

    info: dict[str, Any]


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    """The scheduler process could not start (bad config, missing model, ...)."""

    message: str


class Outputs(msgspec.Struct, tag="outputs"):
    """Output deltas of one scheduler step."""

    outputs: list[RequestOutput]
    load: dict[str, Any] | None = None
    """The scheduler's load after the step; sent at most every ``LOAD_REPORT_INTERVAL_S`` and
    with the last step before it goes idle (/metrics asks for a fresh one when it is read)."""
    ack_id: int = 0
    """> 0: some output is a request's first token and the scheduler waits (bounded by
    ``server.first_token_wait_ms``) for a :class:`Delivered` with this id before its next step."""


class Rejected(msgspec.Struct, tag="rejected"):
    """A :class:`GenerateBatch` refused at admission; none of its requests runs.

    ``status`` is the HTTP status the client gets: 400 (AdmissionError) or 503 (queue full).
    """

    rids: list[str]
    message: str
    status: int


class ControlReply(msgspec.Struct, tag="control_reply"):
    """The answer to a :class:`Control` call."""

    call_id: int
    ok: bool
    data: dict[str, Any]


FromScheduler = Ready | StartupFailed | Outputs | Rejected | ControlReply

_encoder = msgspec.msgpack.Encoder()
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_from_scheduler = msgspec.msgpack.Decoder(FromScheduler)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_scheduler.decode(data)


def decode_from_scheduler(data: bytes) -> FromScheduler:
    return _from_scheduler.decode(data)
