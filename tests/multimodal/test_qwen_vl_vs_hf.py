"""Qwen2-VL / Qwen2.5-VL through the Engine against transformers, in float32 on CPU.

The reference is transformers' own model on the same checkpoint: its prompt ids are ours with each
image span's pad ids replaced by the image token (the span lengths come from the image
processor's grid), its pixel values straight from the HF image processor. Checked: prompt logits
within 1e-4 and greedy tokens equal, for 0, 1 and 2 images of different sizes, a mixed batch of
text-only and image requests, radix cache on and off, and prefill chunks smaller than an image
span (chunks that start and end inside one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from framework import Engine
from framework.multimodal.inputs import is_pad_id
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER
from tests.multimodal.reference import MAX_NEW, Reference

ATOL = 1e-4
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

# (prompt text, indices into the `images` fixture)
PROMPTS: dict[str, tuple[str, list[int]]] = {
    "text_only": ("To be, or not to be, that is the question.", []),
    "one_image": (f"All the world's {IMAGE_PLACEHOLDER} a stage.", [1]),
    "two_images": (f"The quick {IMAGE_PLACEHOLDER} brown fox {IMAGE_PLACEHOLDER} jumps.", [0, 2]),
    "image_first": (f"{IMAGE_PLACEHOLDER}Numbers 0123 and more.", [0]),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(vl_model: Path) -> Reference:
    return Reference(vl_model)


@pytest.fixture
def make_engine(vl_model: Path, engine_factory):
    """Engines on the VL checkpoint in fp32; after the test each must be idle with nothing leaked."""
    return lambda *overrides: engine_factory(vl_model, "kv_cache.max_total_tokens=1024", "model.dtype=float32",
                                             *overrides)


def capture_extend_logits(eng: Engine) -> list[torch.Tensor]:
    """Record the logits rows of every prefill forward of ``eng`` (prompt rows, then the sample row)."""
    rows: list[torch.Tensor] = []
    real = eng.runner.forward

    def forward(batch: Any) -> torch.Tensor:
        out = real(batch)
        if batch.mode.is_extend():
            rows.append(out.clone())
        return out

    eng.runner.forward = forward  # type: ignore[method-assign]
    return rows


def prompt_and_images(name: str, images: list[Any]) -> tuple[str, list[Any]]:
    text, which = PROMPTS[name]
    return text, [images[i] for i in which]


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunk4"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_logits_and_greedy_equal_transformers(reference, make_engine, images, name, chunk):
    """One request at a time: all prompt positions' logits and the greedy continuation. With
    chunks of 4 tokens every image span (4 to 16 tokens) is split, and chunks start inside spans."""
    text, imgs = prompt_and_images(name, images)
    eng = make_engine(*([f"scheduler.chunked_prefill_size={chunk}"] if chunk else []))
    ids, mm = eng._tokenize(text, imgs or None)
    assert len(mm.items) == len(imgs)
    rows = capture_extend_logits(eng)
    out = eng.generate(text, GREEDY, image_data=imgs or None, logprob_start_len=0)
    ours = torch.cat(rows)
    theirs = reference.logits(ids, imgs)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert out["output_ids"] == reference.greedy(ids, imgs)
    logprobs = out["meta_info"]["input_token_logprobs"]
    # Prompt logprobs: None where the target is an image token (documented), numbers elsewhere.
    assert [lp is None for lp, _ in logprobs[1:]] == [is_pad_id(t) for t in ids[1:]]


@pytest.mark.parametrize("variant", [[], ["radix_cache.enabled=false"], ["scheduler.chunked_prefill_size=5"]],
                         ids=["radix", "no_radix", "chunk5"])
def test_mixed_batch_equals_transformers(reference, make_engine, images, variant):
    """Text-only and image requests in one batch (and the same image twice: it shares KV)."""
    names = ["text_only", "one_image", "two_images", "one_image", "image_first"]
    eng = make_engine(*variant)
    prompts = [prompt_and_images(n, images) for n in names]
    results = eng.generate([p for p, _ in prompts], GREEDY, image_data=[i or None for _, i in prompts])
    for (text, imgs), res in zip(prompts, results, strict=True):
        ids, _ = eng._tokenize(text, imgs or None)
        assert res["output_ids"] == reference.greedy(ids, imgs), text


def test_bfloat16_first_tokens_equal_transformers(vl_model, make_engine, images):
    """bf16 weights (vision tower and language model): the first two greedy tokens equal
    transformers' bf16 model (later ones may part at a near-tie, as any two bf16 paths may)."""
    text, imgs = prompt_and_images("two_images", images)
    eng = make_engine("model.dtype=bfloat16")
    assert eng.runner.dtype == torch.bfloat16
    ids, _ = eng._tokenize(text, imgs)
    ours = eng.generate(text, GREEDY, image_data=imgs)["output_ids"]
    ref = Reference(vl_model)
    ref.model = ref.model.to(torch.bfloat16)
    assert ours[:2] == ref.greedy(ids, imgs)[:2]
