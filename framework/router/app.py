"""The PD router: a Starlette app that forwards each generation request to one prefill and one
decode server with the same ``bootstrap_host``, ``bootstrap_port`` and a fresh ``bootstrap_room``
(SGLang's mini load balancer protocol), and answers with the decode server's reply, streamed when
the client asked for a stream. Servers are picked round-robin.

Faults give the client an error, never a hang: a decode server that refuses connections is skipped
for ``eject_s`` (the next one is tried; with none left, 502); a prefill server that fails first
(unreachable, or its transfer failed) cancels the decode request and its error is returned; a decode
server that dies mid-reply ends a stream with an error event and ``[DONE]``, or answers 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import weakref
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import anyio
import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
PREFILL_GRACE_S = 1.0
"""After a decode server's error, how long its prefill server's reply (often the cause) is awaited
before the prefill request is cancelled (the prefill server then aborts it and frees its KV)."""


class UpstreamError(Exception):
    """A server could not be reached or died mid-reply: answered 502 with the reason."""


def error_response(status: int, message: str, code: str = "upstream_failed") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": code}}, status_code=status)


def sse_error(message: str) -> bytes:
    """An error event and the end of the stream, as the servers end a failed stream."""
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


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
    eject_s: float = 2.0
    """How long a decode server that refused a connection is tried last."""


class Router:
    """Picks servers, adds the bootstrap fields, forwards."""

    def __init__(self, cfg: RouterConfig) -> None:
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the router needs at least one prefill and one decode server")
        self.cfg = cfg
        self._prefill = itertools.cycle(cfg.prefill)
        self._decode = itertools.cycle(cfg.decode)
        self._down_until: dict[str, float] = {}
        # No cap on connections: each stream holds one for its whole decode, and a capped pool
        # would queue new requests behind them (its clients bound the router's concurrency).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0), limits=limits)

    def pair(self) -> tuple[PrefillServer, str]:
        return next(self._prefill), next(self._decode)

    def _decode_order(self) -> list[str]:
        """Every decode server once, round-robin, the recently ejected ones last."""
        first = next(self._decode)
        i = self.cfg.decode.index(first)
        order = self.cfg.decode[i:] + self.cfg.decode[:i]
        now = time.monotonic()
        return sorted(order, key=lambda u: self._down_until.get(u, 0.0) > now)

    async def _open_decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """The first decode server that accepts the connection (its response headers)."""
        errors = []
        for url in self._decode_order():
            req = self.http.build_request("POST", url + path, json=body, headers=headers)
            try:
                resp = await self.http.send(req, stream=True)
            except httpx.ConnectError as exc:  # the request never reached it: safe to try the next
                self._down_until[url] = time.monotonic() + self.cfg.eject_s
                errors.append(f"{url}: {exc}")
                continue
            except httpx.HTTPError as exc:
                raise UpstreamError(f"decode server {url} failed: {type(exc).__name__}: {exc}") from None
            self._down_until.pop(url, None)
            return resp
        raise UpstreamError("no decode server is reachable: " + "; ".join(errors))

    async def forward(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse({"error": {"message": f"the body is not valid JSON: {exc}"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object"}}, status_code=400)
        prefill = next(self._prefill)
        body = {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        path = request.url.path
        prefill_task = _start(self._drain(prefill.url + path, body, headers))
        decode_task = _start(self._open_decode(path, body, headers))
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if not decode_task.done() and prefill_task.result()[0] != 200:
            # The prefill server failed (unreachable, transfer failed): the decode side cannot get
            # the KV; cancelling closes its connection, so the decode server aborts and frees it.
            await _cancel(decode_task)
            return _prefill_error(*prefill_task.result())
        try:
            resp = await decode_task
        except UpstreamError as exc:
            await _cancel(prefill_task)
            return error_response(502, str(exc))
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            p_status, p_content = await _result_within(prefill_task, PREFILL_GRACE_S)
            if p_status not in (None, 200):  # the prefill side's error explains the decode's
                return _prefill_error(p_status, p_content)
            return Response(content, status_code=resp.status_code, media_type="application/json")
        if body.get("stream"):
            return StreamingResponse(self._relay(resp), media_type="text/event-stream",
                                     background=BackgroundTask(self._finish, resp, prefill_task))
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            await self._finish(resp, prefill_task)
            return error_response(502, f"the decode server died mid-reply: {type(exc).__name__}: {exc}")
        await self._finish(resp, prefill_task)
        return Response(content, status_code=200, media_type="application/json")

    async def _relay(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # headers are gone: the error travels as an event
            yield sse_error(f"the decode server died mid-stream: {type(exc).__name__}: {exc}")

    async def _finish(self, resp: httpx.Response, prefill_task: asyncio.Task) -> None:
        await resp.aclose()
        await _result_within(prefill_task, PREFILL_GRACE_S)

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


_SCOPES: weakref.WeakKeyDictionary[asyncio.Task, anyio.CancelScope] = weakref.WeakKeyDictionary()


def _start(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """A task that ``_cancel`` stops through an anyio cancel scope: a bare ``Task.cancel`` also
    interrupts httpcore's shielded clean-up, which then leaks the connection (seen: one open
    socket per cancelled request)."""
    scope = anyio.CancelScope()

    async def run() -> Any:
        with scope:
            return await coro
        return None  # cancelled

    task = asyncio.create_task(run())
    _SCOPES[task] = scope
    return task


async def _cancel(task: asyncio.Task) -> None:
    scope = _SCOPES.get(task)
    if scope is not None:
        scope.cancel()
    else:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        result = await task
        if isinstance(result, httpx.Response):  # it completed before the cancel landed
            await result.aclose()


async def _result_within(task: asyncio.Task, timeout_s: float) -> tuple[int | None, bytes]:
    """The prefill reply if it comes within ``timeout_s``; else the request is cancelled."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        return task.result()
    await _cancel(task)
    return None, b""


def _prefill_error(status: int | None, content: bytes) -> Response:
    if status is None:  # unreachable or died: _drain put the reason in an error body
        return Response(content, status_code=502, media_type="application/json")
    return Response(content, status_code=status, media_type="application/json")


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
