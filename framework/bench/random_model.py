"""Random-weight models of a given shape, written in Hugging Face format (nothing downloaded).

``llama-120m`` is the benchmark model of the performance goals: hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000 (134M parameters with untied embeddings), fp32.
"""

from __future__ import annotations

from pathlib import Path

PRESETS: dict[str, dict] = {
    "llama-120m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                       intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048),
    "llama-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=1024),
}


def make_random_model(preset: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a random Llama of ``preset`` shape into ``directory`` (reused if already there)."""
    from framework.testing.tiny_models import save_tiny_model

    if preset not in PRESETS:
        raise ValueError(f"unknown random model preset {preset!r}; choose from {', '.join(PRESETS)}")
    path = Path(directory) / preset
    if (path / "config.json").exists():
        return path
    return save_tiny_model(path, "LlamaForCausalLM", seed=seed, init_std=0.02, **PRESETS[preset])
