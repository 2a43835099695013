"""Images as callers hand them over: PIL images, encoded bytes or file paths, decoded with Pillow."""

from __future__ import annotations

import io
import os
from typing import Any

from framework.multimodal.inputs import content_hash


def load_image(image: Any) -> Any:
    """A decoded ``PIL.Image`` from a ``PIL.Image``, encoded bytes (PNG, JPEG, ...) or a file path.

    Raises ``ValueError`` for data Pillow cannot decode (corrupt or not an image)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
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
