"""The Qwen VL processors and M-RoPE positions against transformers' image processor and
``get_rope_index``; pad ids, placeholder checks, and the ``mm_processor`` plugin kind."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from framework.multimodal.factory import build_processor
from framework.multimodal.images import load_image
from framework.multimodal.inputs import PAD_VALUE_BASE, is_pad_id
from framework.multimodal.mrope import chunk_positions
from framework.plugins import get_registry
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER, make_image
from tests.multimodal.reference import Reference


def processor_for(path: Path) -> Any:
    proc = build_processor(str(path), AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    assert proc is not None
    return proc


@pytest.mark.parametrize("which", [[], [0], [1, 2], [2, 0, 1]])
def test_spans_and_mrope_positions_equal_transformers(vl_model: Path, images, which):
    proc = processor_for(vl_model)
    ref = Reference(vl_model)
    imgs = [images[i] for i in which]
    text = "start " + " mid ".join([IMAGE_PLACEHOLDER] * len(imgs)) + " end"
    ids, mm = proc.process(text, imgs)
    processed = ref.image_processor(images=imgs, return_tensors="pt") if imgs else None
    for k, item in enumerate(mm.items):
        grid = processed["image_grid_thw"][k]
        assert item.grid_thw == tuple(int(x) for x in grid)
        assert item.length == int(grid.prod()) // 4
        assert set(ids[item.offset : item.end]) == {item.pad_value}
        assert not is_pad_id(ids[item.offset - 1]) and not is_pad_id(ids[item.end])
    assert sum(is_pad_id(t) for t in ids) == sum(i.length for i in mm.items)
    if imgs:
        torch.testing.assert_close(torch.cat([i.pixel_values for i in mm.items]), processed["pixel_values"])
    want_pos, want_delta = ref.rope_index(ids, imgs)
    assert torch.equal(mm.mrope_positions, want_pos)
    assert mm.mrope_position_delta == want_delta


def test_text_only_positions_are_plain_positions(qwen2_vl_model: Path):
    proc = processor_for(qwen2_vl_model)
    ids, mm = proc.process("no images here at all", [])
    n = len(ids)
    assert torch.equal(mm.mrope_positions, torch.arange(n).expand(3, n)) and mm.mrope_position_delta == 0
    assert torch.equal(chunk_positions(None, 3, 9, n), torch.arange(3, 9).expand(3, 6))


def test_chunk_positions_slice_the_prompt_then_add_delta(qwen2_vl_model: Path, images):
    proc = processor_for(qwen2_vl_model)
    ids, mm = proc.process(f"a {IMAGE_PLACEHOLDER} b", [images[1]])
    n, delta = len(ids), mm.mrope_position_delta
    assert delta < 0  # 16 image tokens take 4 x 4 positions
    full = chunk_positions(mm, 0, n + 3, n)  # a retracted request re-prefills its 3 output tokens
    assert torch.equal(full[:, :n], mm.mrope_positions)
    assert torch.equal(full[:, n:], (torch.arange(n, n + 3) + delta).expand(3, 3))
    pieces = [chunk_positions(mm, s, min(s + 4, n + 3), n) for s in range(0, n + 3, 4)]
    assert torch.equal(torch.cat(pieces, dim=1), full)


def test_pad_ids_follow_image_content(qwen2_vl_model: Path):
    proc = processor_for(qwen2_vl_model)
    a, b = make_image(60, 40, seed=5), make_image(60, 40, seed=6)
    png = io.BytesIO()
    a.save(png, format="PNG")
    ids_a, mm_a = proc.process(IMAGE_PLACEHOLDER, [a])
    ids_png, _ = proc.process(IMAGE_PLACEHOLDER, [load_image(png.getvalue())])
    ids_b, mm_b = proc.process(IMAGE_PLACEHOLDER, [b])
    assert ids_a == ids_png  # the same pixels, however they arrived
    assert mm_a.items[0].pad_value != mm_b.items[0].pad_value and ids_a != ids_b
    assert all(t >= PAD_VALUE_BASE for t in ids_a[1:-1])


def test_placeholder_count_must_match_images(qwen2_vl_model: Path, images):
    proc = processor_for(qwen2_vl_model)
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        proc.process(f"x {IMAGE_PLACEHOLDER} y", images[:2])
    with pytest.raises(ValueError, match="0 image placeholder"):
        proc.process("x y", images[:1])


def test_processor_from_token_ids(qwen2_vl_model: Path, images):
    """Ids with the model's image token (one, or an already expanded run) work like text."""
    proc = processor_for(qwen2_vl_model)
    ids_text, _ = proc.process(f"x {IMAGE_PLACEHOLDER} y", [images[0]])
    tok = AutoTokenizer.from_pretrained(qwen2_vl_model)
    raw = tok.encode(f"x {IMAGE_PLACEHOLDER} y")
    assert proc.process(raw, [images[0]])[0] == ids_text
    pad = proc.image_token_id
    k = raw.index(pad)
    assert proc.process(raw[:k] + [pad] * 6 + raw[k + 1 :], [images[0]])[0] == ids_text


def test_registered_as_plugins_and_text_models_have_none(tiny_model: Path):
    reg = get_registry()
    for arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        assert reg.has("mm_processor", arch) and reg.has("model", arch)
        assert reg.get("mm_processor", arch).module == "plugins.mm_processors.qwen_vl"
    assert build_processor(str(tiny_model), AutoConfig.from_pretrained(tiny_model),
                           AutoTokenizer.from_pretrained(tiny_model)) is None


def test_load_image_accepts_sglang_forms(tmp_path: Path):
    """PIL, bytes, a path, a data: URL and bare base64 all give the same pixels."""
    import base64

    img = make_image(30, 20, seed=3)
    png = io.BytesIO()
    img.save(png, format="PNG")
    raw = png.getvalue()
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    for form in (img, raw, path, str(path), f"data:image/png;base64,{b64}", b64):
        assert load_image(form).tobytes() == img.tobytes()
    with pytest.raises(ValueError, match="not fetched"):
        load_image("https://example.com/a.png")


def test_load_image_refuses_garbage(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot decode"):
        load_image(b"not an image")
    bad = tmp_path / "x.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(ValueError, match="cannot decode"):
        load_image(bad)
    with pytest.raises(ValueError, match="data: URL, an existing file path or base64"):
        load_image("no/such/file.png")


def test_inputs_round_trip_the_rank_wire(qwen2_vl_model: Path, images):
    import msgspec

    from framework.multimodal.inputs import MultimodalInputs

    _, mm = processor_for(qwen2_vl_model).process(f"{IMAGE_PLACEHOLDER} a {IMAGE_PLACEHOLDER}", images[:2])
    back = MultimodalInputs.from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(mm.to_wire())))
    assert back.spans() == mm.spans() and back.mrope_position_delta == mm.mrope_position_delta
    assert torch.equal(back.mrope_positions, mm.mrope_positions)
    for a, b in zip(back.items, mm.items, strict=True):
        assert torch.equal(a.pixel_values, b.pixel_values) and (a.grid_thw, a.hash) == (b.grid_thw, b.hash)


def test_a_third_party_processor_is_found_by_architecture(register_plugin, plugins):
    """A plugin object registering a processor for its own architecture: ``build_processor`` builds
    it with the model's path, config, tokenizer and the options dataclass."""
    import dataclasses
    from types import SimpleNamespace

    from framework.hookspecs import hookimpl
    from framework.multimodal.processor import MultimodalProcessor

    @dataclasses.dataclass
    class Opts:
        max_side: int = 64

    class MyProcessor(MultimodalProcessor):
        image_placeholder = "<img>"

        def process(self, prompt, images):
            raise NotImplementedError

    class MyPlugin:
        @hookimpl
        def register_mm_processors(self, register):
            register("MyVLForCausalLM", MyProcessor, config=Opts)

    register_plugin(MyPlugin(), "my-vl")
    config = SimpleNamespace(architectures=["MyVLForCausalLM"])
    proc = build_processor("/some/path", config, "tok", options={"max_side": 32})
    assert isinstance(proc, MyProcessor) and proc.options == Opts(32)
    assert (proc.model_path, proc.hf_config, proc.tokenizer) == ("/some/path", config, "tok")
    plugins.unregister("my-vl")
    assert build_processor("/some/path", config, "tok") is None
