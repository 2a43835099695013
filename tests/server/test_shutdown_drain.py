"""SIGTERM with requests still running past ``server.shutdown_timeout_s``: every open request ends
with a well-formed answer (a JSON 503 in OpenAI's shape; in a stream, the finish chunk with
reason abort, an error event and ``[DONE]``), an upload still arriving gets its 503 at once, and
the server exits 0 soon after the grace period.

Every request names the fault plugin's ``slow_steps`` logit processor, so each step takes at
least ``STEP_S``: 900 tokens then outlast the grace period on any host (on a fast one the tiny
model finished a plain request inside the window and got its 200)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import start_server

GRACE_S = 1.0
STEP_S = 0.01  # 900 steps >= 9 s, far past the grace period
SLOW = {"custom_logit_processor": "slow_steps", "custom_params": {"sleep_s": STEP_S}}
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0, **SLOW}


def _events(lines: list[str]) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_requests_past_the_grace_period_end_well_formed(tiny_model: Path,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tmp_path_factory.mktemp("drain"), [
        f"model.path={tiny_model}", "kv_cache.max_total_tokens=8192", f"server.shutdown_timeout_s={GRACE_S}",
        "server.log_level=info", "server.enable_custom_logit_processor=true"])
    results: dict[str, Any] = {}
    first_token = threading.Barrier(4, timeout=60)
    url = server.url

    def plain() -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "long plain", **LONG})
        results["plain"] = (r.status_code, r.json(), r.headers.get("content-type"))

    def stream(name: str, path: str, body: dict) -> None:
        lines: list[str] = []
        with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
            results[f"{name}_status"] = r.status_code
            for line in r.iter_lines():
                if line and not lines:
                    first_token.wait()
                lines.append(line)
        results[name] = _events(lines)

    threads = [
        threading.Thread(target=plain),
        threading.Thread(target=stream, args=("completion", "/v1/completions",
                                              {"model": "tiny-llama", "prompt": "long stream", **LONG})),
        threading.Thread(target=stream, args=("chat", "/v1/chat/completions",
                                              {"model": "tiny-llama", "messages": [{"role": "user", "content": "go"}],
                                               **LONG})),
        threading.Thread(target=stream, args=("generate", "/generate", {"text": "long generate", "sampling_params": {
            "max_new_tokens": 900, "ignore_eos": True, "temperature": 0}})),
    ]
    try:
        for t in threads:
            t.start()
        first_token.wait()  # every stream has its first event: all four are generating
        upload = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        upload.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 500\r\n\r\n{\"text\": ")
        time.sleep(0.3)
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        reply = b""
        while chunk := upload.recv(65536):
            reply += chunk
        upload_took = time.monotonic() - sigterm_at
        upload.close()
        for t in threads:
            t.join(60)
        code = server.proc.wait(60)
        exited_after = time.monotonic() - sigterm_at
    finally:
        server.stop()

    # The slow upload is refused at once, not after the grace period.
    assert reply.startswith(b"HTTP/1.1 503"), reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "server_shutting_down"
    assert upload_took < GRACE_S, upload_took

    status, body, content_type = results["plain"]
    assert status == 503 and content_type == "application/json", (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "server_shutting_down"

    for name in ("completion", "chat"):
        events = results[name]
        assert results[f"{name}_status"] == 200
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
        assert events[-3]["choices"][0]["finish_reason"] == "abort", events[-3:]
        assert sum(1 for e in events[:-2] if e["choices"][0]["finish_reason"] is not None) == 1
    events = results["generate"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
    assert events[-3]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < events[-3]["meta_info"]["completion_tokens"] < 900  # it was cut, not finished

    assert code == 0, server.log_text()
    assert exited_after < GRACE_S + 15, exited_after
    assert "ended with a 503" in server.log_text()
