"""Images through prefill/decode disaggregation on CPU: a prefill server, a decode server (both the
tiny Qwen2-VL, ``nccl`` transfer backend over gloo) and ``plugserve router`` on 127.0.0.1.

The prefill server encodes the images; the decode server's scheduler receives no pixels at all
(its HTTP process keeps them: only the spans and positions go down), so had it run the vision
encoder it would have failed. It decodes with the KV and the M-RoPE position delta that came with
it. Greedy tokens equal the unified Engine's, for image, two-image and text-only requests, and
neither server leaks a page or a request slot."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from framework import Engine
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER
from tests.multimodal.test_serve_images import png
from tests.pd.test_router_e2e import KV, start_pd_router, start_pd_servers
from tests.server.conftest import assert_no_leak

pytestmark = pytest.mark.timeout(400)

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
CASES = [  # (text, indices into the `images` fixture)
    ("Look: " + IMAGE_PLACEHOLDER + " says", [1]),
    ("Two " + IMAGE_PLACEHOLDER + " and " + IMAGE_PLACEHOLDER + " differ in", [0, 2]),
    ("A long text-only prompt that spans more than one prefill chunk of thirty-two tokens, surely.", []),
    (IMAGE_PLACEHOLDER + "first, then words", [2]),
]


@pytest.fixture(scope="module")
def reference(qwen2_vl_model: Path, images: list[Any]) -> list[list[int]]:
    engine = Engine(overrides=[f"model.path={qwen2_vl_model}", *KV, "device.num_threads=1"], progress=False)
    try:
        return [engine.generate(text, GREEDY, image_data=[images[i] for i in which] or None)["output_ids"]
                for text, which in CASES]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def cluster(qwen2_vl_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pd-vl")
    prefill, decode, b_port = start_pd_servers(tmp, qwen2_vl_model, "nccl")
    router = start_pd_router(tmp, prefill, decode, b_port)
    servers = [prefill, decode, router]
    try:
        for s in reversed(servers):
            s.wait_healthy()
        yield prefill, decode, router
    finally:
        for s in servers:
            s.stop(timeout=20)


def test_images_through_the_router_match_unified_and_leak_nothing(cluster, images, reference):
    prefill, decode, router = cluster

    def call(k: int) -> list[int]:
        text, which = CASES[k]
        data = [base64.b64encode(png(images[i])).decode() for i in which]
        r = httpx.post(f"{router.url}/generate", json={"text": text, "sampling_params": GREEDY,
                                                        "image_data": data or None}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(CASES)) as pool:
        got = list(pool.map(call, range(len(CASES))))
    assert got == reference
    assert call(0) == reference[0]  # again: the prefill server's prefix cache holds the image now

    # the OpenAI chat route through the router, image as a data URL
    url = f"data:image/png;base64,{base64.b64encode(png(images[1])).decode()}"
    r = httpx.post(f"{router.url}/v1/chat/completions", json={
        "model": "model", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  {"type": "image_url", "image_url": {"url": url}}]}]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    time.sleep(0.5)
    assert_no_leak(prefill)
    assert_no_leak(decode)
