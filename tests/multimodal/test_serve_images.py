"""Images through a real ``plugserve serve`` (tiny random Qwen2-VL): the openai client's chat with a
base64 PNG, SGLang's /generate ``image_data`` (one, several, per prompt of a batch), the prefix cache
keyed by image content, and a 400 naming the field for every bad image input.

The reference is the in-process Engine on the same ids and images (itself checked against
transformers in test_qwen_vl_vs_hf.py); the prompts are rendered by transformers'
``apply_chat_template``, not by the server's code."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from framework import Engine
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER, build_vl_tokenizer, make_image
from tests.server.conftest import served, sse_events

pytestmark = pytest.mark.timeout(400)

MAX_NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LIMITS = ["server.max_images_per_request=3", "server.max_image_pixels=40000"]
KV = ["kv_cache.max_total_tokens=2048", "kv_cache.page_size=4"]


def png(image: Any, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


CHAT = [  # (message content parts, indices into `images`)
    ([{"type": "text", "text": "What is in"}, {"type": "image", "i": 1}, {"type": "text", "text": " this picture?"}],
     [1]),
    ([{"type": "image", "i": 0}, {"type": "text", "text": "and"}, {"type": "image", "i": 2}, {"type": "text",
                                                                                          "text": "compare."}],
     [0, 2]),
]
GENERATE = [("Look: " + IMAGE_PLACEHOLDER + " says", [1]), ("Two " + IMAGE_PLACEHOLDER + IMAGE_PLACEHOLDER + " ok", [2, 0]),
            ("No images at all here", [])]


def assert_error(r: httpx.Response, param: str, code: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if code is not None:
        assert err["code"] == code, err


def openai_parts(parts: list[dict], images: list[Any]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(png(images[p["i"]]))}} if p["type"] == "image" else p
            for p in parts]


@pytest.fixture(scope="module")
def reference(qwen2_vl_model: Path, images: list[Any]) -> dict[str, Any]:
    """The Engine's greedy ids and text for every chat and /generate case."""
    tok = build_vl_tokenizer()
    engine = Engine(overrides=[f"model.path={qwen2_vl_model}", *KV, "device.num_threads=1"], progress=False)
    out: dict[str, Any] = {}
    try:
        for k, (parts, which) in enumerate(CHAT):
            hf_parts = [{"type": "image"} if p["type"] == "image" else p for p in parts]
            text = tok.apply_chat_template([{"role": "user", "content": hf_parts}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            out[f"chat{k}"] = engine.generate(ids, GREEDY, image_data=[images[i] for i in which])
        for k, (text, which) in enumerate(GENERATE):
            out[f"gen{k}"] = engine.generate(text, GREEDY, image_data=[images[i] for i in which] or None)
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def server(qwen2_vl_model: Path, tmp_path_factory: pytest.TempPathFactory, reference):
    with served(tmp_path_factory.mktemp("vl-serve"), [f"model.path={qwen2_vl_model}", *KV, *LIMITS]) as srv:
        yield srv


def test_openai_client_chat_with_a_base64_png_matches_the_engine(server, images, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for k, (parts, _) in enumerate(CHAT):
        reply = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": openai_parts(parts, images)}], max_tokens=MAX_NEW,
            temperature=0.0, extra_body={"ignore_eos": True})
        ref = reference[f"chat{k}"]
        assert reply.choices[0].message.content == ref["text"], k
        assert reply.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert reply.usage.completion_tokens == MAX_NEW
    # streamed, the same text
    stream = client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": openai_parts(CHAT[0][0], images)}], max_tokens=MAX_NEW,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference["chat0"]["text"]


def test_generate_image_data_matches_the_engine(server, images, reference):
    with server.client() as http:
        for k, (text, which) in enumerate(GENERATE):
            data = [base64.b64encode(png(images[i])).decode() for i in which]
            body = {"text": text, "sampling_params": GREEDY, "image_data": data or None}
            r = http.post("/generate", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == reference[f"gen{k}"]["output_ids"], k
        # token ids with the image token once per image, as SGLang's clients send them
        ids = build_vl_tokenizer().encode(GENERATE[0][0])
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                         "image_data": [data_url(png(images[GENERATE[0][1][0]]))]})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference["gen0"]["output_ids"]
        # a batch: one entry per prompt (null, a data URL, a list), streamed
        batch = [None if not w else data_url(png(images[w[0]])) if len(w) == 1 else [data_url(png(images[i])) for i in w]
                 for _, w in GENERATE[::-1]]
        body = {"text": [t for t, _ in GENERATE[::-1]], "sampling_params": GREEDY, "image_data": batch, "stream": True}
        with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            events = [e for e in sse_events(r) if isinstance(e, dict)]
        last = {e["index"]: e["output_ids"] for e in events}
        assert [last[i] for i in range(3)] == [reference[f"gen{k}"]["output_ids"] for k in (2, 1, 0)]


def test_the_prefix_cache_keys_images_by_content(server, images):
    def cached(image: Any) -> int:
        body = {"text": "Look: " + IMAGE_PLACEHOLDER + " says", "image_data": data_url(png(image)),
                "sampling_params": {**GREEDY, "max_new_tokens": 1}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    # "Look: <|vision_start|>" is 7 tokens, then the image's 16 (112 x 112 pixels: 4 x 4 merged patches)
    first = make_image(112, 112, seed=11)
    cached(first)
    assert cached(first) >= 7 + 16  # the same image: the prefix cache holds its span
    assert cached(make_image(112, 112, seed=12)) <= 7  # a different one: only the text before it


def test_remote_image_urls_when_allowed(qwen2_vl_model, images, reference, tmp_path):
    """With server.allow_remote_images the server fetches from a local http server (the default
    server refuses such URLs: BAD below)."""
    body = png(images[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Length", str(len(body) if self.path == "/cat.png" else 0))
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        with served(tmp_path, [f"model.path={qwen2_vl_model}", *KV, "server.allow_remote_images=true"]) as srv:
            parts = [{"type": "image_url", "image_url": {"url": f"{base}/cat.png"}} if p["type"] == "image" else p
                     for p in CHAT[0][0]]
            with srv.client() as client:
                r = client.post("/v1/chat/completions", json={"model": "model", "max_tokens": MAX_NEW, "temperature": 0,
                                                              "ignore_eos": True,
                                                              "messages": [{"role": "user", "content": parts}]})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == reference["chat0"]["text"]
                parts[1] = {"type": "image_url", "image_url": {"url": f"{base}/missing.png"}}
                r = client.post("/v1/chat/completions", json={"model": "model", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": parts}]})
                assert_error(r, "messages.0.content.1.image_url", "image_fetch_failed")
    finally:
        site.shutdown()
        site.server_close()


BAD = [  # (name, route, body builder, param, code)
    ("corrupt png", "chat", lambda im: [{"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\n" + b"x" * 40)}}],
     "messages.0.content.0.image_url", "invalid_image"),
    ("gif", "chat", lambda im: [{"type": "image_url", "image_url": {"url": data_url(png(im[0], "GIF"), "image/gif")}}],
     "messages.0.content.0.image_url", "unsupported_image_format"),
    ("too many pixels", "chat", lambda im: [{"type": "image_url", "image_url": {"url": data_url(png(make_image(201, 200)))}}],
     "messages.0.content.0.image_url", "image_too_large"),
    ("too many images", "chat", lambda im: [{"type": "image_url", "image_url": {"url": data_url(png(im[2]))}}] * 4,
     "messages.0.content.0.image_url", "too_many_images"),
    ("remote url", "chat", lambda im: [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}],
     "messages.0.content.0.image_url", "remote_images_disabled"),
    ("not a url", "chat", lambda im: [{"type": "image_url", "image_url": {"url": "cat.png"}}],
     "messages.0.content.0.image_url", "invalid_image_url"),
    ("bad base64", "generate", lambda im: {"text": IMAGE_PLACEHOLDER, "image_data": "!!!!"}, "image_data", "invalid_image"),
    ("a path", "generate", lambda im: {"text": IMAGE_PLACEHOLDER, "image_data": "/etc/cat.png"}, "image_data",
     "image_paths_disabled"),
    ("placeholders != images", "generate",
     lambda im: {"text": "no placeholder", "image_data": [data_url(png(im[0]))]}, "text", "invalid_image_prompt"),
    ("batch entries != prompts", "generate", lambda im: {"text": ["a", "b"], "image_data": [data_url(png(im[0]))]},
     "image_data", None),
    ("completions", "completions", lambda im: {"prompt": "x", "image_data": data_url(png(im[0]))}, "image_data", None),
]


@pytest.mark.parametrize(("route", "build", "param", "code"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_are_400s_naming_the_field(server, images, route, build, param, code):
    with server.client() as http:
        if route == "chat":
            r = http.post("/v1/chat/completions", json={"model": "model", "max_tokens": 2, "messages": [
                {"role": "user", "content": build(images)}]})
        elif route == "generate":
            r = http.post("/generate", json=build(images))
        else:
            r = http.post("/v1/completions", json={"model": "model", **build(images)})
    assert_error(r, param, code)
