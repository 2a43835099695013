"""Tensor parallelism through ``plugserve serve``: two ranks behind a real server give the
in-process single-rank Engine's outputs; a killed rank takes the server down with an error naming
it and leaves no process behind; two "hosts" (two ``plugserve serve`` on one machine, nnodes 2)
form one group."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from framework import Engine
from tests.engine.test_engine_vs_hf import MAX_NEW, make_prompts
from tests.server.conftest import assert_no_leak, free_port, start_server

GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
BASE = ["kv_cache.max_total_tokens=2048"]


@pytest.fixture(scope="module")
def reference(tiny_model):
    import transformers

    prompts = make_prompts(transformers.AutoConfig.from_pretrained(tiny_model).vocab_size)
    eng = Engine(overrides=[f"model.path={tiny_model}", *BASE, "device.num_threads=1"], progress=False)
    outputs = [r["output_ids"] for r in eng.generate(prompts, GREEDY)]
    eng.close()
    return prompts, outputs


def generate(url: str, prompts: list[list[int]]) -> list[list[int]]:
    r = httpx.post(f"{url}/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_tp2_server_equals_engine_and_a_dead_rank_stops_it(tiny_model, tmp_path, reference):
    prompts, expected = reference
    server = start_server(tmp_path, [f"model.path={tiny_model}", *BASE, "parallel.tp_size=2"])
    try:
        assert generate(server.url, prompts) == expected
        assert_no_leak(server)
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        ranks = {int(r): pid for r, pid in info["tp_ranks"].items()}
        assert sorted(ranks) == [0, 1] and info["model_info"]["tp_size"] == 2
        os.kill(ranks[1], signal.SIGKILL)
        code = server.proc.wait(60)
        assert code != 0
        log = server.log.read_text()
        assert "tensor-parallel rank 1" in log, log[-3000:]
        assert wait_gone(list(ranks.values())) == []  # no orphan rank
    finally:
        server.stop()


def test_two_nodes_form_one_group(tiny_model, tmp_path, reference):
    prompts, expected = reference
    port = free_port()
    group = ["parallel.tp_size=2", "parallel.nnodes=2", f"parallel.dist_init_addr=127.0.0.1:{port}"]
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "node1.log"
    plugserve = str(Path(sys.executable).with_name("plugserve"))
    with open(log, "wb") as out:  # "host" 1: no HTTP server, only its rank
        node1 = subprocess.Popen([plugserve, "serve", f"model.path={tiny_model}", *BASE, "device.num_threads=1",
                                  "server.log_level=warning", *group, "parallel.node_rank=1"],
                                 stdout=out, stderr=subprocess.STDOUT)
    server = start_server(tmp_path, [f"model.path={tiny_model}", *BASE, *group])
    try:
        assert generate(server.url, prompts) == expected
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        assert list(info["tp_ranks"]) == ["0"]  # rank 1 runs on the other "host"
    finally:
        assert server.stop() == 0
        try:
            assert node1.wait(60) == 0, log.read_text()[-3000:]  # rank 0's close reached it
        finally:
            if node1.poll() is None:
                node1.kill()
