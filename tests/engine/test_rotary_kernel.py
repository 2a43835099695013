"""The fused C rotary kernel against the torch form it replaces (bitwise, fp32 and bf16) and transformers."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework.kernels import rotary
from framework.models import layers

pytestmark = pytest.mark.skipif(not rotary.kernel_available(), reason="no C compiler to build the kernel")


def _merged_qkv(n: int, q_heads: int, kv_heads: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32):
    """q, k, v as views into one merged qkv output, as the models produce them (strided rows)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    return qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 64, 257])  # 64 and up take the threaded path
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "partial"),
                         [(12, 12, 64, 1.0), (8, 2, 128, 1.0), (4, 1, 64, 0.25), (6, 3, 40, 0.5)])
def test_bitwise_equal_to_the_torch_ops(n: int, q_heads: int, kv_heads: int, head_dim: int, partial: float,
                                        dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads,
                                      max_position_embeddings=4096,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                                      partial_rotary_factor=partial)
    rope = layers.get_rope(config, head_dim)
    assert rope.rotary_dim == int(head_dim * partial)
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n))
    cos, sin = rope.get_cos_sin(positions, dtype)
    q, k, v = _merged_qkv(n, q_heads, kv_heads, head_dim, seed=n + q_heads, dtype=dtype)
    with torch.inference_mode():
        fused = rotary.rotary_qkv(q, k, v, cos, sin, head_dim)
    assert fused is not None, "the kernel must take fp32 and bf16 views into a merged qkv output"
    expect = (layers.apply_rotary(q, cos, sin, head_dim), layers.apply_rotary(k, cos, sin, head_dim), v)
    for got, ref in zip(fused, expect, strict=True):
        assert got.is_contiguous() and got.shape == ref.shape
        assert torch.equal(got, ref), (got - ref).abs().max()


def test_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    rope = layers.get_rope(config, 64)
    positions = torch.tensor([0, 1, 7, 31, 32, 100, 255, 511])
    q, k, v = _merged_qkv(8, 4, 2, 64, seed=3)
    got_q, got_k, _ = layers.apply_rotary_qkv(q, k, v, *rope.get_cos_sin(positions, torch.float32), 64)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    exp_q, exp_k = apply_rotary_pos_emb(q.reshape(1, 8, 4, 64), k.reshape(1, 8, 2, 64), cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(got_q, exp_q.reshape(8, -1), rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, exp_k.reshape(8, -1), rtol=0, atol=2e-6)


def test_falls_back_where_it_does_not_apply() -> None:
    """fp16 and tensors that need gradients take the torch ops (the kernel returns None)."""
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=64)
    rope = layers.get_rope(config, 64)
    positions = torch.arange(3)
    q, k, v = _merged_qkv(3, 2, 2, 64, seed=0)
    cos, sin = rope.get_cos_sin(positions, torch.float16)
    assert rotary.rotary_qkv(q.half(), k.half(), v.half(), cos, sin, 64) is None
    out = layers.apply_rotary_qkv(q.half(), k.half(), v.half(), cos, sin, 64)
    assert out[0].dtype == torch.float16 and torch.equal(out[0], layers.apply_rotary(q.half(), cos, sin, 64))
    bf16_cos, bf16_sin = rope.get_cos_sin(positions, torch.bfloat16)
    assert rotary.rotary_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16(), cos, sin, 64) is None  # cos/sin of another dtype
    assert rotary.rotary_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16(), bf16_cos, bf16_sin, 64) is not None
    cos, sin = rope.get_cos_sin(positions, torch.float32)
    qg = q.clone().requires_grad_()
    assert rotary.rotary_qkv(qg, k, v, cos, sin, 64) is None
    layers.apply_rotary_qkv(qg, k, v, cos, sin, 64)[0].sum().backward()
    assert qg.grad is not None
