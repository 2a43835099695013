"""Fixtures for the HTTP server tests: real ``plugserve serve`` processes on 127.0.0.1.

The main server (session scope, started once) serves a tiny random Llama with a small KV budget,
an api_key and an admin_key, a 64 KiB body limit and small n / top-logprobs / queue limits, so
every limit can be hit cheaply. ``e2e`` wraps it per module and asserts the KV leak invariant
after the module's tests; the session teardown asserts it once more before stopping the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

PLUGSERVE = str(Path(sys.executable).with_name("plugserve"))
START_TIMEOUT_S = 240.0
"""Two interpreters importing torch on a busy 2-core machine can take a minute."""
API_KEY = "test-api-key"
ADMIN_KEY = "test-admin-key"
MAX_N = 4
MAX_TOP_LOGPROBS = 5
MAX_QUEUED = 16
MAX_BODY = 64 * 1024
KV_TOKENS = 4096
COMMON = ["device.num_threads=1", "server.log_level=warning", "server.shutdown_timeout_s=5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A ``plugserve serve`` subprocess and how to reach it."""

    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = None
    admin_key: str | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"plugserve serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"the server was not healthy after {START_TIMEOUT_S}s:\n{self.log_text()}")

    def scheduler_pid(self) -> int:
        return int(httpx.get(f"{self.url}/server_info", headers=self.headers(), timeout=30).json()["scheduler_pid"])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp: Path, overrides: list[str], api_key: str | None = None,
                 admin_key: str | None = None, new_session: bool = False, config_file: Path | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """Start ``plugserve serve`` (the real CLI) and wait until /health answers 200.

    ``new_session`` puts it in its own process group, so a test can send Ctrl-C's SIGINT to the
    whole group as a terminal does. ``env`` is added to this process's environment.
    """
    port = free_port()
    args = [*(["--config", str(config_file)] if config_file else []), *COMMON, f"server.port={port}", *overrides]
    if api_key:
        args.append(f"server.api_key={api_key}")
    if admin_key:
        args.append(f"server.admin_key={admin_key}")
    log = tmp / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen([PLUGSERVE, "serve", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)
    server = Server(proc, port, log, api_key, admin_key, overrides)
    server.wait_healthy()
    return server


def replicas(info: dict) -> list[dict]:
    """Every data-parallel replica's entry of a /server_info reply (pid, requests, load, leak report)."""
    return info.get("dp") or [info]


@contextlib.contextmanager
def served(tmp: Path, overrides: list[str], api_key: str | None = None,
           admin_key: str | None = None) -> Iterator[Server]:
    """A server for a block of tests (a module fixture's body): after them it must still live and
    have leaked nothing; it is stopped either way."""
    srv = start_server(tmp, overrides, api_key, admin_key)
    try:
        yield srv
        assert srv.proc.poll() is None, srv.log_text()
        assert_no_leak(srv)
    finally:
        srv.stop()


def wait_idle(server: Server, timeout: float = 30.0) -> dict:
    """/server_info once nothing runs, waits or is tracked by the HTTP process, on any replica."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(f"{server.url}/server_info", headers=server.headers(), timeout=30).json()
        if info["active_requests"] == 0 and all(r["num_requests"] == 0 for r in replicas(info)):
            return info
        time.sleep(0.1)
    raise AssertionError(f"the server did not go idle: {info.get('load')}, {info.get('active_requests')} active")


def assert_no_leak(server: Server) -> None:
    """The KV invariant once idle, on every replica: free + evictable + protected == total, every
    request row free."""
    for replica in replicas(wait_idle(server)):
        # every tensor-parallel rank's own KV too (each holds its own pages)
        for report in [replica["leak_report"], *replica["leak_report"].get("tp_ranks", [])]:
            assert report["free"] + report["evictable"] + report["protected"] == report["total"], replica
            assert report["held_by_requests"] == 0 and report["leaked"] == 0, replica
            assert report["req_slots_free"] == report["req_slots_total"], replica


def engine_overrides(model: Path) -> list[str]:
    """Overrides the main server runs with (the in-process Engine uses them too)."""
    return [f"model.path={model}", f"kv_cache.max_total_tokens={KV_TOKENS}"]


@pytest.fixture(scope="session")
def main_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    overrides = [
        *engine_overrides(tiny_model),
        f"server.max_n={MAX_N}",
        f"server.max_top_logprobs={MAX_TOP_LOGPROBS}",
        f"server.max_body_bytes={MAX_BODY}",
        f"scheduler.max_queued_requests={MAX_QUEUED}",
        # Off by default; on here so that every streamed request of the tests also runs the
        # scheduler's wait for its first token and the HTTP process's Delivered answer.
        "server.first_token_wait_ms=5",
    ]
    server = start_server(tmp_path_factory.mktemp("main-server"), overrides, API_KEY, ADMIN_KEY)
    try:
        yield server
        assert server.proc.poll() is None, f"the server died during the tests:\n{server.log_text()}"
        assert_no_leak(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def e2e(main_server: Server) -> Iterator[Server]:
    """The main server; after this module's tests, nothing is leaked and the server still lives."""
    yield main_server
    assert main_server.proc.poll() is None, f"the server died:\n{main_server.log_text()}"
    assert_no_leak(main_server)


@pytest.fixture(scope="module")
def http(e2e: Server) -> Iterator[httpx.Client]:
    with e2e.client() as client:
        yield client


@pytest.fixture(scope="module")
def oai(e2e: Server):  # -> openai.OpenAI
    import openai

    with openai.OpenAI(base_url=f"{e2e.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, with the final ``[DONE]`` as the string "[DONE]"."""
    import json

    events: list = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
