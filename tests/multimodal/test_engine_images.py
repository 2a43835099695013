"""Images through the Engine: KV sharing by image content, retraction, the overlap loop and mixed
steps, pad ids kept away from vocabulary-sized tensors, and refusals."""

from __future__ import annotations

import pytest
import torch

from framework.multimodal.inputs import MultimodalInputs, is_pad_id
from framework.sampling.params import SamplingParams
from framework.scheduler.admission import AdmissionError
from framework.scheduler.request import Req
from framework.scheduler.rollout import RolloutError
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER, make_image, save_tiny_vl_model
from tests.multimodal.reference import Reference

TEXT = f"All the world's a stage {IMAGE_PLACEHOLDER} and all the men."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_engine(engine_factory):
    """Engines with 1024 KV tokens; after the test each must be idle with nothing leaked."""
    return lambda path, *overrides: engine_factory(path, "kv_cache.max_total_tokens=1024", *overrides)


def greedy(n: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def test_same_image_shares_kv_and_another_does_not(qwen2_vl_model, make_engine):
    eng = make_engine(qwen2_vl_model)
    a, b = make_image(100, 120, seed=10), make_image(100, 120, seed=11)
    ids, mm = eng._tokenize(TEXT, [a])
    span_end = mm.items[0].end
    first = eng.generate(TEXT, greedy(3), image_data=a)
    again = eng.generate(TEXT, greedy(3), image_data=a)
    other = eng.generate(TEXT, greedy(3), image_data=b)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > span_end  # the whole image's KV came from the cache
    assert again["output_ids"] == first["output_ids"]
    # Only the text before the image is shared with a different image of the same size.
    assert 0 < other["meta_info"]["cached_tokens"] <= mm.items[0].offset


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_keeps_images_and_greedy_output(vl_model, make_engine, images, overlap):
    ref = Reference(vl_model)
    prompts = [(TEXT, [images[1]]), (f"{IMAGE_PLACEHOLDER} x {IMAGE_PLACEHOLDER}", [images[0], images[2]]),
               ("To be, or not to be.", []), (TEXT, [images[0]])]
    eng = make_engine(vl_model, "kv_cache.max_total_tokens=96", "scheduler.max_running_requests=8",
                      f"scheduler.overlap={overlap}", "scheduler.init_new_token_ratio=0.0",
                      "scheduler.min_new_token_ratio=0.0", "scheduler.retract_decode_steps=2")
    results = eng.generate([p for p, _ in prompts], greedy(16), image_data=[i or None for _, i in prompts])
    assert eng.scheduler.num_retractions > 0, "the KV budget did not force a retraction"
    for (text, imgs), res in zip(prompts, results, strict=True):
        ids, _ = eng._tokenize(text, imgs or None)
        assert res["output_ids"] == ref.greedy(ids, imgs, max_new=16), text


@pytest.mark.parametrize("variant", [["scheduler.overlap=true"],
                                     ["scheduler.mixed_chunk=true", "scheduler.mixed_chunk_min_running=1",
                                      "scheduler.chunked_prefill_size=6"],
                                     ["attention.backend=torch_native", "kv_cache.page_size=16"]],
                         ids=["overlap", "mixed_chunk", "torch_native_page16"])
def test_scheduler_variants_with_images(vl_model, make_engine, images, variant):
    """Requests arrive while others decode, so prefill chunks of image prompts share steps with
    decode rows (mixed) or run a step ahead (overlap)."""
    ref = Reference(vl_model)
    prompts = [(TEXT, [images[1]]), ("Numbers 0123.", []), (f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", images[:2])]
    eng = make_engine(vl_model, *variant)
    rids = [eng.submit(prompts[0][0], greedy(8), image_data=prompts[0][1])]
    for _ in range(3):
        eng.step()
    rids += [eng.submit(p, greedy(8), image_data=i or None) for p, i in prompts[1:]]
    eng.run_until_done(rids)
    for (text, imgs), rid in zip(prompts, rids, strict=True):
        ids, _ = eng._tokenize(text, imgs or None)
        assert eng._states.pop(rid).output_ids == ref.greedy(ids, imgs, max_new=8), text


def test_pad_ids_never_index_the_vocabulary(qwen2_vl_model, make_engine, images):
    """Penalties over prompt ids, prompt top logprobs and token-id logprobs run with image spans
    (an out-of-range index would raise), and image positions report None."""
    eng = make_engine(qwen2_vl_model)
    params = {**greedy(4), "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    res = eng.generate(TEXT, params, image_data=images[0], logprob_start_len=0, top_logprobs_num=2)
    ids, _ = eng._tokenize(TEXT, images[0])
    meta = res["meta_info"]
    assert len(res["output_ids"]) == 4 and res["text"]
    assert [lp is None for lp, _ in meta["input_token_logprobs"][1:]] == [is_pad_id(t) for t in ids[1:]]
    tops = meta["input_top_logprobs"][1:]
    assert [row is None for row in tops] == [is_pad_id(t) for t in ids[1:]]
    assert meta["prompt_tokens"] == len(ids)


def test_text_model_refuses_images(tiny_model, make_engine, images):
    eng = make_engine(tiny_model)
    with pytest.raises(ValueError, match="does not take images"):
        eng.generate("hello", greedy(2), image_data=images[0])
    req = Req(rid="x", input_ids=[1, 2, 1 << 30], sampling_params=SamplingParams(), mm_inputs=MultimodalInputs())
    with pytest.raises(AdmissionError, match="input_ids"):
        eng.scheduler.add_request(req)


def test_pad_ids_must_match_the_image_spans(qwen2_vl_model, make_engine, images):
    eng = make_engine(qwen2_vl_model)
    ids, mm = eng._tokenize(TEXT, [images[0]])
    bad = list(ids)
    bad[mm.items[0].offset] = 5  # a text id inside the span
    with pytest.raises(AdmissionError, match="pad id"):
        eng.scheduler.add_request(Req(rid="a", input_ids=bad, sampling_params=SamplingParams(), mm_inputs=mm))
    with pytest.raises(AdmissionError, match=r"input_ids\[\d+\]"):
        eng.scheduler.add_request(Req(rid="b", input_ids=ids + [1 << 30], sampling_params=SamplingParams(),
                                      mm_inputs=mm))


@pytest.mark.parametrize("cache", [8, 0])
def test_encoder_runs_once_per_image_with_the_cache(qwen2_vl_model, make_engine, images, cache):
    """Chunks of 4 tokens split the 16-token image over 5 chunks: with the encoder cache the image
    is encoded once (also for a second request with it); without it once per chunk touching it.
    The output equals transformers' either way."""
    eng = make_engine(qwen2_vl_model, "scheduler.chunked_prefill_size=4", f"model.options.encoder_cache_images={cache}")
    visual = eng.runner.model.visual
    calls: list[tuple] = []
    real = visual.encode
    visual.encode = lambda px, grid: (calls.append(grid), real(px, grid))[1]
    out = eng.generate(TEXT, greedy(4), image_data=images[1])
    ids, mm = eng._tokenize(TEXT, [images[1]])
    item = mm.items[0]
    chunks_touching = len({p // 4 for p in range(item.offset, item.end)})
    assert len(calls) == (1 if cache else chunks_touching)
    assert out["output_ids"] == Reference(qwen2_vl_model).greedy(ids, [images[1]], max_new=4)
    eng.flush_cache()
    eng.generate(TEXT, greedy(1), image_data=images[1])
    assert len(calls) == (1 if cache else 2 * chunks_touching)


def test_weight_update_from_transformers_names(qwen2_5_vl_model, make_engine, images):
    """``update_weights_from_tensor`` with transformers' in-memory names (``model.language_model.*``,
    ``model.visual.*``): new weights take effect in both towers, and the encoder cache is dropped."""
    ref = Reference(qwen2_5_vl_model)
    eng = make_engine(qwen2_5_vl_model)
    ids, _ = eng._tokenize(TEXT, [images[1]])
    assert eng.generate(TEXT, greedy(4), image_data=images[1])["output_ids"] == ref.greedy(ids, [images[1]], 4)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    result = eng.update_weights_from_tensor(list(ref.model.state_dict().items()))
    assert result.get("success", True), result
    assert eng.generate(TEXT, greedy(4), image_data=images[1])["output_ids"] == ref.greedy(ids, [images[1]], 4)


def test_grammar_and_stop_conditions_with_images(qwen2_vl_model, make_engine, images):
    """Constrained decoding and stop tokens see only output ids: an image prompt works with both."""
    import re

    eng = make_engine(qwen2_vl_model)
    res = eng.generate(TEXT, {"temperature": 0.0, "max_new_tokens": 8, "regex": "(yes|no)[0-9]{3}"},
                       image_data=images[0])
    assert re.fullmatch("(yes|no)[0-9]{3}", res["text"]), res["text"]
    free = eng.generate(TEXT, greedy(6), image_data=images[0])["output_ids"]
    stopped = eng.generate(TEXT, {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [free[2]]},
                           image_data=images[0])
    assert stopped["output_ids"] == free[: free.index(free[2]) + 1]
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"


def test_weight_update_from_disk_checks_the_vl_config(qwen2_vl_model, qwen2_5_vl_model, make_engine, images,
                                                     tmp_path):
    """The identity check compares the text config's sizes (nested in a VL config) and the
    architecture; a matching checkpoint loads and serves the same tokens."""
    eng = make_engine(qwen2_vl_model)
    before = eng.generate(TEXT, greedy(4), image_data=images[0])["output_ids"]
    with pytest.raises(RolloutError, match="architectures"):
        eng.update_weights_from_disk(str(qwen2_5_vl_model))
    wider = save_tiny_vl_model(tmp_path / "wider", "Qwen2VLForConditionalGeneration", intermediate_size=96)
    with pytest.raises(RolloutError, match="intermediate_size"):
        eng.update_weights_from_disk(str(wider))
    assert eng.update_weights_from_disk(str(qwen2_vl_model))["success"]
    assert eng.generate(TEXT, greedy(4), image_data=images[0])["output_ids"] == before


def test_placeholder_without_image_is_refused(qwen2_vl_model, make_engine):
    eng = make_engine(qwen2_vl_model)
    with pytest.raises(ValueError, match="1 image placeholder"):
        eng.generate(TEXT, greedy(2))


def test_request_without_pixels_recomputes_only_from_cached_image_kv(qwen2_vl_model, make_engine, images,
                                                                       monkeypatch):
    """A PD decode server's scheduler has image spans but no pixels. Prefilled again (after a
    retraction) with its image's KV still cached, the request gives the same tokens; with that KV
    gone, it alone fails with a clear error and a text request in the same step is unaffected."""
    from dataclasses import replace

    eng = make_engine(qwen2_vl_model)
    reference = eng.generate(TEXT, greedy(4), image_data=images[1])
    text_alone = eng.generate("Now is the winter of our discontent", greedy(4))
    real = eng._tokenize

    def without_pixels(prompt, image_data):
        ids, mm = real(prompt, image_data)
        if mm is not None:
            mm = replace(mm, items=[replace(i, pixel_values=i.pixel_values[:0]) for i in mm.items])
        return ids, mm

    monkeypatch.setattr(eng, "_tokenize", without_pixels)
    cached = eng.generate([TEXT, "Now is the winter of our discontent"], greedy(4), image_data=[images[1], None])
    assert cached[0]["output_ids"] == reference["output_ids"]
    assert cached[1]["output_ids"] == text_alone["output_ids"]

    eng.flush_cache()
    lost = eng.generate([TEXT, "Now is the winter of our discontent"], greedy(4), image_data=[images[1], None])
    finish = lost[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "no pixels" in finish["message"], finish
    assert lost[0]["output_ids"] == []
    assert lost[1]["output_ids"] == text_alone["output_ids"]
