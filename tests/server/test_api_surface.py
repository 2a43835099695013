"""API surface on the main server: tokenize/detokenize, model card, info aliases, the model path as
the model name, logit_bias, priority and SGLang's /generate fields.

References nobody here wrote: the Hugging Face tokenizer of the served checkpoint, transformers'
chat template rendering, and the real ``openai`` client's error classes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

MODEL = "tiny-llama"
TEXT = "To be, or not to be: that is the question"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def hf_tok(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


# -- tokenize / detokenize ---------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/tokenize", "/tokenize"])
def test_tokenize_prompt_matches_the_hf_tokenizer(http: httpx.Client, hf_tok, route: str) -> None:
    body = http.post(route, json={"model": MODEL, "prompt": TEXT}).json()
    expected = hf_tok.encode(TEXT)
    assert body == {"tokens": expected, "count": len(expected), "max_model_len": 1024}
    plain = http.post(route, json={"prompt": TEXT, "add_special_tokens": False,
                                   "return_token_strs": True}).json()
    assert plain["tokens"] == hf_tok.encode(TEXT, add_special_tokens=False)
    assert plain["token_strs"] == hf_tok.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_a_batch_of_prompts(http: httpx.Client, hf_tok) -> None:
    prompts = [TEXT, "a", "whether 'tis nobler"]
    body = http.post("/v1/tokenize", json={"prompt": prompts}).json()
    assert body["tokens"] == [hf_tok.encode(p) for p in prompts]
    assert body["count"] == [len(hf_tok.encode(p)) for p in prompts]


def test_tokenize_chat_messages_matches_the_chat_template(http: httpx.Client, hf_tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    body = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages}).json()
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf_tok.encode(expected, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) > 0
    no_prompt = http.post("/v1/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt["tokens"] == hf_tok.encode(rendered, add_special_tokens=False)


def test_the_count_is_the_prompt_length_a_completion_sees(oai, http: httpx.Client) -> None:
    count = http.post("/v1/tokenize", json={"prompt": TEXT}).json()["count"]
    done = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, **GREEDY)
    assert done.usage.prompt_tokens == count


@pytest.mark.parametrize("route", ["/v1/detokenize", "/detokenize"])
def test_detokenize_matches_the_hf_tokenizer(http: httpx.Client, hf_tok, route: str) -> None:
    ids = hf_tok.encode(TEXT)
    body = http.post(route, json={"model": MODEL, "tokens": ids}).json()
    assert body == {"prompt": hf_tok.decode(ids), "text": hf_tok.decode(ids)}
    skipped = http.post(route, json={"tokens": ids, "skip_special_tokens": True}).json()
    assert skipped["text"] == hf_tok.decode(ids, skip_special_tokens=True)
    batch = http.post(route, json={"tokens": [ids, ids[:3]]}).json()
    assert batch["text"] == [hf_tok.decode(ids), hf_tok.decode(ids[:3])]


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("/v1/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": []}, 400, "prompt"),
    ("/v1/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/tokenize", {"prompt": "x", "add_special_token": True}, 400, "add_special_token"),
    ("/v1/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [[1], [-1]]}, 400, "tokens.1"),
    ("/v1/detokenize", {}, 400, "tokens"),
])
def test_tokenizer_routes_refuse_bad_input(http: httpx.Client, route: str, body: dict, status: int,
                                           param: str) -> None:
    r = http.post(route, json=body)
    assert r.status_code == status, r.text
    assert _error(r)["param"] == param, r.text


def test_tokenizer_routes_need_the_api_key(e2e) -> None:
    r = httpx.post(f"{e2e.url}/v1/tokenize", json={"prompt": "x"})
    assert r.status_code == 401


# -- models and info ---------------------------------------------------------------------------


def test_retrieve_model_with_the_openai_client(oai) -> None:
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == oai.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_retrieve_model_by_its_path(http: httpx.Client, tiny_model: Path) -> None:
    r = http.get(f"/v1/models/{tiny_model}")
    assert r.status_code == 200 and r.json()["id"] == MODEL
    assert http.get(f"/v1/models/{tiny_model}-x").status_code == 404


def test_sglang_info_aliases(http: httpx.Client) -> None:
    assert http.get("/get_model_info").json() == http.get("/model_info").json()
    info, alias = http.get("/server_info").json(), http.get("/get_server_info").json()
    assert set(info) == set(alias) and alias["config"] == info["config"]
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/get_model_info", "/get_server_info", "/v1/tokenize", "/v1/detokenize"} <= set(paths)


def test_the_scheduler_process_keeps_freed_blocks(http: httpx.Client) -> None:
    """``device.cpu_keep_freed_memory``'s auto is on in a scheduler process plugserve runs (an
    Engine in the test process leaves it off: tests/memory/test_heap.py)."""
    assert http.get("/server_info").json()["model_info"]["cpu_keep_freed_memory"] is True


def test_the_scheduler_process_warmed_its_gemms(http: httpx.Client) -> None:
    """``device.cpu_gemm_warmup``'s auto is on in a scheduler process plugserve runs: it called each
    distinct packed layer (the tiny Llama's four block projections and its LM head) at every row
    bucket before the server said it was ready (tests/engine/test_gemm_warmup.py checks what that
    leaves for oneDNN to build)."""
    warm = http.get("/server_info").json()["model_info"]["cpu_gemm_warmup"]
    assert warm is not None and warm["layers"] == 5 and warm["complete"] and warm["calls"] >= 4 * 8


def test_both_server_processes_froze_their_startup_objects(http: httpx.Client) -> None:
    """The HTTP process and the scheduler moved what they loaded at startup (torch, transformers,
    the model: hundreds of thousands of objects) out of the garbage collector's full collections
    (framework/memory/gc_freeze.py); an unfrozen process reports 0."""
    info = http.get("/server_info").json()
    assert info["http_gc_frozen_objects"] > 10_000
    assert info["gc_frozen_objects"] > 10_000


def test_the_model_path_is_accepted_as_the_model_name(oai, tiny_model: Path) -> None:
    by_path = oai.completions.create(model=str(tiny_model), prompt=TEXT, max_tokens=4, **GREEDY)
    by_name = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, **GREEDY)
    assert by_path.choices[0].text == by_name.choices[0].text
    assert by_path.model == MODEL  # responses always name the served model
    chat = oai.chat.completions.create(model=f"{tiny_model}/", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert chat.model == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model=f"{tiny_model}-other", prompt=TEXT, max_tokens=1)


# -- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_plus_100_forces_a_token(oai, hf_tok) -> None:
    token = hf_tok.encode(" the", add_special_tokens=False)[0]
    out = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=1.0, seed=3,
                                 logit_bias={str(token): 100})
    assert out.choices[0].text == hf_tok.decode([token] * 6)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}], max_tokens=3,
                                       logit_bias={str(token): 100})
    assert chat.choices[0].message.content == hf_tok.decode([token] * 3)


def test_logit_bias_minus_100_bans_the_greedy_token(http: httpx.Client) -> None:
    base = http.post("/generate", json={"text": TEXT, "sampling_params": {"max_new_tokens": 1, **GREEDY}}).json()
    banned = base["output_ids"][0]
    out = http.post("/generate", json={"text": TEXT, "sampling_params": {
        "max_new_tokens": 8, "logit_bias": {str(banned): -100}, **GREEDY}}).json()
    assert out["output_ids"][0] != banned and banned not in out["output_ids"]


@pytest.mark.parametrize("bias", [{"5": 101}, {"abc": 1}, {"100000": 1}])
def test_invalid_logit_bias_is_a_400_naming_the_field(oai, bias: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, logit_bias=bias)
    assert err.value.body["param"] == "logit_bias"


# -- priority --------------------------------------------------------------------------------------


def test_priority_needs_a_priority_policy(oai, http: httpx.Client) -> None:
    """The main server runs fcfs: 0 (what clients send by default) is fine, anything else a 400."""
    ok = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, extra_body={"priority": 0})
    assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                    extra_body={"priority": 3})
    assert err.value.body["param"] == "priority"
    r = http.post("/generate", json={"text": TEXT, "priority": -2})
    assert r.status_code == 400 and _error(r)["param"] == "priority"


# -- SGLang /generate fields -------------------------------------------------------------------


def test_token_ids_logprob_and_text_in_logprobs(http: httpx.Client, hf_tok) -> None:
    watched = [hf_tok.encode(" the", add_special_tokens=False)[0], 7, 42]
    body = http.post("/generate", json={
        "text": TEXT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, **GREEDY},
        "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": watched,
        "return_text_in_logprobs": True, "logprob_start_len": 0,
    }).json()
    meta = body["meta_info"]
    prompt_rows = meta["input_token_ids_logprobs"]
    assert len(prompt_rows) == meta["prompt_tokens"] and prompt_rows[0] is None
    assert all([t for _, t, _ in row] == watched for row in prompt_rows[1:])
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(body["output_ids"]) == 5
    for pos, row in enumerate(rows):
        assert [t for _, t, _ in row] == watched
        assert [text for _, _, text in row] == [hf_tok.decode([t]) for t in watched]
        # a watched id among the top logprobs has the same logprob there
        top = {t: lp for lp, t, _ in meta["output_top_logprobs"][pos]}
        for lp, t, _ in row:
            assert lp <= 0
            if t in top:
                assert lp == pytest.approx(top[t], abs=1e-6)
    assert [text for _, _, text in meta["output_token_logprobs"]] == [hf_tok.decode([t]) for t in body["output_ids"]]


def test_token_ids_logprob_per_prompt_and_refusals(http: httpx.Client) -> None:
    batch = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2},
                                         "token_ids_logprob": [[1], [2, 3]]}).json()
    assert [len(r) for r in batch[0]["meta_info"]["output_token_ids_logprobs"][0]] == [2]
    assert [t for _, t in batch[1]["meta_info"]["output_token_ids_logprobs"][0]] == [2, 3]
    for body, param in (({"text": "x", "token_ids_logprob": [10**6]}, "token_ids_logprob"),
                        ({"text": ["a", "b"], "token_ids_logprob": [[1]]}, "token_ids_logprob"),
                        ({"text": "x", "token_ids_logprob": list(range(50))}, "token_ids_logprob"),
                        ({"text": "x", "custom_logit_processor": "gASV..."}, "custom_logit_processor"),
                        ({"text": "x", "sampling_params": {"custom_params": {}}}, None)):
        r = http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        if param is not None:
            assert _error(r)["param"] == param, r.text
    assert http.post("/generate", json={"text": "x", "custom_logit_processor": None,
                                        "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_custom_logit_processor_is_refused_while_the_switch_is_off(http: httpx.Client) -> None:
    """The main server runs with the default ``server.enable_custom_logit_processor=false``: even a
    registered processor's name is a 400 naming the field and the switch (the switch on:
    test_custom_logit_processor.py)."""
    for r in (http.post("/generate", json={"text": "x", "custom_logit_processor": "disallowed_tokens",
                                           "sampling_params": {"custom_params": {"token_ids": [1]}}}),
              http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "custom_logit_processor":
                                                 "disallowed_tokens"})):
        assert r.status_code == 400, r.text
        assert _error(r)["param"] == "custom_logit_processor"
        assert "server.enable_custom_logit_processor=true" in _error(r)["message"]


def test_sglang_metric_names_are_off_by_default(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert "plugserve_requests_total" in text and "sglang:" not in text
