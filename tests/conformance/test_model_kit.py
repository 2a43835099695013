"""The model conformance kit on every built-in architecture (tiny configs), and on a model that loads
one weight wrong, which it must fail."""

from __future__ import annotations

import pytest
import transformers

from framework.plugins import get_registry
from framework.testing.model_conformance import CHECKS, assert_conformant, run_conformance
from tests.multimodal.conftest import VL_ARCHITECTURES

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama_gqa": ("LlamaForCausalLM", transformers.LlamaConfig(**TINY)),
    "llama_tied_mqa_bias": ("LlamaForCausalLM", transformers.LlamaConfig(
        **{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralForCausalLM", transformers.MistralConfig(**TINY)),
    "qwen2": ("Qwen2ForCausalLM", transformers.Qwen2Config(**TINY)),
    "qwen3_head_dim": ("Qwen3ForCausalLM", transformers.Qwen3Config(**TINY, head_dim=32)),
}


def test_every_builtin_model_is_covered() -> None:
    """Text models run the kit here; the vision-language ones are checked against transformers with
    images (which the kit's text prompts cannot exercise) in tests/multimodal/test_qwen_vl_vs_hf.py."""
    builtins = {c.name for c in get_registry().all() if c.kind == "model" and c.module.startswith("plugins.")}
    assert builtins == {arch for arch, _ in CONFIGS.values()} | set(VL_ARCHITECTURES)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_builtin_model_matches_transformers(case: str) -> None:
    arch, config = CONFIGS[case]
    report = assert_conformant(arch, config)
    assert [r.name for r in report.results] == list(CHECKS)
    assert "cached tokens reused" in report.result("greedy_cached_prefix").detail


def test_a_model_loading_one_weight_wrong_fails() -> None:
    llama = get_registry().get("model", "LlamaForCausalLM").factory

    def perturbed_llama(hf_config, options):
        model = llama(hf_config, options)
        load = model.load_weights

        def load_weights(weights):
            def tweaked():
                for name, tensor in weights:
                    if name == "model.layers.1.mlp.down_proj.weight":
                        tensor = tensor.clone()
                        tensor[0, 0] += 0.5
                    yield name, tensor

            return load(tweaked())

        model.load_weights = load_weights
        return model

    report = run_conformance(perturbed_llama, CONFIGS["llama_gqa"][1])
    assert report.result("load").passed and report.result("reference").passed
    failed = report.result("prompt_logprobs")
    assert not failed.passed and "> atol 0.0001" in failed.detail
    assert not report.passed
    with pytest.raises(AssertionError, match=r"model .*perturbed_llama \(LlamaConfig\) fails"):
        report.raise_for_failures()
    # the temporary registration is gone afterwards
    assert not any(c.name.startswith("conformance_model_") for c in get_registry().all())


def test_an_unknown_architecture_fails_the_load_check_and_skips_the_rest() -> None:
    report = run_conformance("NoSuchForCausalLM", transformers.LlamaConfig(**TINY))
    assert not report.result("load").passed and "NoSuchForCausalLM" in report.result("load").detail
    assert all("not run: the model did not load" in r.detail for r in report.results[1:])
