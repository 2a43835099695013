"""Image inputs in the HTTP process: where the bytes come from, the limits, and decoding.

A request names each image by a string: a ``data:`` URL, an ``http(s)`` URL (fetched only with
``server.allow_remote_images``), a ``file://`` URL or a local path (only with
``server.allow_image_paths``), or, on ``/generate``, bare base64 as SGLang takes it. Every failure
is the client's 400 naming the field it came from. Decoding runs in a worker thread (the caller's
``asyncio.to_thread``), never on the event loop.

Only the formats in ``server.image_formats`` reach a Pillow decoder: the format is read from the
file's first bytes, so a GIF sent to a PNG/JPEG/WEBP server is "unsupported" before any decoder
parses it, and a file that claims a supported format but does not decode is "corrupt".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import httpx

from framework.config.schema import ServerConfig
from framework.server.errors import APIError, bad_request

# Leading bytes of common formats -> Pillow's format name (what server.image_formats lists).
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
)
_MAX_REDIRECTS = 3


def sniff_format(data: bytes) -> str | None:
    """Pillow's name for the format of ``data`` from its leading bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


@dataclass
class ImageSource:
    """One image of a request: the string naming it and the request field it came from."""

    value: str
    param: str
    allow_base64: bool = False
    """Bare base64 (``/generate``'s ``image_data``); OpenAI's ``image_url`` takes URLs only."""


class ImageLoader:
    """Fetches, checks and decodes the images of one server's requests (``server.*`` limits)."""

    def __init__(self, server: ServerConfig) -> None:
        self.server = server
        self.formats = [f.upper() for f in server.image_formats]

    def check_count(self, count: int, param: str) -> None:
        limit = self.server.max_images_per_request
        if count > limit:
            raise bad_request(f"this request has {count} images; this server allows at most {limit} per request "
                              "(server.max_images_per_request)", param, "too_many_images")

    async def load(self, sources: list[ImageSource]) -> list[bytes]:
        """The encoded bytes of every image, in order, within the per-image and per-request limits."""
        self.check_count(len(sources), sources[0].param if sources else "image_data")
        out, total = [], 0
        for src in sources:
            data = await self._bytes(src)
            total += len(data)
            if total > self.server.max_image_bytes_per_request:
                raise bad_request(f"the images of this request exceed {self.server.max_image_bytes_per_request} "
                                  "bytes together (server.max_image_bytes_per_request)", src.param, "image_too_large")
            out.append(data)
        return out

    def decode(self, data: bytes, param: str) -> Any:
        """A ``PIL.Image`` in RGB (blocking: call it in a worker thread)."""
        from PIL import Image

        fmt = sniff_format(data)
        if fmt is None:
            raise bad_request(f"{param} is not an image in a recognised format (this server decodes "
                              f"{', '.join(self.formats)})", param, "invalid_image")
        if fmt not in self.formats:
            raise bad_request(f"{param} is a {fmt} image; this server decodes {', '.join(self.formats)} "
                              "(server.image_formats)", param, "unsupported_image_format")
        try:
            image = Image.open(io.BytesIO(data), formats=[fmt])  # reads the header only
            width, height = image.size
            if width * height > self.server.max_image_pixels:
                raise bad_request(f"{param} is {width}x{height} pixels; this server allows at most "
                                  f"{self.server.max_image_pixels} pixels per image (server.max_image_pixels)",
                                  param, "image_too_large")
            image.load()
            return image.convert("RGB")
        except APIError:
            raise
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... for bad files
            raise bad_request(f"{param} could not be decoded as {fmt}: {exc}", param, "invalid_image") from None

    # -- where the bytes come from -------------------------------------------------------------

    async def _bytes(self, src: ImageSource) -> bytes:
        value = src.value.strip()
        if _scheme(value) in ("http", "https"):
            if not self.server.allow_remote_images:
                raise bad_request(f"{src.param}: image URLs are not fetched by this server (server.allow_remote_images "
                                  "is false); send the image inline as a base64 data: URL", src.param,
                                  "remote_images_disabled")
            return await self._fetch(value, src.param)
        # Decoding megabytes of base64 or reading a file blocks: not on the event loop.
        return await asyncio.to_thread(self._local, value, src)

    def _local(self, value: str, src: ImageSource) -> bytes:
        scheme = _scheme(value)
        if scheme == "data":
            return self._data_url(value, src.param)
        if scheme == "file":
            return self._file(unquote(urlparse(value).path), src.param)
        if src.allow_base64:
            try:
                return self._base64(value, src.param)
            except APIError:
                if self.server.allow_image_paths and os.path.isfile(value):
                    return self._file(value, src.param)
                if not self.server.allow_image_paths and ("/" in value or "\\" in value) and "." in value:
                    raise bad_request(f"{src.param} is neither base64 nor a URL; local image paths are not read by "
                                      "this server (server.allow_image_paths is false)", src.param,
                                      "image_paths_disabled") from None
                raise
        raise bad_request(f"{src.param} must be a data: URL (data:image/png;base64,...) or an http(s) URL",
                          src.param, "invalid_image_url")

    def _too_large(self, size: int, param: str) -> APIError:
        return bad_request(f"{param} has {size} bytes; this server allows at most {self.server.max_image_bytes} "
                           "bytes per image (server.max_image_bytes)", param, "image_too_large")

    def _base64(self, text: str, param: str) -> bytes:
        if len(text) * 3 // 4 > self.server.max_image_bytes + 2:  # refuse before decoding it
            raise self._too_large(len(text) * 3 // 4, param)
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{param} is not valid base64", param, "invalid_image") from None
        if len(data) > self.server.max_image_bytes:
            raise self._too_large(len(data), param)
        return data

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise bad_request(f"{param}: a data: URL must be base64 (data:image/png;base64,...)", param,
                              "invalid_image_url")
        media = header[5:].split(";", 1)[0].lower()
        if media and not media.startswith("image/"):
            raise bad_request(f"{param}: a data: URL of type {media!r} is not an image", param, "invalid_image_url")
        return self._base64(payload, param)

    def _file(self, path: str, param: str) -> bytes:
        if not self.server.allow_image_paths:
            raise bad_request(f"{param}: local image paths are not read by this server (server.allow_image_paths "
                              "is false)", param, "image_paths_disabled")
        try:
            size = os.path.getsize(path)
            if size > self.server.max_image_bytes:
                raise self._too_large(size, param)
            with open(path, "rb") as f:
                return f.read(self.server.max_image_bytes + 1)
        except OSError as exc:
            raise bad_request(f"{param}: cannot read {path!r}: {exc.strerror or exc}", param, "invalid_image") from None

    async def _fetch(self, url: str, param: str) -> bytes:
        """GET with the timeout over the whole download and the byte limit while it streams."""
        limit = self.server.max_image_bytes
        timeout = self.server.remote_image_timeout_s
        try:
            async with httpx.AsyncClient(timeout=timeout, follow_redirects=True,
                                         max_redirects=_MAX_REDIRECTS) as client:
                return await _with_deadline(self._download(client, url, param, limit), timeout, param)
        except httpx.HTTPError as exc:
            raise bad_request(f"{param}: fetching {url} failed: {type(exc).__name__}: {exc}", param,
                              "image_fetch_failed") from None

    async def _download(self, client: httpx.AsyncClient, url: str, param: str, limit: int) -> bytes:
        async with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise bad_request(f"{param}: fetching {url} answered HTTP {resp.status_code}", param,
                                  "image_fetch_failed")
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > limit:
                raise self._too_large(int(declared), param)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:  # a missing or lying Content-Length
                    raise self._too_large(size, param)
                chunks.append(chunk)
            return b"".join(chunks)


def _scheme(value: str) -> str:
    """A URL's scheme, lowercased ("" for base64 or a path)."""
    head = value[:10]
    return head.split(":", 1)[0].lower() if ":" in head else ""


async def _with_deadline(coro: Any, timeout: float, param: str) -> Any:
    """httpx's timeout bounds each read; this bounds the whole download (a slow drip)."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise bad_request(f"{param}: the image did not arrive within {timeout:g}s (server.remote_image_timeout_s)",
                          param, "image_fetch_failed") from None
