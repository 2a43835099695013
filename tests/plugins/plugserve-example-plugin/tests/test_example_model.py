"""The example plugin's model runs on one rank and on two, and equals transformers on both:
a third-party model gets tensor parallelism by using plugserve's parallel layers."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import Engine
from framework.testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("example_plugin_installed")


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_example_model_tp1_tp2_equal_transformers(tmp_path, kv_heads) -> None:
    path = save_tiny_model(tmp_path / "llama", num_key_value_heads=kv_heads)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [30, 31, 32, 33, 34, 35, 36, 37]]
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    for tp in (1, 2):
        eng = Engine(overrides=[f"model.path={path}", "model.architecture=ExampleLlamaForCausalLM",
                                "kv_cache.max_total_tokens=1024", "device.num_threads=1", f"parallel.tp_size={tp}"],
                     progress=False)
        try:
            got = [r["output_ids"] for r in eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": 8,
                                                                   "ignore_eos": True})]
        finally:
            eng.close()
        assert got == expected, f"tp_size={tp}"
