"""Model plugins + HF loader against Hugging Face transformers on tiny random-weight checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from framework.models import layers
from framework.models.loader import (
    build_model,
    iter_safetensors_weights,
    load_generation_config,
    load_hf_config,
    resolve_dtype,
)
from plugins import models as model_plugins
from plugins.attention.torch_native import TorchNativeAttnBackend
from tests.engine.harness import MiniRunner

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CASES: dict[str, tuple[type, dict]] = {
    "llama_gqa": (transformers.LlamaConfig, {}),
    "llama_tied_mqa_bias": (
        transformers.LlamaConfig,
        dict(tie_word_embeddings=True, num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    ),
    "llama3_rope": (
        transformers.LlamaConfig,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "llama_linear_rope": (
        transformers.LlamaConfig,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    ),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),  # != hidden / heads = 16
    "mistral": (transformers.MistralConfig, {}),
}

PROMPT_LENS = (5, 11, 23)
NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def registered_models() -> dict[str, object]:
    found: dict[str, object] = {}
    model_plugins.register_models(lambda name, factory, config=None: found.__setitem__(name, factory))
    return found


def make_hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny HF model whose every parameter (norms and biases too) is random, so loading bugs show."""
    config_cls, extra = CASES[case]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.5 if "embed" in name else 0.15)
    # No early stop: compare full-length greedy continuations.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def load_ours(path: Path, **runner_kwargs: int) -> tuple[torch.nn.Module, MiniRunner]:
    config = load_hf_config(path)
    factory = registered_models()[config.architectures[0]]
    model = build_model(config, factory, None, torch.float32, "cpu", path, progress=False)
    attn = model.model.layers[0].self_attn
    runner = MiniRunner(
        TorchNativeAttnBackend,
        model=model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        **runner_kwargs,
    )
    return model, runner


def prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit all-ones mask: otherwise HF infers one from pad_token_id and masks prompt tokens
    # that happen to equal it.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_full_prompt_logits_match_hf(checkpoint) -> None:
    _, hf, path = checkpoint
    model, runner = load_ours(path)
    prompt = prompts()[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = runner.logits(runner.extend_batch([runner.new_request()], [prompt]), all_tokens=True)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # Not all near-equal: a test whose logits are all ties could not tell models apart.
    assert expected.std() > 1.0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_batched_greedy_matches_hf_generate(checkpoint) -> None:
    _, hf, path = checkpoint
    _, runner = load_ours(path)
    ps = prompts()
    got = runner.generate(ps, NEW_TOKENS)
    expected = [hf_greedy(hf, p) for p in ps]
    assert got == expected
    assert len({tuple(e) for e in expected}) == len(ps)


@pytest.mark.parametrize("case", ["llama_gqa", "qwen3"])
def test_chunked_paged_shared_prefix_matches_hf(case: str, tmp_path: Path) -> None:
    """Chunked prefill on top of a cached prefix shared between requests, page size 16."""
    hf = make_hf_model(case, seed=3)
    hf.save_pretrained(tmp_path)
    _, runner = load_ours(tmp_path, page_size=16, num_pages=64)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (16,), generator=gen).tolist()
    ps = [prefix + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    got = runner.generate(ps, NEW_TOKENS, chunk_size=7, shared_prefix_len=16)
    assert got == [hf_greedy(hf, p) for p in ps]


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_model("llama_gqa", seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shards) >= 2
    names = [n for n, _ in iter_safetensors_weights(tmp_path, progress=False)]
    assert len(names) == len(set(names)) == len(hf.state_dict())
    _, runner = load_ours(tmp_path)
    prompt = prompts()[1]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = runner.logits(runner.extend_batch([runner.new_request()], [prompt]), all_tokens=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_bfloat16_load_runs_close_to_hf(tmp_path: Path) -> None:
    """bf16 weights and KV cache: only close to HF (GEMM shapes differ), but every dtype path runs."""
    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    model = build_model(config, registered_models()["Qwen3ForCausalLM"], None, torch.bfloat16, "cpu", tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    attn = model.model.layers[0].self_attn
    runner = MiniRunner(
        TorchNativeAttnBackend,
        model=model,
        num_layers=2,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        dtype=torch.bfloat16,
    )
    prompt = prompts()[2]
    with torch.inference_mode():
        expected = hf.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    got = runner.logits(runner.extend_batch([runner.new_request()], [prompt]), all_tokens=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0.25)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    hf = make_hf_model("llama_gqa")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = load_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        build_model(config, registered_models()["LlamaForCausalLM"], None, torch.float32, "cpu", tmp_path)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    hf = make_hf_model("llama_tied_mqa_bias")
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model, _ = load_ours(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_registers_all_architectures() -> None:
    assert set(registered_models()) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
    }


# --- loader helpers and layers against their transformers counterparts -------------------------


def test_resolve_dtype() -> None:
    # On CPU auto depends on the CPU (native bf16 or not): tests/engine/test_dtype_choice.py.
    assert resolve_dtype(torch.bfloat16, "auto", "cpu", native_bf16=lambda: False) == torch.float32
    assert resolve_dtype("bfloat16", "auto", "cuda") == torch.bfloat16
    assert resolve_dtype(None, "auto", "cuda:0") == torch.float32
    assert resolve_dtype(torch.float16, "bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype(None, "float16", "cuda") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype(None, "float8", "cpu")


def test_load_generation_config(tmp_path: Path) -> None:
    assert load_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 7, "temperature": 0.6, "top_p": 0.9, "transformers_version": "x"})
    )
    assert load_generation_config(tmp_path) == {"eos_token_id": [7], "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "top_k": 20}))
    assert load_generation_config(tmp_path) == {"eos_token_id": [1, 2], "top_k": 20}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 64), (1, 768), (300, 768), (5, 3, 128)])
@pytest.mark.parametrize("c_kernel", [True, False])
def test_rmsnorm_matches_hf(dtype: torch.dtype, shape: tuple[int, ...], c_kernel: bool,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Bitwise for the torch ops (the C kernel switched off), and for the C kernel (it sums the
    squares in another order) within a few float roundings in fp32 and one bf16 rounding step in
    bf16, at the widths and row counts of real models."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if not c_kernel:
        monkeypatch.setattr(layers, "rms_norm", lambda *args, **kwargs: None)

    torch.manual_seed(0)
    width = shape[-1]
    ours, theirs = layers.RMSNorm(width, eps=1e-6).to(dtype), LlamaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(*shape) * 3).to(dtype)
    with torch.no_grad():
        got, expected = ours(x), theirs(x)
    if not c_kernel:
        assert torch.equal(got, expected)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)
        assert (got != expected).float().mean() < 0.01  # a rare element one bf16 step off


@pytest.mark.parametrize("case", ["llama_gqa", "llama3_rope", "llama_linear_rope"])
def test_rotary_matches_hf(case: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config_cls, extra = CASES[case]
    config = config_cls(**{**COMMON, **extra})
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    rope = layers.get_rope(config, head_dim)
    positions = torch.tensor([0, 1, 7, 31, 32, 100, 255])
    q, k = torch.randn(7, 4 * head_dim), torch.randn(7, 2 * head_dim)
    got_q, got_k = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    exp_q, exp_k = apply_rotary_pos_emb(q.view(1, 7, 4, head_dim), k.view(1, 7, 2, head_dim), cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(got_q, exp_q.reshape(7, -1), rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, exp_k.reshape(7, -1), rtol=0, atol=2e-6)


def test_partial_rotary_matches_stablelm() -> None:
    from transformers.models.stablelm import modeling_stablelm as stablelm

    config = transformers.StableLmConfig(
        hidden_size=64, num_attention_heads=2, partial_rotary_factor=0.25, max_position_embeddings=64
    )
    head_dim, rotary_dim = 32, 8
    rope = layers.get_rope(config, head_dim)
    assert rope.rotary_dim == rotary_dim
    positions = torch.arange(0, 60, 3)
    q, k = torch.randn(len(positions), 2 * head_dim), torch.randn(len(positions), 2 * head_dim)
    got_q, got_k = rope(positions, q, k)
    cos, sin = stablelm.StableLmRotaryEmbedding(config)(q, positions[None])
    qh = q.view(1, -1, 2, head_dim).transpose(1, 2)
    kh = k.view(1, -1, 2, head_dim).transpose(1, 2)
    q_rot, k_rot = stablelm.apply_rotary_pos_emb(qh[..., :rotary_dim], kh[..., :rotary_dim], cos, sin)
    exp_q = torch.cat((q_rot, qh[..., rotary_dim:]), dim=-1).transpose(1, 2).reshape(len(positions), -1)
    exp_k = torch.cat((k_rot, kh[..., rotary_dim:]), dim=-1).transpose(1, 2).reshape(len(positions), -1)
    torch.testing.assert_close(got_q, exp_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, exp_k, rtol=0, atol=2e-6)
