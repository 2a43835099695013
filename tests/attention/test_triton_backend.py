"""The ``triton`` backend: its kernels pass the conformance kit, and greedy generation with it equals
torch_native's.

With a GPU the kernels are compiled and run in this process. Without one they run under Triton's
interpreter in a subprocess (see ``triton_worker.py``), with tiny shapes; the interpreter is slow,
so the default run checks a covering subset of the grid in fp32 (each page size, GQA ratio and head
dim in each scenario) plus one case per half type, and ``--run-slow`` the whole grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from framework.errors import ConfigError
from framework.testing.attention_conformance import ConformanceCase, assert_conformant, conformance_cases
from plugins.attention.triton import TritonAttnBackend, TritonOptions

pytest.importorskip("triton", reason="the triton package is not installed (pip install 'plugserve[triton]')")

GPU = torch.cuda.is_available()
REPO_ROOT = Path(__file__).resolve().parents[2]

# A covering subset: each page size, GQA ratio (1, 4, 8) and head dim (64, 128) in each scenario.
SHAPES = [(1, 2, 2, 128), (16, 8, 2, 64), (16, 16, 2, 128)]
SUBSET = [
    ConformanceCase(scenario, page, h, hkv, d, torch.float32)
    for (page, h, hkv, d) in SHAPES
    for scenario in ("extend", "prefix", "decode")
] + [ConformanceCase("prefix", 16, 8, 2, 64, dt) for dt in (torch.bfloat16, torch.float16)]


def run_worker(*args: str, timeout: float) -> object:
    """Run ``triton_worker.py`` under the interpreter; its JSON answer is the last stdout line."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.attention.triton_worker", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"triton worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@cache
def subset_results() -> dict[str, dict]:
    """The whole subset in one interpreter subprocess (one torch/triton start-up, not one per case)."""
    results = run_worker("conformance", *(str(c) for c in SUBSET), timeout=240)
    return {r["case"]: r for r in results}  # type: ignore[union-attr]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SUBSET, ids=str)
def test_conformance_subset(case: ConformanceCase) -> None:
    if GPU:
        from framework.testing.attention_conformance import assert_case_conformant

        assert_case_conformant(TritonAttnBackend, case, device="cuda")
        return
    result = subset_results()[str(case)]
    assert result["passed"], result["line"] + "\n" + (result["error"] or "")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_conformance_whole_grid() -> None:
    if GPU:
        print(assert_conformant("triton", device="cuda"))
        return
    cases = conformance_cases("cpu")
    results = run_worker("conformance", *(str(c) for c in cases), timeout=3500)
    failures = [r["line"] for r in results if not r["passed"]]  # type: ignore[union-attr]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_conformance_whole_grid_on_gpu() -> None:
    print(assert_conformant("triton", device="cuda", cases=conformance_cases("cuda")))


@pytest.mark.timeout(300)
def test_greedy_generation_equals_torch_native(tmp_path) -> None:
    """A tiny Llama (head_dim 16, GQA 2) through the Engine; pages of 16, chunked prefill and a radix
    hit exercise the prefix path of the kernel."""
    from framework.testing.tiny_models import save_tiny_model

    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    if GPU:
        from tests.attention.triton_worker import generate

        outputs = generate(str(path), device="cuda")
    else:
        outputs = run_worker("generate", str(path), timeout=280)
    assert outputs["triton"] == outputs["torch_native"]  # type: ignore[index]


def test_cpu_without_interpreter_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="attention.backend=triton needs a GPU; on CPU it runs only under"):
        TritonAttnBackend(SimpleNamespace(device="cpu"), None)


def test_bad_tile_option_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="attention.options.block_kv: 24 must be a power of two >= 16"):
        TritonAttnBackend(SimpleNamespace(device="cpu"), TritonOptions(block_kv=24))


def test_registered_through_the_entry_point(plugins) -> None:
    comp = plugins.registry.get("attention_backend", "triton")
    assert comp.factory is TritonAttnBackend and comp.options_cls is TritonOptions
    assert plugins.infos["triton"].builtin
