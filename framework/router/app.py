"""The PD router: a Starlette app that forwards each generation request to one prefill and one
decode server with the same ``bootstrap_host``, ``bootstrap_port`` and a fresh ``bootstrap_room``
(SGLang's mini load balancer protocol), and answers with the decode server's reply, streamed when
the client asked for a stream. Servers are picked round-robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class PrefillServer:
    url: str
    bootstrap_port: int

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"


@dataclass
class RouterConfig:
    prefill: list[PrefillServer]
    decode: list[str]
    timeout_s: float = 600.0


class Router:
    """Picks servers, adds the bootstrap fields, forwards."""

    def __init__(self, cfg: RouterConfig) -> None:
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the router needs at least one prefill and one decode server")
        self.cfg = cfg
        self._prefill = itertools.cycle(cfg.prefill)
        self._decode = itertools.cycle(cfg.decode)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0))

    def pair(self) -> tuple[PrefillServer, str]:
        return next(self._prefill), next(self._decode)

    async def forward(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse({"error": {"message": f"the body is not valid JSON: {exc}"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object"}}, status_code=400)
        prefill, decode = self.pair()
        body = {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        path = request.url.path
        prefill_task = asyncio.create_task(self._drain(prefill.url + path, body, headers))
        req = self.http.build_request("POST", decode + path, json=body, headers=headers)
        resp = await self.http.send(req, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            p_status, p_content = await prefill_task
            if p_status not in (None, 200):  # the prefill side's error explains the decode's
                return Response(p_content, status_code=p_status, media_type="application/json")
            return Response(content, status_code=resp.status_code, media_type="application/json")
        if body.get("stream"):
            return StreamingResponse(self._relay(resp), media_type="text/event-stream",
                                     background=BackgroundTask(self._finish, resp, prefill_task))
        content = await resp.aread()
        await self._finish(resp, prefill_task)
        return Response(content, status_code=200, media_type="application/json")

    async def _relay(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        async for chunk in resp.aiter_raw():
            yield chunk

    async def _finish(self, resp: httpx.Response, prefill_task: asyncio.Task) -> None:
        await resp.aclose()
        await prefill_task

    async def _drain(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int | None, bytes]:
        """Send to the prefill server and read its whole reply (it only reports the first token)."""
        try:
            resp = await self.http.post(url, json=body, headers=headers)
            return resp.status_code, resp.content
        except httpx.HTTPError as exc:
            return None, json.dumps({"error": {"message": f"prefill server {url}: {exc}"}}).encode()

    async def health(self, request: Request) -> Response:
        urls = [p.url for p in self.cfg.prefill] + list(self.cfg.decode)

        async def ok(url: str) -> bool:
            try:
                return (await self.http.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        results = await asyncio.gather(*(ok(u) for u in urls))
        status = 200 if all(results) else 503
        return JSONResponse({"servers": dict(zip(urls, results, strict=True))}, status_code=status)

    async def models(self, request: Request) -> Response:
        resp = await self.http.get(self.cfg.decode[0] + "/v1/models", headers=dict(request.headers.items()))
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def close(self) -> None:
        await self.http.aclose()


def build_app(cfg: RouterConfig) -> Starlette:
    router = Router(cfg)
    routes = [Route(p, router.forward, methods=["POST"]) for p in GENERATION_ROUTES]
    routes += [Route("/health", router.health), Route("/v1/models", router.models)]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await router.close()

    return Starlette(routes=routes, lifespan=lifespan)


def parse_prefill_args(values: list[list[str]], default_bootstrap_port: int) -> list[PrefillServer]:
    """``--prefill URL [BOOTSTRAP_PORT]`` occurrences."""
    out = []
    for v in values:
        if not 1 <= len(v) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(v)}")
        out.append(PrefillServer(v[0].rstrip("/"), int(v[1]) if len(v) == 2 else default_bootstrap_port))
    return out
