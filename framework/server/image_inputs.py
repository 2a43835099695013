"""Images in requests: from OpenAI content parts and SGLang's ``image_data`` to processed prompts.

The model's multimodal processor (plugin kind ``mm_processor``) runs here, in the HTTP process,
together with decoding (:mod:`framework.server.images`), in a worker thread: the scheduler
receives ready pixel tensors and padded ids and never touches an image file. A text-only model
has no processor, and any image sent to it is a 400.

On a PD decode server (``disaggregation.mode=decode``) the processor still runs, for the padded
ids (their length sizes the KV reservation, and their hash-derived pad ids key the radix cache
exactly as on the prefill side), but no pixels go to the scheduler: the prefill server ran the
vision encoder, and the M-RoPE position delta arrives with the KV.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from framework.multimodal.inputs import MultimodalInputs
from framework.server.errors import bad_request
from framework.server.images import ImageLoader, ImageSource


class ImageFrontend:
    """Turns prompts with images into padded ids and :class:`MultimodalInputs`.

    ``processor`` is the model's :class:`~framework.multimodal.processor.MultimodalProcessor`, or
    None for a text-only model; ``send_inputs`` is False on a PD decode server.
    """

    def __init__(self, processor: Any, loader: ImageLoader, architecture: str = "", send_inputs: bool = True) -> None:
        self.processor = processor
        self.loader = loader
        self.architecture = architecture
        self.send_inputs = send_inputs

    @property
    def enabled(self) -> bool:
        return self.processor is not None

    def require(self, param: str) -> None:
        """400 naming ``param`` unless the served model takes images."""
        if self.processor is None:
            raise bad_request(f"this model ({self.architecture or 'text-only'}) does not take images: it has no "
                              "multimodal processor", param, "images_not_supported")

    async def process(self, prompt: list[int], sources: list[ImageSource],
                      param: str) -> tuple[list[int], MultimodalInputs]:
        """Fetch, decode and process ``sources`` for the token ids ``prompt``, which hold the
        model's image token once per image (routes tokenize as for a text-only prompt first)."""
        self.require(param)
        raw = await self.loader.load(sources)

        def work() -> tuple[list[int], MultimodalInputs]:
            images = [self.loader.decode(data, src.param) for data, src in zip(raw, sources, strict=True)]
            try:
                ids, mm = self.processor.process(prompt, images)
            except ValueError as exc:  # the processor's contract: ValueError is the client's mistake
                raise bad_request(str(exc), param, "invalid_image_prompt") from None
            return list(ids), mm

        # Decoding and resizing take milliseconds to seconds of CPU: never on the event loop.
        return await asyncio.to_thread(work)

    def wire(self, mm: MultimodalInputs | None) -> dict[str, Any] | None:
        """What the scheduler receives for ``mm``; on a PD decode server without pixels."""
        if mm is None:
            return None
        if not self.send_inputs:
            # The spans (hash-derived pad ids) let admission check the ids and key the radix
            # cache; the prompt's positions are a few bytes per token (a re-prefill after a
            # retraction needs them). Pixels stay here: the prefill server encodes, and the decode
            # delta arrives with the KV (framework.disaggregation), its only source here.
            mm = replace(mm, items=[replace(i, pixel_values=i.pixel_values[:0]) for i in mm.items],
                         mrope_position_delta=0)
        return mm.to_wire()


# -- OpenAI chat content parts --------------------------------------------------------------------


def chat_content(index: int, content: list[Any], refuse_images: str | None) -> tuple[str | list[dict[str, Any]],
                                                                                       list[ImageSource]]:
    """A message's content for the chat template, and its images in order (``refuse_images``: why
    image parts are a 400 here, or None where they are taken).

    Text-only content is joined into one string (every template takes that). With images it stays
    a list of ``{"type": "text"}`` and ``{"type": "image"}`` parts: Hugging Face templates of
    vision models (Qwen2-VL's) emit the model's image placeholder for each image part, in place.
    """
    parts: list[dict[str, Any]] = []
    sources: list[ImageSource] = []
    for j, part in enumerate(content):
        param = f"messages.{index}.content.{j}"
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            if refuse_images is not None:
                raise bad_request(f"image_url content parts are not accepted: {refuse_images}", param,
                                  "images_not_supported")
            sources.append(ImageSource(_image_url(part, param), f"{param}.image_url"))
            parts.append({"type": "image"})
        else:
            allowed = "text" if refuse_images is not None else "text and image_url"
            raise bad_request(f"content part type {part.type!r} is not supported: only {allowed} parts", param)
    if not sources:
        return "".join(p["text"] for p in parts), sources
    return parts, sources


def _image_url(part: Any, param: str) -> str:
    """OpenAI's ``{"image_url": {"url": ...}}`` (``detail`` is accepted and has no effect); a bare
    string, as some clients send it, too."""
    value = (part.model_extra or {}).get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request("an image_url part needs image_url.url (a data: URL or an http(s) URL)",
                          f"{param}.image_url", "invalid_image_url")
    return value


# -- SGLang's /generate image_data ----------------------------------------------------------------


def generate_image_sources(image_data: Any, count: int, batch: bool) -> list[list[ImageSource]]:
    """Each prompt's images from ``image_data``: for one prompt a string or a list of strings; for a
    batch a list with one entry per prompt, each null, a string or a list of strings."""
    if image_data is None:
        return [[] for _ in range(count)]
    if not batch:
        values = [image_data] if isinstance(image_data, str) else list(image_data)
        return [[ImageSource(v, f"image_data.{i}" if isinstance(image_data, list) else "image_data", True)
                 for i, v in enumerate(values)]]
    if not isinstance(image_data, list) or len(image_data) != count:
        n = len(image_data) if isinstance(image_data, list) else 1
        raise bad_request(f"image_data has {n} entries for {count} prompts: give one entry (null, an image, or a list "
                          "of images) per prompt", "image_data")
    out = []
    for i, entry in enumerate(image_data):
        if entry is None:
            out.append([])
        elif isinstance(entry, str):
            out.append([ImageSource(entry, f"image_data.{i}", True)])
        else:
            out.append([ImageSource(v, f"image_data.{i}.{j}", True) for j, v in enumerate(entry)])
    return out
