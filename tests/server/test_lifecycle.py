"""Process lifecycle: the embedded default model serves text with no model.path; SIGTERM stops the
server and its scheduler process; a dead scheduler means 503 at once and a non-zero exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import Server, sse_events, start_server


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No model.path: conf/serve.yaml's embedded tiny-shakespeare model (a small KV budget keeps
    # the CPU memory use of the test low).
    server = start_server(tmp_path_factory.mktemp("default-model"), ["kv_cache.max_total_tokens=2048"])
    yield server
    server.stop()


def test_embedded_default_model_gives_text(default_server: Server) -> None:
    with default_server.client() as client:
        info = client.get("/model_info").json()
        assert info["served_model_name"] == "tiny-shakespeare"
        body = client.post("/generate", json={"text": "ROMEO:", "sampling_params": {"max_new_tokens": 24,
                                                                                       "temperature": 0.0}}).json()
        assert body["meta_info"]["completion_tokens"] > 0
        assert body["text"].strip(), body
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny-shakespeare", "messages": [{"role": "user", "content": "Speak, friend."}],
            "max_tokens": 16, "temperature": 0.0,
        }).json()
        assert chat["choices"][0]["message"]["content"] is not None


def test_sigterm_stops_server_and_scheduler(default_server: Server) -> None:
    scheduler_pid = default_server.scheduler_pid()
    assert not _gone(scheduler_pid, timeout=0)
    default_server.proc.send_signal(signal.SIGTERM)
    assert default_server.proc.wait(60) == 0, default_server.log_text()
    assert _gone(scheduler_pid), f"scheduler process {scheduler_pid} outlived the server"


def test_ctrl_c_to_the_process_group_stops_everything(tiny_model, tmp_path_factory) -> None:
    server = start_server(tmp_path_factory.mktemp("ctrl-c"), [f"model.path={tiny_model}",
                                                              "kv_cache.max_total_tokens=2048"], new_session=True)
    try:
        scheduler_pid = server.scheduler_pid()
        os.killpg(server.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        assert server.proc.wait(60) == 0, server.log_text()
        assert _gone(scheduler_pid), f"scheduler process {scheduler_pid} outlived the server"
    finally:
        server.stop()


def test_scheduler_death_is_503_and_nonzero_exit(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tmp_path_factory.mktemp("doomed"), [f"model.path={tiny_model}",
                                                              "kv_cache.max_total_tokens=2048"])
    try:
        scheduler_pid = server.scheduler_pid()
        events: list = []
        waiting: list = []
        long = {"max_new_tokens": 900, "ignore_eos": True}

        def stream() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                with c.stream("POST", "/generate", json={"text": "x", "stream": True, "sampling_params": long}) as r:
                    events.extend(sse_events(r))

        def blocking() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                waiting.append(c.post("/generate", json={"text": "y", "sampling_params": long}))

        threads = [threading.Thread(target=stream), threading.Thread(target=blocking)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if httpx.get(f"{server.url}/get_load", timeout=10).json()[0]["num_running"] >= 2:
                break
            time.sleep(0.05)
        os.kill(scheduler_pid, signal.SIGKILL)
        killed = time.monotonic()
        status = None
        while status != 503 and time.monotonic() - killed < 0.8:
            status = httpx.get(f"{server.url}/health", timeout=2).status_code
        assert status == 503
        for t in threads:
            t.join(30)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "scheduler_dead", events[-2:]
        assert waiting and waiting[0].status_code == 503
        assert waiting[0].json()["error"]["code"] == "scheduler_dead"
        assert server.proc.wait(60) != 0
    finally:
        server.stop()
