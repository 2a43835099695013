"""The OpenAI-compatible routes through the real ``openai`` client."""

from __future__ import annotations

import pytest

MODEL = "tiny-llama"
PROMPT = "To be, or not to be"
GREEDY = {"temperature": 0.0}


def test_models(oai) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_text_usage_and_finish_reason(oai) -> None:
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_completion_stream_matches_non_stream(oai) -> None:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    full = oai.completions.create(**args).choices[0].text
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_chat_completion_and_stream(oai) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    args = dict(model=MODEL, messages=messages, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    out = oai.chat.completions.create(**args)
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.usage.completion_tokens == 8
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_chat_max_completion_tokens_and_content_parts(oai) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    a = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                    max_completion_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    b = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                    max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    assert a.usage.completion_tokens == 5
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_choices_and_seed(oai) -> None:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    out = oai.completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    again = oai.completions.create(**args)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    assert len({c.text for c in out.choices}) > 1  # seed, seed+1, seed+2 differ
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=4, seed=3, temperature=1.0, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 8


def test_completion_prompt_forms_batch(oai) -> None:
    out = oai.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=3, n=2,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    assert len(out.choices) == 4
    assert out.choices[0].text == out.choices[1].text  # greedy: n copies agree
    ids = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True},
                                 **GREEDY)
    assert ids.usage.prompt_tokens == 3


def test_completion_logprobs(oai) -> None:
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    if "\ufffd" not in "".join(lp.tokens):  # a token may hold part of a UTF-8 character
        assert "".join(lp.tokens) == out.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy picks the top token (two ids that decode alike share one key, hence <=).
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) <= logprob + 1e-4


def test_chat_logprobs(oai) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           logprobs=True, top_logprobs=2, stream=True,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_stop_string(oai) -> None:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY)
    full = oai.completions.create(**args).choices[0].text
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and
                 full.find(full[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    out = oai.completions.create(stop=[stop], **args).choices[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop"


def test_sglang_extras(oai) -> None:
    greedy = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True},
                                    **GREEDY).choices[0].text
    top_k = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                   extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.0}).choices[0].text
    assert top_k == greedy
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                 extra_body={"min_tokens": 6, "rid": "my-request-id", "repetition_penalty": 1.1})
    assert out.id == "cmpl-my-request-id" and out.usage.completion_tokens == 6


def test_echo(oai) -> None:
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True},
                                   **GREEDY)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    chunks = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, stream=True,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
