"""RL routes of a real ``plugserve serve`` on 127.0.0.1: admin key, release/resume with 503s
in between, a trainer process (this test process) pushing new weights over a gloo group in chunks,
weight updates from tensors and from disk, reads by name, pause and continue."""

from __future__ import annotations

import base64
import concurrent.futures as cf
from collections.abc import Iterator

import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file

from framework.executor.weight_sync import WeightUpdateGroup
from framework.scheduler.rollout import tensors_to_bytes
from tests.rl.conftest import GREEDY, PROMPTS, hf_greedy
from tests.server.conftest import ADMIN_KEY, API_KEY, Server, free_port, served


@pytest.fixture(scope="module")
def server(rl_models, tmp_path_factory) -> Iterator[Server]:
    with served(tmp_path_factory.mktemp("rl-server"),
                [f"model.path={rl_models[0]}", "kv_cache.max_total_tokens=4096"], API_KEY, ADMIN_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf_outputs(rl_models):
    return [hf_greedy(transformers.LlamaForCausalLM.from_pretrained(p).eval(), PROMPTS) for p in rl_models]


def admin(server: Server, path: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(admin=True), timeout=timeout)


def generate(server: Server, prompts=PROMPTS) -> list[list[int]]:
    r = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, "sampling_params": GREEDY},
                   headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def test_routes_need_the_admin_key(server):
    for path in ("/release_memory_occupation", "/update_weights_from_disk", "/pause_generation",
                 "/get_weights_by_name"):
        r = httpx.post(f"{server.url}{path}", json={}, headers=server.headers(), timeout=30)
        assert r.status_code == 401, (path, r.text)
    # The big-body limit of weight updates is the admin's alone; others get the usual limit.
    big = b'{"serialized_named_tensors": ["' + b"A" * (5 << 20) + b'"]}'
    r = httpx.post(f"{server.url}/update_weights_from_tensor", content=big, timeout=30,
                   headers={**server.headers(), "content-type": "application/json"})
    assert r.status_code == 413 and "server.max_body_bytes" in r.text, r.text


def test_release_then_503_then_resume(server, hf_outputs):
    assert generate(server) == hf_outputs[0]
    r = admin(server, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    r = httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": GREEDY},
                   headers=server.headers(), timeout=30)
    assert r.status_code == 503 and "released" in r.json()["error"]["message"], r.text
    r = admin(server, "/release_memory_occupation", {"tags": ["weight"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    r = admin(server, "/resume_memory_occupation", {})
    assert r.status_code == 200 and r.json()["released_tags"] == [], r.text
    assert generate(server) == hf_outputs[0]


def _distributed_update(server: Server, group: WeightUpdateGroup, named: list[tuple[str, torch.Tensor]],
                        shapes: list[list[int]] | None = None) -> httpx.Response:
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": shapes or [list(t.shape) for _, t in named], "group_name": "rl-test"}
    with cf.ThreadPoolExecutor(1) as pool:  # the route blocks until the broadcast is received
        call = pool.submit(admin, server, "/update_weights_from_distributed", body)
        group.broadcast([t for _, t in named], src=0)
        return call.result()


def test_trainer_broadcast_in_chunks(server, rl_models, hf_outputs):
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "rl-test", "backend": "gloo"}
    with cf.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(admin, server, "/init_weights_update_group", init)
        group = WeightUpdateGroup("127.0.0.1", port, 0, 2, "rl-test", "gloo", timeout_s=120)
        assert joined.result().status_code == 200, joined.result().text
    try:
        state = load_file(str(rl_models[1] / "model.safetensors"))
        names = sorted(state)
        for i in range(0, len(names), 10):
            r = _distributed_update(server, group, [(n, state[n]) for n in names[i:i + 10]])
            assert r.status_code == 200, r.text
        assert generate(server) == hf_outputs[1]
        # A chunk with one wrong shape: received in full (the broadcast completes), refused by name,
        # and none of it is applied.
        old = load_file(str(rl_models[0] / "model.safetensors"))
        bad = [("model.layers.0.mlp.down_proj.weight", old["model.layers.0.mlp.down_proj.weight"]),
               ("model.layers.0.mlp.up_proj.weight", torch.zeros(8, 8))]
        r = _distributed_update(server, group, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model.layers.0.mlp.up_proj.weight", r.text
        assert generate(server) == hf_outputs[1]
    finally:
        admin(server, "/destroy_weights_update_group", {"group_name": "rl-test"})
        group.close()


def test_update_from_tensor_and_disk(server, rl_models, hf_outputs):
    state = load_file(str(rl_models[0] / "model.safetensors"))
    blob = base64.b64encode(tensors_to_bytes(list(state.items()))).decode()
    r = admin(server, "/update_weights_from_tensor", {"serialized_named_tensors": [blob], "weight_version": "v0"})
    assert r.status_code == 200 and r.json()["weight_version"] == "v0", r.text
    assert generate(server) == hf_outputs[0]
    r = admin(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "serialized_named_tensors", r.text
    r = admin(server, "/update_weights_from_disk", {"model_path": str(rl_models[1]), "typo": 1})
    assert r.status_code == 400, r.text
    r = admin(server, "/update_weights_from_disk", {"model_path": str(rl_models[1] / "nope")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
    r = admin(server, "/update_weights_from_disk", {"model_path": str(rl_models[1])})
    assert r.status_code == 200 and r.json()["flushed_cache"], r.text
    assert generate(server) == hf_outputs[1]
    r = admin(server, "/get_weights_by_name", {"name": "model.layers.1.self_attn.v_proj.weight", "truncate_size": 20})
    new = load_file(str(rl_models[1] / "model.safetensors"))
    assert r.status_code == 200 and r.json() == new["model.layers.1.self_attn.v_proj.weight"].flatten()[:20].tolist()


def test_pause_in_place_holds_requests_until_continue(server, hf_outputs, rl_models):
    admin(server, "/update_weights_from_disk", {"model_path": str(rl_models[0])})
    r = admin(server, "/pause_generation", {"mode": "in_place"})
    assert r.status_code == 200, r.text
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, server)
        with pytest.raises(cf.TimeoutError):
            pending.result(timeout=2)  # held while paused
        assert admin(server, "/continue_generation", {}).status_code == 200
        assert pending.result(timeout=120) == hf_outputs[0]
    r = admin(server, "/pause_generation", {"mode": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
