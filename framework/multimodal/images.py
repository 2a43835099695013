"""Images as callers hand them over (PIL images, encoded bytes, file paths, data URLs, base64),
decoded with Pillow."""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

from framework.multimodal.inputs import content_hash


def _string_image(text: str) -> Any:
    """SGLang's string forms of an image: a ``data:`` URL, an existing file path, or base64."""
    if text.startswith("data:"):
        _, _, text = text.partition(",")
    elif os.path.exists(text):
        return text
    elif text.startswith(("http://", "https://")):
        raise ValueError("image URLs are not fetched here: pass the image's bytes, a path or base64")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image string must be a data: URL, an existing file path or base64") from None


def load_image(image: Any) -> Any:
    """A decoded ``PIL.Image`` from a ``PIL.Image``, encoded bytes (PNG, JPEG, ...), a file path,
    or (as SGLang's ``image_data``) a ``data:`` URL or base64 text.

    Raises ``ValueError`` for data Pillow cannot decode (corrupt or not an image)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str):
        image = _string_image(image)
    try:
        if isinstance(image, bytes | bytearray | memoryview):
            img = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, str | os.PathLike):
            img = Image.open(os.fspath(image))
        else:
            raise ValueError(f"an image must be a PIL image, bytes or a file path, not {type(image).__name__}")
        img.load()  # decode now: a truncated file fails here, not later in the processor
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode image: {exc}") from None
    return img


def image_content_hash(image: Any) -> int:
    """:func:`~framework.multimodal.inputs.content_hash` of a decoded image's pixels, mode and size
    (two encodings of the same pixels share it; the same bytes in another shape do not)."""
    header = f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode()
    return content_hash(header + image.tobytes())
