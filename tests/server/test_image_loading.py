"""Image inputs in the HTTP process without a model: sources (data URLs, base64, paths, remote
URLs from a local http server), the limits, format sniffing and decoding, the IPC codec of
MultimodalInputs, and SGLang's ``image_data`` shapes."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import random
import threading
from collections.abc import Iterator
from dataclasses import replace

import msgspec
import pytest
import torch
from PIL import Image

from framework.config.schema import ServerConfig
from framework.multimodal.inputs import ImageItem, MultimodalInputs
from framework.server import ipc
from framework.server.errors import APIError
from framework.server.image_inputs import ImageFrontend, generate_image_sources
from framework.server.images import ImageLoader, ImageSource, sniff_format


def encoded(fmt: str = "PNG", size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 10, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def load(loader: ImageLoader, *values: str, allow_base64: bool = False) -> list[bytes]:
    sources = [ImageSource(v, f"image_data.{i}", allow_base64) for i, v in enumerate(values)]
    return asyncio.run(loader.load(sources))


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


@pytest.fixture
def loader() -> ImageLoader:
    return ImageLoader(ServerConfig())


def test_formats_are_sniffed_from_leading_bytes():
    assert sniff_format(encoded("PNG")) == "PNG"
    assert sniff_format(encoded("JPEG")) == "JPEG"
    assert sniff_format(encoded("WEBP")) == "WEBP"
    assert sniff_format(encoded("GIF")) == "GIF"
    assert sniff_format(b"hello world") is None


def test_data_url_and_base64_decode_to_rgb(loader):
    png, jpeg = encoded("PNG", (8, 6)), encoded("JPEG", (5, 7))
    got = load(loader, data_url(png), data_url(jpeg, "image/jpeg"))
    assert got == [png, jpeg]
    image = loader.decode(got[0], "x")
    assert image.mode == "RGB" and image.size == (8, 6) and image.getpixel((0, 0)) == (200, 10, 30)
    assert loader.decode(got[1], "x").size == (5, 7)
    # /generate takes bare base64 as SGLang does; OpenAI's image_url does not
    assert load(loader, base64.b64encode(png).decode(), allow_base64=True) == [png]
    assert refused(load, loader, base64.b64encode(png).decode()).code == "invalid_image_url"


def test_bad_images_are_400s_naming_the_field(loader):
    err = refused(loader.decode, b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, "messages.0.content.1.image_url")
    assert err.code == "invalid_image" and err.param == "messages.0.content.1.image_url"
    err = refused(loader.decode, encoded("GIF"), "image_data")
    assert err.code == "unsupported_image_format" and "GIF" in err.message and "server.image_formats" in err.message
    assert refused(loader.decode, b"not an image at all", "image_data").code == "invalid_image"
    assert refused(load, loader, "data:image/png;base64,@@@@").code == "invalid_image"
    assert refused(load, loader, "data:text/plain;base64,aGk=").code == "invalid_image_url"
    assert refused(load, loader, "data:image/png,rawbytes").code == "invalid_image_url"


def test_limits(loader):
    small = replace(ServerConfig(), max_image_pixels=100, max_image_bytes=2000, max_images_per_request=2,
                    max_image_bytes_per_request=3000)
    limited = ImageLoader(small)
    err = refused(limited.decode, encoded("PNG", (11, 10)), "image_data")  # 110 pixels
    assert err.code == "image_too_large" and "server.max_image_pixels" in err.message
    assert limited.decode(encoded("PNG", (10, 10)), "image_data").size == (10, 10)
    noisy = io.BytesIO()
    Image.frombytes("RGB", (40, 40), random.Random(0).randbytes(4800)).save(noisy, format="PNG")  # incompressible
    err = refused(load, limited, data_url(noisy.getvalue()))
    assert err.code == "image_too_large" and "server.max_image_bytes" in err.message
    err = refused(load, limited, *[data_url(encoded())] * 3)
    assert err.code == "too_many_images" and "server.max_images_per_request" in err.message
    one = data_url(b"\x89PNG\r\n\x1a\n" + bytes(1900))
    err = refused(load, limited, one, one)
    assert "server.max_image_bytes_per_request" in err.message


def test_local_paths_only_when_allowed(loader, tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(encoded())
    err = refused(load, loader, str(path), allow_base64=True)
    assert err.code == "image_paths_disabled" and "server.allow_image_paths" in err.message
    assert refused(load, loader, f"file://{path}").code == "image_paths_disabled"
    allowed = ImageLoader(replace(ServerConfig(), allow_image_paths=True))
    assert load(allowed, str(path), allow_base64=True) == [path.read_bytes()]
    assert load(allowed, f"file://{path}") == [path.read_bytes()]
    assert refused(load, allowed, f"file://{tmp_path}/missing.png").code == "invalid_image"


@pytest.fixture
def image_site() -> Iterator[str]:
    """A local http server: /ok.png, /big.png (no Content-Length), /missing, /slow.png."""
    png = encoded()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            if self.path == "/ok.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/big.png":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(png + bytes(50_000))
            elif self.path == "/slow.png":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(png[:10])
                self.wfile.flush()
                threading.Event().wait(3)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_urls_refused_by_default_fetched_when_allowed(loader, image_site):
    err = refused(load, loader, f"{image_site}/ok.png")
    assert err.code == "remote_images_disabled" and "server.allow_remote_images" in err.message
    remote = ImageLoader(replace(ServerConfig(), allow_remote_images=True, max_image_bytes=20_000,
                                 remote_image_timeout_s=1.0))
    assert load(remote, f"{image_site}/ok.png") == [encoded()]
    assert refused(load, remote, f"{image_site}/big.png").code == "image_too_large"
    assert refused(load, remote, f"{image_site}/missing").code == "image_fetch_failed"
    err = refused(load, remote, f"{image_site}/slow.png")
    assert err.code == "image_fetch_failed" and "server.remote_image_timeout_s" in err.message


def test_generate_image_data_shapes():
    one = generate_image_sources("AAAA", 1, batch=False)
    assert [[s.param for s in p] for p in one] == [["image_data"]]
    two = generate_image_sources(["AAAA", "BBBB"], 1, batch=False)
    assert [[s.param for s in p] for p in two] == [["image_data.0", "image_data.1"]]
    batch = generate_image_sources([None, "AAAA", ["BBBB", "CCCC"]], 3, batch=True)
    assert [[s.param for s in p] for p in batch] == [[], ["image_data.1"], ["image_data.2.0", "image_data.2.1"]]
    assert all(s.allow_base64 for p in batch for s in p)
    assert refused(generate_image_sources, ["AAAA"], 2, batch=True).param == "image_data"
    assert generate_image_sources(None, 2, batch=True) == [[], []]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_multimodal_inputs_cross_ipc_without_pickle(dtype):
    pixels = torch.randn(16, 12).to(dtype)
    mm = MultimodalInputs(items=[ImageItem(pixels, (1, 4, 4), 3, 4, 123456789)],
                          mrope_positions=torch.arange(30).reshape(3, 10).expand(3, 10), mrope_position_delta=-5)
    req = ipc.GenerateReq(rid="r", input_ids=[1, 2, 3], sampling_params={}, mm_inputs=mm.to_wire())
    data = ipc.encode(ipc.GenerateBatch(reqs=[req]))
    assert b"pickle" not in data and len(data) < pixels.numel() * pixels.element_size() + 1000  # raw bytes
    back = MultimodalInputs.from_wire(ipc.decode_to_scheduler(data).reqs[0].mm_inputs)
    assert back.items[0].pixel_values.dtype == dtype and torch.equal(back.items[0].pixel_values, pixels)
    assert back.items[0].grid_thw == (1, 4, 4) and (back.items[0].offset, back.items[0].length) == (3, 4)
    assert back.items[0].hash == 123456789 and back.mrope_position_delta == -5
    assert torch.equal(back.mrope_positions, mm.mrope_positions)


def test_text_only_requests_carry_no_multimodal_field():
    data = ipc.encode(ipc.GenerateReq(rid="r", input_ids=[1, 2], sampling_params={"temperature": 0.0}))
    assert b"mm_inputs" not in data
    assert msgspec.msgpack.decode(data)["input_ids"] == [1, 2]
    assert ipc.decode_to_scheduler(ipc.encode(ipc.GenerateBatch(reqs=[msgspec.msgpack.decode(
        data, type=ipc.GenerateReq)]))).reqs[0].mm_inputs is None


def test_a_pd_decode_server_sends_no_pixels_and_no_delta():
    """Spans and positions only: the prefill server encodes, the delta comes with the KV."""
    mm = MultimodalInputs(items=[ImageItem(torch.ones(16, 12), (1, 4, 4), 3, 4, 99)],
                          mrope_positions=torch.zeros(3, 10, dtype=torch.int64), mrope_position_delta=-5)
    frontend = ImageFrontend(object(), ImageLoader(ServerConfig()), "X", send_inputs=False)
    back = MultimodalInputs.from_wire(frontend.wire(mm))
    assert back.items[0].pixel_values.numel() == 0 and back.items[0].pad_value == mm.items[0].pad_value
    assert back.mrope_position_delta == 0 and back.mrope_positions.shape == (3, 10)
    assert MultimodalInputs.from_wire(ImageFrontend(object(), ImageLoader(ServerConfig())).wire(mm)) \
        .mrope_position_delta == -5
