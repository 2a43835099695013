"""The router for unified servers: each generation request goes, unchanged, to one of several
``plugserve serve`` (or SGLang) servers, picked round-robin or by the shortest queue.

``shortest_queue`` counts the requests this router has open on each worker (sent, reply not yet
finished): exact for the traffic that goes through the router and free of polling. A worker's
own ``/get_load`` would also see traffic that bypasses the router, but it is a round trip per
request or a stale poll; ``GET /get_load`` on the router lists every worker's entries instead.

A worker that refuses the connection is skipped for ``eject_s`` (the request goes to the next
one: it never reached the first); one that fails after accepting the request answers 502, or ends
a stream with an error event and ``[DONE]``, as the PD router does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from framework.router.app import GENERATION_ROUTES, UpstreamError, error_response, sse_error

POLICIES = ("round_robin", "shortest_queue")


@dataclass
class WorkerRouterConfig:
    """The workers (base URLs), the policy and the timeouts of ``plugserve router --worker-urls``."""

    workers: list[str]
    policy: str = "round_robin"
    timeout_s: float = 600.0
    eject_s: float = 2.0
    """How long a worker that refused a connection is tried last."""


class WorkerRouter:
    """Picks a worker per request and relays its reply (streamed when the client streams)."""

    def __init__(self, cfg: WorkerRouterConfig) -> None:
        if not cfg.workers:
            raise ValueError("the router needs at least one worker URL")
        if cfg.policy not in POLICIES:
            raise ValueError(f"--policy {cfg.policy!r}: must be one of {', '.join(POLICIES)}")
        self.cfg = cfg
        self.in_flight = dict.fromkeys(cfg.workers, 0)
        self.sent = dict.fromkeys(cfg.workers, 0)
        """Requests forwarded to each worker since the start (GET /workers reports them)."""
        self._next = 0
        self._down_until: dict[str, float] = {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0), limits=limits)

    def order(self) -> list[str]:
        """Every worker once, best first: the policy's choice, then the rest round-robin; workers
        that recently refused a connection go last."""
        workers = self.cfg.workers
        rotated = workers[self._next:] + workers[:self._next]
        if self.cfg.policy == "shortest_queue":
            rotated.sort(key=lambda u: self.in_flight[u])  # stable: ties stay round-robin
        now = time.monotonic()
        rotated.sort(key=lambda u: self._down_until.get(u, 0.0) > now)
        self._next = (workers.index(rotated[0]) + 1) % len(workers)
        return rotated

    async def _open(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[str, httpx.Response]:
        errors = []
        for url in self.order():
            req = self.http.build_request("POST", url + path, content=body, headers=headers)
            self.in_flight[url] += 1
            try:
                resp = await self.http.send(req, stream=True)
            except httpx.ConnectError as exc:  # it never got the request: safe to try the next
                self.in_flight[url] -= 1
                self._down_until[url] = time.monotonic() + self.cfg.eject_s
                errors.append(f"{url}: {exc}")
                continue
            except httpx.HTTPError as exc:
                self.in_flight[url] -= 1
                raise UpstreamError(f"worker {url} failed: {type(exc).__name__}: {exc}") from None
            self._down_until.pop(url, None)
            self.sent[url] += 1
            return url, resp
        raise UpstreamError("no worker is reachable: " + "; ".join(errors))

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            stream = bool(json.loads(body).get("stream")) if body else False
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            stream = False  # the worker answers the malformed body with its own 400
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            url, resp = await self._open(request.url.path, body, headers)
        except UpstreamError as exc:
            return error_response(502, str(exc))
        done = BackgroundTask(self._finish, url, resp)
        media = resp.headers.get("content-type", "application/json")
        if stream and resp.status_code == 200:
            return StreamingResponse(self._relay(resp), media_type=media, background=done)
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            await self._finish(url, resp)
            return error_response(502, f"worker {url} died mid-reply: {type(exc).__name__}: {exc}")
        return Response(content, status_code=resp.status_code, media_type=media, background=done)

    async def _relay(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # headers are gone: the error travels as an event
            yield sse_error(f"the worker died mid-stream: {type(exc).__name__}: {exc}")

    async def _finish(self, url: str, resp: httpx.Response) -> None:
        await resp.aclose()
        self.in_flight[url] -= 1

    async def _get(self, url: str, path: str, headers: dict[str, str]) -> httpx.Response | None:
        try:
            return await self.http.get(url + path, headers=headers, timeout=10.0)
        except httpx.HTTPError:
            return None

    async def health(self, request: Request) -> Response:
        replies = await asyncio.gather(*(self._get(u, "/health", {}) for u in self.cfg.workers))
        ok = [r is not None and r.status_code == 200 for r in replies]
        return JSONResponse({"servers": dict(zip(self.cfg.workers, ok, strict=True))},
                            status_code=200 if all(ok) else 503)

    async def get_load(self, request: Request) -> Response:
        """Every worker's ``/get_load`` entries (one per dp rank), each with its ``worker_url``."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        replies = await asyncio.gather(*(self._get(u, "/get_load", headers) for u in self.cfg.workers))
        entries: list[dict[str, Any]] = []
        for url, reply in zip(self.cfg.workers, replies, strict=True):
            if reply is None or reply.status_code != 200:
                return error_response(502, f"worker {url} did not report its load")
            entries += [{"worker_url": url, **entry} for entry in reply.json()]
        return JSONResponse(entries)

    async def workers(self, request: Request) -> Response:
        """The router's own view: requests open on and sent to each worker."""
        return JSONResponse([{"url": u, "in_flight": self.in_flight[u], "sent": self.sent[u]}
                             for u in self.cfg.workers])

    async def passthrough(self, request: Request) -> Response:
        """A read-only GET (model list, model info) from the first worker that answers."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for url in self.cfg.workers:
            reply = await self._get(url, request.url.path, headers)
            if reply is not None:
                return Response(reply.content, status_code=reply.status_code, media_type="application/json")
        return error_response(502, "no worker is reachable")

    async def close(self) -> None:
        await self.http.aclose()


def build_worker_app(cfg: WorkerRouterConfig) -> Starlette:
    """The ASGI app of ``plugserve router --worker-urls ...``."""
    router = WorkerRouter(cfg)
    routes = [Route(p, router.forward, methods=["POST"]) for p in GENERATION_ROUTES]
    routes += [Route("/health", router.health), Route("/get_load", router.get_load),
               Route("/workers", router.workers)]
    routes += [Route(p, router.passthrough) for p in ("/v1/models", "/model_info", "/get_model_info")]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await router.close()

    return Starlette(routes=routes, lifespan=lifespan)
