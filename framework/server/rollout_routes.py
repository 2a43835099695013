"""RL routes, with SGLang's names and bodies: pause and continue generation, release and resume
memory, weight updates (disk, tensors, a trainer's broadcast) and weight reads.

Every route needs ``server.admin_key`` (falling back to ``api_key``) when one is set. The calls
run in the scheduler process (``framework.scheduler.rollout``); those that need the model to
themselves wait there until the running requests have finished (or were paused), so the HTTP
wait is bounded by ``server.rollout_timeout_s``. One difference from SGLang:
``update_weights_from_tensor`` takes safetensors bytes (base64), never pickles.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from framework.server.data_parallel import replica_failure
from framework.server.errors import APIError
from framework.server.http_utils import BodyLimits, parse_model, require_bearer
from framework.server.protocol import StrictModel
from framework.server.state import ServerState

QUICK_TIMEOUT_S = 10.0
"""Calls answered between two steps (pause, continue, weight reads)."""


class ReleaseMemoryOccupationRequest(StrictModel):
    """``POST /release_memory_occupation``: free memory by tag (all tags when omitted)."""

    tags: list[str] | None = None


class ResumeMemoryOccupationRequest(StrictModel):
    """``POST /resume_memory_occupation``: bring tags back (all when omitted)."""

    tags: list[str] | None = None


class _WeightUpdate(StrictModel):
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromDiskRequest(_WeightUpdate):
    """``POST /update_weights_from_disk``: a new checkpoint directory of the same architecture."""

    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None


class UpdateWeightsFromTensorRequest(_WeightUpdate):
    """``POST /update_weights_from_tensor``: named tensors as base64 safetensors (one entry per
    tensor-parallel rank in SGLang; plugserve serves one rank, so one entry, or several chunks)."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["direct"] | None = None


class InitWeightsUpdateGroupRequest(StrictModel):
    """``POST /init_weights_update_group``: join the trainer's group (trainer is rank 0)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateWeightsFromDistributedRequest(_WeightUpdate):
    """``POST /update_weights_from_distributed``: receive these tensors from the group's rank 0."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroupRequest(StrictModel):
    """``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


class GetWeightsByNameRequest(StrictModel):
    """``POST /get_weights_by_name``: the first ``truncate_size`` values of a weight."""

    name: str
    truncate_size: int = Field(default=100, ge=1, le=1 << 20)


class PauseGenerationRequest(StrictModel):
    """``POST /pause_generation``: abort, retract or hold (in place) the requests in flight."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(StrictModel):
    """``POST /continue_generation``."""


ROLLOUT_REQUEST_MODELS: dict[str, type[StrictModel]] = {
    "/release_memory_occupation": ReleaseMemoryOccupationRequest,
    "/resume_memory_occupation": ResumeMemoryOccupationRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/update_weights_from_tensor": UpdateWeightsFromTensorRequest,
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "/get_weights_by_name": GetWeightsByNameRequest,
    "/pause_generation": PauseGenerationRequest,
    "/continue_generation": ContinueGenerationRequest,
}
"""The RL routes and their bodies (for /openapi.json)."""


def _replica_args(server: ServerState, kind: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Each data-parallel replica's arguments. Every replica joins a trainer's weight-update
    group as its own ranks: replica ``d`` takes ranks ``rank_offset + d * tp_size`` onwards, so
    the trainer's ``world_size`` is 1 + dp_size * tp_size."""
    replicas = len(server.manager.replicas)
    if kind != "init_weights_update_group":
        return [args] * replicas
    tp_size = server.settings.parallel.tp_size
    return [{**args, "rank_offset": args["rank_offset"] + d * tp_size} for d in range(replicas)]


async def _call(request: Request, kind: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """The call on every data-parallel replica at once; it succeeds only if all of them do (a
    refusal is the first failing replica's error; the others keep what they did)."""
    server: ServerState = request.app.state.server
    if args.pop("abort_all_requests", False):
        await server.manager.abort(None, True)
    results = await server.manager.control_all(kind, timeout or server.settings.server.rollout_timeout_s,
                                               _replica_args(server, kind, args))
    failed = replica_failure(results)
    if failed is not None:
        rank, data = failed
        where = f"dp rank {rank}: " if len(results) > 1 else ""
        raise APIError(int(data.get("status", 500)), where + str(data.get("error")), param=data.get("param"))
    return results[0][1]


async def _body(request: Request, path: str) -> dict[str, Any]:
    server: ServerState = request.app.state.server
    require_bearer(request, server.admin_key)
    limits = server.body_limits
    if path == "/update_weights_from_tensor":  # weights are big: their own (admin-only) limit
        limits = BodyLimits(server.settings.server.max_weight_update_bytes, limits.max_depth)
    body = await parse_model(request, ROLLOUT_REQUEST_MODELS[path], limits)
    return body.model_dump()


def _decode_tensors(blobs: list[str]) -> list[bytes]:
    out = []
    for i, blob in enumerate(blobs):
        try:
            out.append(base64.b64decode(blob, validate=True))
        except (binascii.Error, ValueError):
            raise APIError(400, f"serialized_named_tensors[{i}] is not base64",
                           param="serialized_named_tensors") from None
    return out


def _route(path: str, quick: bool = False) -> Route:
    kind = path.lstrip("/")

    async def handler(request: Request) -> Response:
        args = await _body(request, path)
        if kind == "update_weights_from_tensor":
            args["serialized_named_tensors"] = _decode_tensors(args["serialized_named_tensors"])
        if kind == "init_weights_update_group":
            args["timeout_s"] = request.app.state.server.settings.server.rollout_timeout_s
        data = await _call(request, kind, args, QUICK_TIMEOUT_S if quick else None)
        if kind == "get_weights_by_name":
            return JSONResponse(data["values"])  # SGLang answers with the bare list
        data.setdefault("message", "ok")
        return JSONResponse(data)

    handler.__doc__ = ROLLOUT_REQUEST_MODELS[path].__doc__
    return Route(path, handler, methods=["POST"], name=kind)


ROUTES = [
    _route("/release_memory_occupation"),
    _route("/resume_memory_occupation"),
    _route("/update_weights_from_disk"),
    _route("/update_weights_from_tensor"),
    _route("/init_weights_update_group"),
    _route("/update_weights_from_distributed"),
    _route("/destroy_weights_update_group", quick=True),
    _route("/get_weights_by_name", quick=True),
    _route("/pause_generation", quick=True),
    _route("/continue_generation", quick=True),
]
