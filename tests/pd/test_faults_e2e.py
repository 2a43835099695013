"""PD faults with real processes on CPU: a prefill server, a decode server (``nccl`` transfer
backend over gloo) and ``plugserve router`` on 127.0.0.1, with short timeouts.

- a transfer that stalls mid-pages (the test plugin's ``nccl_stalling`` backend) fails on
  both servers with "transfer timed out", frees everything, and both keep serving;
- a decode server killed with SIGKILL while transfers and decodes are in flight: every client
  (through the router, and straight to the prefill server) gets an error or its complete reply,
  never a hang; the router answers 502 fast while it is down; the prefill server frees every page
  and slot and serves again once a new decode server is up;
- the same for the prefill server killed mid-transfer, seen from the decode server;
- the router alone, in front of a slow prefill and a dead decode server: every request is a fast
  502, and the cancelled prefill requests leave no connection open in the router.

The three server tests share one cluster and leave it healthy (each restarts what it killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from framework.testing.tiny_models import save_tiny_model
from tests.server.conftest import COMMON, PLUGSERVE, Server, assert_no_leak, free_port, sse_events

pytestmark = pytest.mark.timeout(900)

KV = ["kv_cache.max_total_tokens=4096", "kv_cache.page_size=4", "scheduler.chunked_prefill_size=32"]
STALL_ROOMS = [901, 902, 903]
STALL_S = 4.0
# nccl_stalling: nccl plus fault injection, from tests/plugins/plugserve-fault-plugin.
PD = ["disaggregation.transfer_backend=nccl_stalling", "disaggregation.bootstrap_timeout_s=3",
      "disaggregation.transfer_timeout_s=2", "disaggregation.transfer_options.timeout_s=8",
      f"disaggregation.transfer_options.stall_rooms=[{','.join(map(str, STALL_ROOMS))}]",
      f"disaggregation.transfer_options.stall_s={STALL_S}"]
SLOW_STEP_S = 0.005
"""Each step of a request naming the fault plugin's ``slow_steps`` lasts at least this long, so a
900-token decode outlasts the seconds before a kill however fast the host runs the tiny model
(with ~2 ms steps the first requests had finished by then and no stream was cut mid-decode)."""
CALL_TIMEOUT_S = 60.0
"""Every client call's timeout; the tests assert that none hit it (a hang)."""


def spawn(args: list[str], log: Path, port: int) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen([PLUGSERVE, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(proc, port, log)


@dataclass
class Cluster:
    """Fixed ports, so a killed server restarts where the router and its peer expect it."""

    tmp: Path
    model: Path
    pd: list[str] = field(default_factory=lambda: list(PD))
    p_port: int = field(default_factory=free_port)
    d_port: int = field(default_factory=free_port)
    b_port: int = field(default_factory=free_port)
    r_port: int = field(default_factory=free_port)
    prefill: Server | None = None
    decode: Server | None = None
    router: Server | None = None

    def _base(self) -> list[str]:
        return ["serve", *COMMON, f"model.path={self.model}", *KV, *self.pd,
                "server.enable_custom_logit_processor=true"]

    def start_prefill(self) -> Server:
        self.prefill = spawn([*self._base(), f"server.port={self.p_port}", "disaggregation.mode=prefill",
                              f"disaggregation.bootstrap_port={self.b_port}"], self.tmp / "prefill.log", self.p_port)
        return self.prefill

    def start_decode(self) -> Server:
        self.decode = spawn([*self._base(), f"server.port={self.d_port}", "disaggregation.mode=decode",
                             "memory_pool.name=decode_prealloc"], self.tmp / "decode.log", self.d_port)
        return self.decode

    def start_router(self) -> Server:
        self.router = spawn(["router", "--prefill", f"http://127.0.0.1:{self.p_port}", str(self.b_port),
                             "--decode", f"http://127.0.0.1:{self.d_port}", "--port", str(self.r_port)],
                            self.tmp / "router.log", self.r_port)
        return self.router

    def start(self) -> Cluster:
        servers = [self.start_prefill(), self.start_decode(), self.start_router()]
        for s in reversed(servers):
            s.wait_healthy()
        return self

    def stop(self) -> None:
        for s in (self.router, self.decode, self.prefill):
            if s is not None:
                s.stop(timeout=20)

    def body(self, ids: list[int], max_new: int, room: int | None = None, slow: bool = False,
             **extra: Any) -> dict[str, Any]:
        b: dict[str, Any] = {"input_ids": ids, "sampling_params": {
            "temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_new}, **extra}
        if slow:
            b["custom_logit_processor"] = "slow_steps"
            b["sampling_params"]["custom_params"] = {"sleep_s": SLOW_STEP_S}
        if room is not None:  # straight to the servers, as the router would send it
            b.update(bootstrap_host="127.0.0.1", bootstrap_port=self.b_port, bootstrap_room=room)
        return b


def router_sockets(pid: int) -> int:
    """Open sockets of a process (Linux /proc)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return n


def kill_hard(server: Server, scheduler_pid: int) -> None:
    """SIGKILL the scheduler process (it holds the transfer link) and the HTTP process: a crash."""
    for pid in (scheduler_pid, server.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait(10)


@dataclass
class Outcome:
    """One client call: its status, the tokens it got, its error text, whether it timed out."""

    status: int | None = None
    ids: list[int] = field(default_factory=list)
    error: str = ""
    timed_out: bool = False
    complete: bool = False


def call(url: str, body: dict[str, Any], expect_tokens: int | None = None) -> Outcome:
    """POST /generate (streamed when ``body["stream"]``); never raises, never waits past the timeout."""
    out = Outcome()
    try:
        if body.get("stream"):
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=CALL_TIMEOUT_S) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = r.read().decode(errors="replace")
                    return out
                events = sse_events(r)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            done = [e for e in events if isinstance(e, dict) and "output_ids" in e]
            out.error = str(errors[0]["error"]) if errors else ""
            out.ids = done[-1]["output_ids"] if done else []
            out.complete = events[-1:] == ["[DONE]"] and not errors
        else:
            r = httpx.post(f"{url}/generate", json=body, timeout=CALL_TIMEOUT_S)
            out.status = r.status_code
            if r.status_code == 200:
                out.ids = r.json()["output_ids"]
                out.complete = True
            else:
                out.error = r.text
    except httpx.TimeoutException as exc:
        out.timed_out, out.error = True, repr(exc)
    except httpx.HTTPError as exc:  # the server itself died under this call: an error, not a hang
        out.error = f"{type(exc).__name__}: {exc}"
    if out.complete and expect_tokens is not None and len(out.ids) != expect_tokens:
        out.complete, out.error = False, f"{len(out.ids)} tokens, expected {expect_tokens}"
    return out


def eventually(check: Callable[[], None], timeout_s: float = 30.0) -> None:
    """Retry an assertion (a quarantine ends once the late sender has finished)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd-faults")
    c = Cluster(tmp, save_tiny_model(tmp / "model"))
    try:
        yield c.start()
    finally:
        c.stop()


PROMPT = list(range(30, 70))
LONG = 900
"""New tokens of the requests that should still be decoding when a server is killed."""


def reference(c: Cluster) -> list[int]:
    out = call(c.router.url, c.body(PROMPT, 6))
    assert out.complete, out
    return out.ids


def check_serves(c: Cluster, ref: list[int]) -> None:
    out = call(c.router.url, c.body(PROMPT, 6))
    assert out.complete and out.ids == ref, out


def test_stalled_transfer_times_out_on_both_servers(cluster: Cluster) -> None:
    c = cluster
    ref = reference(c)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(call, c.prefill.url, c.body(PROMPT, 6, room=903))
        d = pool.submit(call, c.decode.url, c.body(PROMPT, 6, room=903))
        p_out, d_out = p.result(), d.result()
    elapsed = time.monotonic() - start
    for out in (p_out, d_out):
        assert out.status == 503 and "transfer timed out" in out.error, out
    assert elapsed < STALL_S + 10, elapsed
    eventually(lambda: assert_no_leak(c.prefill))
    eventually(lambda: assert_no_leak(c.decode))
    assert reference(c) == ref  # both keep serving, over the same link


def test_decode_killed_mid_transfer(cluster: Cluster) -> None:
    c = cluster
    ref = reference(c)
    d_pid = c.decode.scheduler_pid()
    # More long requests than the decode KV holds at once (4096 tokens / ~940 each), so some are
    # still queued or decoding at the kill however fast this machine decodes the tiny model.
    with ThreadPoolExecutor(16) as pool:
        routed = [pool.submit(call, c.router.url, c.body(list(range(5 + i, 45 + i)), LONG, slow=True,
                                                          stream=i % 2 == 0), LONG) for i in range(12)]
        time.sleep(2.0)  # the routed requests decode (streams have their headers)
        direct_p = pool.submit(call, c.prefill.url, c.body(PROMPT, 6, room=901))  # stalls mid-pages
        direct_d = pool.submit(call, c.decode.url, c.body(PROMPT, 6, room=901))
        time.sleep(1.0)
        kill_hard(c.decode, d_pid)
        killed_at = time.monotonic()
        outs = [direct_p.result(), direct_d.result(), *(f.result() for f in routed)]
    assert not any(o.timed_out for o in outs), outs
    assert direct_p.result().status == 503, direct_p.result()  # the prefill server's client: an error
    assert not direct_d.result().complete
    for o in outs[2:]:  # through the router: a complete reply or an error, never a hang
        assert o.complete or o.error, o
    assert any(not o.complete for o in outs[2:]), "the kill hit no routed request"
    # a stream that was decoding ends with the router's error event, not a cut connection
    assert any(o.status == 200 and "died mid-stream" in o.error for o in outs[2::2]), outs
    assert time.monotonic() - killed_at < 30

    # while no decode server is up the router fails fast and clearly
    start = time.monotonic()
    down = call(c.router.url, c.body(PROMPT, 4))
    assert down.status == 502 and "decode" in down.error, down
    assert time.monotonic() - start < 10
    eventually(lambda: assert_no_leak(c.prefill))

    c.start_decode().wait_healthy()
    check_serves(c, ref)  # the first request after the restart already goes through
    assert_no_leak(c.prefill)
    assert_no_leak(c.decode)


def test_prefill_killed_mid_transfer(cluster: Cluster) -> None:
    c = cluster
    ref = reference(c)
    p_pid = c.prefill.scheduler_pid()
    with ThreadPoolExecutor(10) as pool:
        direct_p = pool.submit(call, c.prefill.url, c.body(PROMPT, 6, room=902))
        direct_d = pool.submit(call, c.decode.url, c.body(PROMPT, 6, room=902))  # stalls mid-pages
        routed = [pool.submit(call, c.router.url, c.body(list(range(7 + i, 47 + i)), 20, stream=i % 2 == 0),
                              20) for i in range(6)]
        time.sleep(1.5)  # the stalled room is mid-transfer, the routed ones queue behind it on the link
        kill_hard(c.prefill, p_pid)
        outs = [direct_p.result(), direct_d.result(), *(f.result() for f in routed)]
    assert not any(o.timed_out for o in outs), outs
    d_out = direct_d.result()
    assert d_out.status == 503 and "link" in d_out.error, d_out  # the decode server's client: an error
    for o in outs[2:]:
        assert o.complete or o.error, o

    start = time.monotonic()
    down = call(c.router.url, c.body(PROMPT, 4))
    assert down.status == 502 and "prefill" in down.error, down
    assert time.monotonic() - start < 10
    eventually(lambda: assert_no_leak(c.decode))

    c.start_prefill().wait_healthy()
    check_serves(c, ref)
    assert_no_leak(c.prefill)
    assert_no_leak(c.decode)


class _SlowPrefill(BaseHTTPRequestHandler):
    """Answers every POST after 3 s: the router cancels it long before."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(3)
        body = b'{"error": {"message": "too late"}}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_router_dead_decode_fails_fast_without_leaking_connections(tmp_path: Path) -> None:
    slow = ThreadingHTTPServer(("127.0.0.1", 0), _SlowPrefill)
    slow.daemon_threads = True
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    r_port = free_port()
    router = spawn(["router", "--prefill", f"http://127.0.0.1:{slow.server_address[1]}", "1",
                    "--decode", f"http://127.0.0.1:{free_port()}", "--port", str(r_port)], tmp_path / "r.log", r_port)
    try:
        deadline = time.monotonic() + 60
        while True:  # /health is 503 here (the decode is down): wait for any answer
            try:
                httpx.get(f"{router.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, router.log_text()
                time.sleep(0.3)
        for _ in range(30):
            start = time.monotonic()
            r = httpx.post(f"{router.url}/generate", json={"text": "a"}, timeout=CALL_TIMEOUT_S)
            assert r.status_code == 502 and "no decode server is reachable" in r.json()["error"]["message"], r.text
            assert time.monotonic() - start < 2.5
        time.sleep(0.5)
        assert router_sockets(router.proc.pid) < 10, "cancelled prefill requests left connections open"
    finally:
        router.stop(timeout=10)
        slow.shutdown()
        slow.server_close()
