"""Operations routes: health, model and server info, load, cache flush, abort, OpenAPI schema.

``/health`` and ``/openapi.json`` are open (probes and tooling); the info routes and
``/health_generate`` need ``server.api_key`` when one is set; ``/flush_cache`` and
``/abort_request`` need ``server.admin_key`` (falling back to ``api_key``).
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import framework
from framework.sampling.params import SamplingParams
from framework.server.data_parallel import replica_failure
from framework.server.errors import APIError
from framework.server.http_utils import parse_model, require_bearer
from framework.server.protocol import REQUEST_MODELS, AbortRequest
from framework.server.request_builder import new_rid
from framework.server.rollout_routes import ROLLOUT_REQUEST_MODELS
from framework.server.state import ServerState
from framework.server.tokenizer_manager import SubRequest

CONTROL_TIMEOUT_S = 10.0
"""How long an ops route waits for the scheduler's answer (it answers between two steps)."""


def _server(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request) -> Response:
    """200 while the scheduler process is alive; 503 from the moment it dies."""
    server = _server(request)
    if server.manager.dead is not None:
        return APIError(503, f"the scheduler process is not running ({server.manager.dead})",
                        code="scheduler_dead").response()
    return JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """Generate one token end to end (tokenizer manager, IPC, scheduler, model) on every
    data-parallel replica."""
    server = _server(request)
    require_bearer(request, server.api_key)
    await asyncio.gather(*(_generate_one_token(server, r.dp_rank) for r in server.manager.replicas))
    return JSONResponse({"status": "ok"})


async def _generate_one_token(server: ServerState, dp_rank: int) -> None:
    rid = f"health-{new_rid()}"
    first = int((server.model_info.get("eos_token_ids") or [0])[0])
    sub = SubRequest(rid=rid, input_ids=[first], params=SamplingParams(max_new_tokens=1, temperature=0.0))
    group = await server.manager.submit(rid, [sub], dp_rank)
    timeout = server.settings.server.health_check_timeout_s
    try:
        await asyncio.wait_for(group.wait(), timeout)
    except asyncio.TimeoutError:
        raise APIError(503, f"health check: no token within {timeout:g}s", code="unhealthy") from None
    finally:
        await server.manager.close_group(group)
    if group.states[0].error or not group.states[0].output_ids:
        where = f" (dp rank {dp_rank})" if len(server.manager.replicas) > 1 else ""
        raise APIError(503, f"health check failed{where}: {group.states[0].error}", code="unhealthy")


async def model_info(request: Request) -> Response:
    server = _server(request)
    require_bearer(request, server.api_key)
    info = {**server.model_info, "served_model_name": server.model_name, "is_generation": True,
            "tokenizer_path": server.settings.model.tokenizer_path or server.model_info.get("model_path")}
    return JSONResponse(info)


async def _control_all(server: ServerState, kind: str) -> list[dict[str, Any]]:
    """One control call to every data-parallel replica; a 503 naming the first that failed."""
    results = await server.manager.control_all(kind, CONTROL_TIMEOUT_S)
    failed = replica_failure(results)
    if failed is not None:
        rank, data = failed
        where = f" (dp rank {rank})" if len(results) > 1 else ""
        raise APIError(503, f"the scheduler{where} could not report: {data.get('error')}")
    return [data for _, data in results]


def _replica_entry(rank: int, data: dict[str, Any], in_flight: int) -> dict[str, Any]:
    return {"dp_rank": rank, "scheduler_pid": data.get("scheduler_pid"), "tp_ranks": data.get("tp_ranks"),
            "num_requests": data.get("num_requests"), "http_in_flight": in_flight, "load": data.get("load"),
            "leak_report": data.get("leak_report")}


async def server_info(request: Request) -> Response:
    """Config (keys redacted), model, load and the scheduler's KV leak report: the top-level keys
    are replica 0's; ``dp`` lists every data-parallel replica (pid, requests, load, leak report)."""
    server = _server(request)
    require_bearer(request, server.api_key)
    replies = await _control_all(server, "server_info")
    data = replies[0]
    replicas = server.manager.replicas
    body: dict[str, Any] = {
        "version": framework.__version__,
        "pid": os.getpid(),
        "http_gc_frozen_objects": gc.get_freeze_count(),  # framework.memory.gc_freeze
        "served_model_name": server.model_name,
        "active_requests": server.manager.num_active(),
        "config": server.public_config(),
        "http_stack": server.http_stack,
        **data,
        "dp_size": len(replies),
        "dp": [_replica_entry(r, d, replicas[r].in_flight) for r, d in enumerate(replies)],
    }
    # SGLang's /server_info is flat (``model_path`` at the top) and sglang-router reads it into a
    # typed struct: a ``model`` object there makes it give up on the whole reply (the worker's model
    # id then shows as "unknown"), so the model's description goes under ``model_info``.
    if isinstance(body.get("model"), dict):
        body["model_info"] = body.pop("model")
        body.setdefault("model_path", body["model_info"].get("model_path"))
    return JSONResponse(body)


def sglang_load(load: dict[str, Any], dp_rank: int = 0) -> dict[str, Any]:
    """One data-parallel rank's entry of ``/get_load`` in SGLang's shape (``dp_rank``, ``num_reqs``
    = running + waiting, ``num_waiting_reqs``, ``num_tokens`` = KV tokens held by requests and
    pinned cache entries plus the prompt tokens still waiting: what sglang-router's
    ``power_of_two`` policy compares), followed by plugserve's own fields."""
    return {
        "dp_rank": dp_rank,
        "num_reqs": load["num_running"] + load["num_waiting"],
        "num_waiting_reqs": load["num_waiting"],
        "num_tokens": load["kv_used_tokens"] + load.get("num_waiting_tokens", 0),
        **load,
    }


async def get_load(request: Request) -> Response:
    """``GET /get_load``: a list with one entry per data-parallel rank (``parallel.dp_size``), as
    SGLang answers, so that routers written for SGLang read it."""
    server = _server(request)
    require_bearer(request, server.api_key)
    loads = await _control_all(server, "get_load")
    for replica, load in zip(server.manager.replicas, loads, strict=True):
        replica.last_load = load
    server.manager.refresh_gauges()
    return JSONResponse([sglang_load(load, rank) for rank, load in enumerate(loads)])


async def flush_cache(request: Request) -> Response:
    """Drop the prefix cache of every replica; refused (409) while requests run or wait on any
    (the replicas that were idle are flushed all the same: dropping a cache loses nothing)."""
    server = _server(request)
    require_bearer(request, server.admin_key)
    results = await server.manager.control_all("flush_cache", CONTROL_TIMEOUT_S)
    if replica_failure(results) is not None:
        raise APIError(409, "the cache can only be flushed while no request runs or waits", code="busy")
    return JSONResponse({"success": True, "message": "the prefix cache was flushed"})


async def abort_request(request: Request) -> Response:
    """Abort a request by ``rid`` (or all with ``abort_all``); its client gets finish reason abort."""
    server = _server(request)
    require_bearer(request, server.admin_key)
    body = await parse_model(request, AbortRequest, server.body_limits)
    if body.rid is None and not body.abort_all:
        raise APIError(400, "give rid or abort_all", param="rid")
    aborted = await server.manager.abort(body.rid, body.abort_all)
    return JSONResponse({"success": bool(aborted), "aborted": aborted})


def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1 document of the POST bodies, built from the pydantic request models."""
    models = [*REQUEST_MODELS.values(), *ROLLOUT_REQUEST_MODELS.values()]
    _, defs = models_json_schema([(m, "validation") for m in models],
                                 ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for path, model in {**REQUEST_MODELS, **ROLLOUT_REQUEST_MODELS}.items():
        paths[path] = {"post": {
            "summary": (model.__doc__ or "").strip().splitlines()[0],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK"}, "400": {"description": "invalid request (OpenAI error)"}},
        }}
    for path in ("/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
                 "/get_server_info", "/get_load", "/v1/models", "/v1/models/{model_id}", "/metrics"):
        paths[path] = {"get": {"responses": {"200": {"description": "OK"}}}}
    paths["/flush_cache"] = {"post": {"responses": {"200": {"description": "OK"}, "409": {"description": "busy"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "plugserve", "version": framework.__version__},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/health_generate", health_generate, methods=["GET"]),
    Route("/model_info", model_info, methods=["GET"]),
    Route("/get_model_info", model_info, methods=["GET"]),  # SGLang's older names, still what its clients call
    Route("/server_info", server_info, methods=["GET"]),
    Route("/get_server_info", server_info, methods=["GET"]),
    Route("/get_load", get_load, methods=["GET"]),
    Route("/flush_cache", flush_cache, methods=["POST"]),
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
