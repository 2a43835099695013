"""``custom_logit_processor`` on a real server started with ``server.enable_custom_logit_processor=true``.

A request names the built-in ``disallowed_tokens`` processor. References nobody here wrote:
transformers' own greedy ``generate`` with ``suppress_tokens`` (its SuppressTokensLogitsProcessor
sets the same logits to -inf) on the served checkpoint, and, as an independent path through
plugserve, ``logit_bias`` -100 on the same ids. Refusals: an unknown name, SGLang's serialized
form and bad ``custom_params`` are 400s naming the field (the disabled switch is checked on the
main server, in test_api_surface.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from tests.server.conftest import engine_overrides, start_server

PROMPTS = [[5, 17, 42, 9, 88, 3], [100, 7, 7, 250, 31]]
NEW = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
BAN = "disallowed_tokens"


@pytest.fixture(scope="module")
def client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    server = start_server(tmp_path_factory.mktemp("clp"), [*engine_overrides(tiny_model),
                                                           "server.enable_custom_logit_processor=true"])
    try:
        with server.client() as c:
            yield c
        assert server.proc.poll() is None, server.log_text()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    model.generation_config.eos_token_id = None  # exactly NEW tokens, like ignore_eos
    return model


def _hf_greedy(model, prompt: list[int], suppress: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             suppress_tokens=suppress or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _generate(client: httpx.Client, body: dict) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_banned_tokens_never_appear_and_the_rest_is_unchanged(client: httpx.Client, hf_model) -> None:
    free = [r["output_ids"] for r in _generate(client, {"input_ids": PROMPTS, "sampling_params": GREEDY})]
    for prompt, out in zip(PROMPTS, free, strict=True):
        assert out == _hf_greedy(hf_model, prompt, [])
    # ban the first two distinct tokens each prompt generates: the outputs must change
    bans = [list(dict.fromkeys(out))[:2] for out in free]
    banned = _generate(client, {
        "input_ids": PROMPTS, "custom_logit_processor": BAN,
        "sampling_params": [{**GREEDY, "custom_params": {"token_ids": ban}} for ban in bans],
    })
    for prompt, out, base, ban in zip(PROMPTS, [r["output_ids"] for r in banned], free, bans, strict=True):
        assert len(out) == NEW and not set(out) & set(ban), (out, ban)
        first = min(base.index(t) for t in ban)
        assert out[:first] == base[:first]  # nothing changes before a banned token would have come
        assert out == _hf_greedy(hf_model, prompt, ban)
        bias = _generate(client, {"input_ids": prompt, "sampling_params": {
            **GREEDY, "logit_bias": {str(t): -100 for t in ban}}})
        assert out == bias["output_ids"]


def test_per_prompt_names_and_unaffected_neighbours(client: httpx.Client) -> None:
    free = [r["output_ids"] for r in _generate(client, {"input_ids": PROMPTS, "sampling_params": GREEDY})]
    ban = free[0][:1]
    mixed = _generate(client, {
        "input_ids": PROMPTS, "custom_logit_processor": [BAN, None],
        "sampling_params": [{**GREEDY, "custom_params": {"token_ids": ban}}, GREEDY],
    })
    assert ban[0] not in mixed[0]["output_ids"]
    assert mixed[1]["output_ids"] == free[1]  # its neighbour in the batch is left alone
    # the name may also sit inside sampling_params (plugserve's own form), and streams work
    inner = _generate(client, {"input_ids": PROMPTS[0], "sampling_params": {
        **GREEDY, "custom_logit_processor": BAN, "custom_params": {"token_ids": ban}}})
    assert inner["output_ids"] == mixed[0]["output_ids"]


def test_openai_routes_take_the_extra_body_fields(client: httpx.Client) -> None:
    base = _generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    ban = base["output_ids"][:2]
    want = _generate(client, {"input_ids": PROMPTS[0], "custom_logit_processor": BAN,
                              "sampling_params": {**GREEDY, "custom_params": {"token_ids": ban}}})
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": NEW,
                                             "temperature": 0.0, "ignore_eos": True, "custom_logit_processor": BAN,
                                             "custom_params": {"token_ids": ban}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want["text"] != base["text"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"custom_logit_processor": "no_such_processor"}, "custom_logit_processor", [BAN, "not a registered"]),
    ({"custom_logit_processor": '{"callable": "8004952c000000000000008c0864696c6c2e5f64696c6c"}'},
     "custom_logit_processor", ["never runs code", "dill", "register_logit_processors"]),
    ({"custom_logit_processor": BAN, "sampling_params": {"custom_params": {"token_ids": "3"}}}, "custom_params",
     ["token_ids"]),
    ({"custom_logit_processor": BAN, "sampling_params": {"custom_params": {"ids": [3]}}}, "custom_params",
     ["token_ids"]),
    ({"sampling_params": {"custom_params": {"token_ids": [3]}}}, "custom_params", ["custom_logit_processor"]),
])
def test_refusals_name_the_field(client: httpx.Client, body: dict, param: str, words: list[str]) -> None:
    r = client.post("/generate", json={"input_ids": PROMPTS[0], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    oai = {k: v for k, v in body.items() if k != "sampling_params"} | body.get("sampling_params", {})
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 2, **oai})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
