"""Fixtures for the RL tests: two tiny random checkpoints of one architecture (the second is the
"trained" version) and big enough that releasing their memory is visible in the process's RSS."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.testing.tiny_models import save_tiny_model

SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
KV_TOKENS = 65536
"""64 Ki tokens x 4 layers x 2 KV heads x 64 dims x 4 bytes x (K + V) = 256 MiB of KV cache."""
MAX_NEW = 8


@pytest.fixture(scope="session")
def rl_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the served checkpoint, a second one with other random weights, same architecture)."""
    root = tmp_path_factory.mktemp("rl-models")
    return (save_tiny_model(root / "v0", seed=0, **SHAPE), save_tiny_model(root / "v1", seed=1, **SHAPE))


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def hf_greedy(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
