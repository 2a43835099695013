"""Shared fixtures of the multimodal tests: tiny random Qwen2-VL / Qwen2.5-VL checkpoints (saved
once per session), their Hugging Face references, and deterministic test images.

Other test packages (the HTTP tests) import these through ``pytest_plugins`` or call
:mod:`framework.testing.tiny_vl_models` directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from framework.testing.tiny_vl_models import make_image, save_tiny_vl_model

VL_ARCHITECTURES = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]


@pytest.fixture(scope="session")
def qwen2_vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL checkpoint directory (weights, tokenizer, image processor)."""
    return save_tiny_vl_model(tmp_path_factory.mktemp("qwen2-vl") / "model", "Qwen2VLForConditionalGeneration")


@pytest.fixture(scope="session")
def qwen2_5_vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint directory."""
    return save_tiny_vl_model(tmp_path_factory.mktemp("qwen2.5-vl") / "model", "Qwen2_5_VLForConditionalGeneration")


@pytest.fixture(scope="session", params=VL_ARCHITECTURES, ids=["qwen2_vl", "qwen2_5_vl"])
def vl_model(request: pytest.FixtureRequest) -> Path:
    """Each tiny VL checkpoint in turn."""
    name = "qwen2_vl_model" if request.param == VL_ARCHITECTURES[0] else "qwen2_5_vl_model"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def images() -> list[Any]:
    """Three deterministic RGB images of different sizes (6, 16 and 4 image tokens)."""
    return [make_image(60, 40, seed=0), make_image(100, 120, seed=1), make_image(56, 56, seed=2)]
