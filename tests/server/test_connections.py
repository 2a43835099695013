"""Connection limits on a server with short timeouts and a small connection cap: idle,
slow-header and slow-body connections are closed (408 where a request was started), a connection
past the cap gets a 503, malformed HTTP gets a 400 in the API's error shape; keys come from the
environment and the config file; one client's big batch does not hold back a request that comes
after it (fair admission).

Every test runs against both HTTP stacks a server can have (``server.http_parser`` and
``server.event_loop``): httptools on uvloop, the default where they are installed, and h11 on
asyncio's loop, the fallback."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, assert_no_leak, start_server
from tests.server.test_errors import assert_error

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 6
ENV_API_KEY = "key-from-the-environment"
FILE_ADMIN_KEY = "admin-key-from-the-config-file"


HTTP_STACKS = {"httptools": "uvloop", "h11": "asyncio"}
"""``server.http_parser`` -> the ``server.event_loop`` it is tested on."""


@pytest.fixture(scope="module", params=sorted(HTTP_STACKS))
def guarded(request: pytest.FixtureRequest, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    parser = request.param
    tmp = tmp_path_factory.mktemp(f"guarded-{parser}")
    config = tmp / "keys.yaml"
    config.write_text(f"server:\n  admin_key: {FILE_ADMIN_KEY}\n")
    server = start_server(tmp, [
        f"model.path={tiny_model}", "kv_cache.max_total_tokens=4096",
        f"server.header_read_timeout_s={HEADER_TIMEOUT_S}", f"server.body_read_timeout_s={BODY_TIMEOUT_S}",
        f"server.keep_alive_timeout_s={KEEP_ALIVE_S}", f"server.max_connections={MAX_CONNECTIONS}",
        "scheduler.max_running_requests=2", "server.enable_custom_logit_processor=true",
        f"server.http_parser={parser}", f"server.event_loop={HTTP_STACKS[parser]}",
    ], config_file=config, env={"PLUGSERVE_API_KEY": ENV_API_KEY})
    server.api_key, server.admin_key = ENV_API_KEY, FILE_ADMIN_KEY
    info = httpx.get(f"{server.url}/server_info", headers={"Authorization": f"Bearer {ENV_API_KEY}"}, timeout=30)
    assert info.json()["http_stack"] == {"http_parser": parser, "event_loop": HTTP_STACKS[parser]}, info.text
    yield server
    assert_no_leak(server)
    server.stop()


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def _read_all(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything until the server closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(within)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _trickle(server: Server, head: bytes, pieces: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """Send ``head``, then ``pieces`` one every ``gap_s``; what the server answered until it
    closed, and how long after the trickle started."""
    with _connect(server) as sock:
        if head:
            sock.sendall(head)
        start = time.monotonic()
        try:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(gap_s)
        except OSError:
            pass  # the server closed on us: what the caller asserts
        data, _ = _read_all(sock, within=30)
        return data, time.monotonic() - start


def _json_status(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_idle_connection_is_closed(guarded: Server) -> None:
    with _connect(guarded) as sock:
        data, took = _read_all(sock, within=30)
    assert data == b"" and took < HEADER_TIMEOUT_S + 5, took


def test_slow_headers_get_408_and_close(guarded: Server) -> None:
    lines = [b"POST /generate HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Type: application/json\r\n",
             b"X-Slow: 1\r\n", b"X-Slow: 2\r\n", b"X-Slow: 3\r\n"]
    data, took = _trickle(guarded, b"", lines, gap_s=0.6)  # never complete within the header deadline
    status, body = _json_status(data)
    assert status == 408 and body["error"]["code"] == "request_timeout", data
    assert took < HEADER_TIMEOUT_S + 5


def test_slow_body_gets_408_and_close(guarded: Server) -> None:
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + ENV_API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
    data, took = _trickle(guarded, head, [b" "] * 10, gap_s=0.5)  # a byte every 0.5 s
    status, body = _json_status(data)
    assert status == 408 and body["error"]["code"] == "request_timeout", data
    assert took < BODY_TIMEOUT_S + 5


def test_idle_keep_alive_connection_is_closed(guarded: Server) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = _read_all(sock, within=30)  # the response, then the close after keep-alive
    assert data.startswith(b"HTTP/1.1 200") and took < KEEP_ALIVE_S + 5, (data, took)


def test_connection_past_the_cap_gets_503(guarded: Server) -> None:
    time.sleep(KEEP_ALIVE_S + 0.5)  # connections of earlier tests are gone
    held = [_connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with httpx.Client(base_url=guarded.url, timeout=30) as client:
            r = client.get("/health")
        assert_error(r, 503, code="too_many_connections")
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{guarded.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("request_bytes", [
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GARBAGE\r\n\r\n",
], ids=["bad content-length", "bad chunk size", "NUL in path", "no request line"])
def test_malformed_http_gets_a_json_400_and_close(guarded: Server, request_bytes: bytes) -> None:
    with _connect(guarded) as sock:
        sock.sendall(request_bytes)
        data, _ = _read_all(sock, within=30)
    status, body = _json_status(data)
    assert status == 400 and body["error"]["code"] == "invalid_http", data
    assert set(body["error"]) == {"message", "type", "param", "code"}
    head = data.partition(b"\r\n\r\n")[0].lower()
    assert b"content-type: application/json" in head and b"connection: close" in head, data


def test_a_stream_left_before_its_first_token_is_aborted(guarded: Server) -> None:
    """The response waits for the first token before it sends headers (a refused request gets its
    status code): a client that gives up meanwhile must still end the request and free its KV."""
    body = {"text": "left early", "stream": True, "custom_logit_processor": "slow_steps",
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True, "custom_params": {"sleep_s": 1.0}}}
    with httpx.Client(base_url=guarded.url, headers=guarded.headers(), timeout=httpx.Timeout(30, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):  # no headers within 0.3 s: the first token takes >= 1
            with client.stream("POST", "/generate", json=body) as r:
                r.read()
    deadline = time.monotonic() + 15  # left running it would take 100 s
    while True:  # aborted at the first step boundary after the disconnect
        load = httpx.get(f"{guarded.url}/get_load", headers=guarded.headers(), timeout=30).json()[0]
        if load["num_running"] == 0 and load["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.05)
    assert_no_leak(guarded)


def test_keys_from_the_environment_and_the_config_file(guarded: Server) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        assert_error(client.post("/generate", json=body), 401)
        ok = client.post("/generate", json=body, headers={"Authorization": f"Bearer {ENV_API_KEY}"})
        assert ok.status_code == 200, ok.text
        assert_error(client.post("/flush_cache", headers={"Authorization": f"Bearer {ENV_API_KEY}"}), 401)
        flushed = client.post("/flush_cache", headers={"Authorization": f"Bearer {FILE_ADMIN_KEY}"})
        assert flushed.status_code == 200, flushed.text
        info = client.get("/server_info", headers={"Authorization": f"Bearer {ENV_API_KEY}"}).json()
    assert info["config"]["server"]["api_key"] == "<redacted>" == info["config"]["server"]["admin_key"]


def test_a_big_batch_does_not_hold_back_a_later_request(guarded: Server) -> None:
    """With two running slots, a batch of 16 sequences runs in 8 rounds; the single request sent
    after it is admitted at the first free slot (fcfs alone would queue it behind all 16)."""
    done: dict[str, float] = {}
    headers = guarded.headers()
    tokens = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}
    # The fault plugin's slow_steps keeps each of the batch's steps >= 10 ms, so its 8 rounds last
    # >= 3.8 s: on a fast host the tiny model would otherwise finish all 16 before the poll below
    # sees them queued (CI saw the batch end first and the poll run out its deadline).
    slow = {**tokens, "custom_params": {"sleep_s": 0.01}}

    def batch() -> None:
        r = httpx.post(f"{guarded.url}/generate", headers=headers, timeout=120,
                       json={"text": [f"batch prompt {i}" for i in range(16)], "sampling_params": slow,
                             "custom_logit_processor": "slow_steps"})
        assert r.status_code == 200, r.text
        done["batch"] = time.monotonic()

    thread = threading.Thread(target=batch)
    thread.start()
    deadline = time.monotonic() + 30
    queued = False
    while not queued and time.monotonic() < deadline:  # the batch is queued and running
        load = httpx.get(f"{guarded.url}/get_load", headers=headers, timeout=30).json()[0]
        queued = load["num_waiting"] >= 8
        if not queued:
            time.sleep(0.02)
    single = httpx.post(f"{guarded.url}/generate", headers=headers, timeout=120,
                        json={"text": "a later client", "sampling_params": tokens})
    done["single"] = time.monotonic()
    thread.join(120)
    assert queued, f"the batch was never seen queued (last load: {load})"
    assert single.status_code == 200
    assert done["single"] < done["batch"], "the later request waited for the whole batch"
