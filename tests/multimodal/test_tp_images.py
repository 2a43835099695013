"""Qwen VL models under tensor parallelism: two gloo ranks (one thread each) against transformers,
with images split over prefill chunks and a text-only request in the batch. Rank 0 sends each
request's images to the other rank (``MultimodalInputs.to_wire``); both run the vision tower."""

from __future__ import annotations

from framework import Engine
from framework.testing.tiny_vl_models import IMAGE_PLACEHOLDER
from tests.multimodal.reference import Reference


def test_tp2_with_images_equals_transformers(qwen2_5_vl_model, images):
    prompts = [(f"All the world's {IMAGE_PLACEHOLDER} a stage.", [images[1]]), ("To be, or not to be.", []),
               (f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER}", [images[0], images[2]])]
    # Chunks of 5 split the 16-token image (and start inside it) on both ranks.
    eng = Engine(overrides=[f"model.path={qwen2_5_vl_model}", "kv_cache.max_total_tokens=1024",
                            "device.num_threads=1", "parallel.tp_size=2", "scheduler.chunked_prefill_size=5"],
                 progress=False)
    try:
        params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
        results = eng.generate([p for p, _ in prompts], params, image_data=[i or None for _, i in prompts])
        ref = Reference(qwen2_5_vl_model)
        for (text, imgs), res in zip(prompts, results, strict=True):
            ids, _ = eng._tokenize(text, imgs or None)
            assert res["output_ids"] == ref.greedy(ids, imgs), text
        report = eng.leak_report()
        assert report["leaked"] == 0 and report["req_slots_free"] == report["req_slots_total"], report
    finally:
        eng.close()
