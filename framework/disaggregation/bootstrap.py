"""The bootstrap service of a prefill server, and its client.

A tiny JSON-over-HTTP server (stdlib, one thread per connection) on
``disaggregation.bootstrap_port``:

- ``GET /health``: ``{"status": "ok"}``.
- ``POST /register`` ``{"role": "prefill"|"decode", "rank": int, "endpoint": {...}}``: a rank
  registers its transfer endpoint (what ``TransferBackend.endpoint()`` returned).
- ``GET /endpoints?role=prefill``: ``{"endpoints": {"<rank>": endpoint}}``.
- ``POST /rooms/<room>`` ``{"dst_pages": [int, ...], "rank": int}``: a decode rank says where the
  KV of request ``room`` goes; the prefill scheduler takes it with ``take_room``. Or
  ``{"error": str}``: the decode server gave the room up (e.g. the two servers hold different
  models' KV); the prefill scheduler fails it with that message (``take_error``).

Only JSON is accepted (never pickle); malformed bodies get a 400 with the reason.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

from framework.disaggregation.base import ROLES

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
"""A room's page list for a long context is the largest body (a few hundred KiB)."""


class BadRequest(ValueError):
    """A malformed request body: answered with 400."""


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{name} must be an integer >= {minimum}")
    return value


def parse_registration(body: Any) -> tuple[str, int, dict[str, Any]]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - {"role", "rank", "endpoint"}
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
    role = body.get("role")
    if role not in ROLES:
        raise BadRequest(f"role must be one of {', '.join(ROLES)}")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, dict):
        raise BadRequest("endpoint must be a JSON object")
    return role, _int(body.get("rank"), "rank"), endpoint


def parse_room(body: Any) -> tuple[list[int], int]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if "error" in body:
        if not isinstance(body["error"], str):
            raise BadRequest("error must be a string")
        return [], -1
    pages = body.get("dst_pages")
    if not isinstance(pages, list) or not pages:
        raise BadRequest("dst_pages must be a non-empty list of page indices")
    return [_int(p, "dst_pages[]", 1) for p in pages], _int(body.get("rank", 0), "rank")


class BootstrapService:
    """Registered endpoints and posted rooms, served over HTTP from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, dict[int, dict[str, Any]]] = {role: {} for role in ROLES}
        self._rooms: dict[int, tuple[list[int], int]] = {}
        self._errors: dict[int, str] = {}
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="pd-bootstrap", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> BootstrapService:
        self._thread.start()
        logger.info("bootstrap service on port %d", self.port)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # waits for serve_forever to return: only when it runs
        self._server.server_close()

    # -- state (also used in-process by the prefill scheduler) -------------------------------

    def register(self, role: str, rank: int, endpoint: dict[str, Any]) -> None:
        with self._lock:
            self._endpoints[role][rank] = endpoint

    def endpoints(self, role: str) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self._endpoints[role])

    def post_room(self, room: int, dst_pages: list[int], rank: int) -> None:
        with self._lock:
            self._rooms[room] = (dst_pages, rank)

    def post_error(self, room: int, error: str) -> None:
        with self._lock:
            self._errors[room] = error

    def take_error(self, room: int) -> str | None:
        """Why the decode side gave ``room`` up (removed from the table), or None."""
        with self._lock:
            return self._errors.pop(room, None)

    def take_room(self, room: int) -> tuple[list[int], int] | None:
        """The destination posted for ``room`` (removed from the table), or None if not yet."""
        with self._lock:
            return self._rooms.pop(room, None)

    def clear_rooms(self) -> None:
        """Forget every posted destination (their decode peer is gone)."""
        with self._lock:
            self._rooms.clear()
            self._errors.clear()

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)


def _handler_for(service: BootstrapService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            logger.debug("bootstrap: " + format, *args)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            if "json" not in (self.headers.get("Content-Type") or ""):
                raise BadRequest("Content-Type must be application/json")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise BadRequest(f"the body is larger than {MAX_BODY_BYTES} bytes")
            try:
                return json.loads(self.rfile.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadRequest(f"the body is not valid JSON: {exc}") from None

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            url = urlparse(self.path)
            if url.path == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok"})
            elif url.path == "/endpoints":
                role = parse_qs(url.query).get("role", ["prefill"])[0]
                if role not in ROLES:
                    self._reply(HTTPStatus.BAD_REQUEST, {"error": f"role must be one of {', '.join(ROLES)}"})
                    return
                eps = service.endpoints(role)
                self._reply(HTTPStatus.OK, {"endpoints": {str(k): v for k, v in eps.items()}})
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {url.path}"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            path = urlparse(self.path).path
            try:
                if path == "/register":
                    service.register(*parse_registration(self._body()))
                elif path.startswith("/rooms/"):
                    try:
                        room = int(path.removeprefix("/rooms/"))
                    except ValueError:
                        raise BadRequest("the room must be an integer") from None
                    body = self._body()
                    pages, rank = parse_room(body)
                    if rank < 0:
                        service.post_error(room, body["error"])
                    else:
                        service.post_room(room, pages, rank)
                else:
                    self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})
                    return
            except BadRequest as exc:
                self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                return
            self._reply(HTTPStatus.OK, {"ok": True})

    return Handler


class BootstrapClient:
    """Talks to a prefill server's bootstrap service (JSON, bounded timeouts)."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.base = f"http://{host}:{port}"
        self._http = httpx.Client(base_url=self.base, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def register(self, role: str, rank: int, endpoint: dict[str, Any]) -> None:
        self._http.post("/register", json={"role": role, "rank": rank, "endpoint": endpoint}).raise_for_status()

    def endpoints(self, role: str = "prefill", timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        resp = self._http.get("/endpoints", params={"role": role}, **kwargs)
        resp.raise_for_status()
        return {int(k): v for k, v in resp.json()["endpoints"].items()}

    def post_room(self, room: int, dst_pages: list[int], rank: int = 0) -> None:
        self._http.post(f"/rooms/{room}", json={"dst_pages": dst_pages, "rank": rank}).raise_for_status()

    def post_error(self, room: int, error: str) -> None:
        self._http.post(f"/rooms/{room}", json={"error": error}).raise_for_status()
