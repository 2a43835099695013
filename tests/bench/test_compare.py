"""``plugserve bench compare`` on the llama-tiny random model with a handful of prompts."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest

from benchmarks.compare import _peer, agreement, ratios, run_vllm
from framework.bench.datasets import BenchRequest
from framework.cli.main import main

pytestmark = pytest.mark.timeout(180)


def test_compare_plugserve_transformers_and_vllm_skip(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the random model is written under here
    out = tmp_path / "results.jsonl"
    rc = main(["bench", "compare", "--random-model", "llama-tiny", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "8", "--output", str(out), "--tag", "t", "device.num_threads=1"])
    assert rc == 0
    row = json.loads(out.read_text())
    assert row["kind"] == "compare" and row["tag"] == "t" and row["model"]["architecture"] == "LlamaForCausalLM"
    systems = row["systems"]
    for name in ("plugserve", "transformers"):
        # the same workload through each: 4 x 16 prompt tokens, exactly 4 x 8 generated
        assert systems[name]["input_tokens"] == 64 and systems[name]["output_tokens"] == 32, name
        assert systems[name]["output_throughput"] > 0
    assert systems["transformers"]["batch_size"] == 4
    assert 0.0 <= systems["transformers"]["greedy_agreement_with_plugserve"] <= 1.0
    assert row["ratios"]["plugserve/transformers"] == pytest.approx(
        systems["plugserve"]["output_throughput"] / systems["transformers"]["output_throughput"], rel=1e-2)
    printed = capsys.readouterr().out
    assert "plugserve/transformers" in printed
    if importlib.util.find_spec("vllm") is None:
        assert systems["vllm"]["skipped"].startswith("vllm is not installed")
        assert "vllm           skipped: vllm is not installed" in printed
        assert "plugserve/vllm" not in row["ratios"]
    # llama.cpp only ever runs in its own venv: without --llamacpp-python it is a recorded skip
    assert systems["llama.cpp"] == {"skipped": "llama.cpp runs only in its own venv: pass --llamacpp-python"}


def test_ratios_ignore_skipped_peers() -> None:
    systems = {"plugserve": {"output_throughput": 150.0}, "transformers": {"output_throughput": 75.0},
               "vllm": {"skipped": "not installed"}}
    assert ratios(systems) == {"plugserve/transformers": 2.0}


class _FakeVLLM(types.ModuleType):
    """Just enough of vllm's offline API for run_vllm's code path (vLLM itself needs its own wheel)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__("vllm")
        fail_now = fail

        class SamplingParams:
            def __init__(self, temperature: float, max_tokens: int, ignore_eos: bool) -> None:
                assert temperature == 0.0 and ignore_eos
                self.max_tokens = max_tokens

        class LLM:
            def __init__(self, model: str, dtype: str, seed: int) -> None:
                if fail_now:
                    raise RuntimeError("no CPU backend")
                assert dtype == "float32"

            def generate(self, prompts, params, use_tqdm):
                return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * p.max_tokens)])
                        for _ in prompts for p in [params[0]]]

        self.LLM, self.SamplingParams = LLM, SamplingParams


def test_run_vllm_code_path_with_a_stub(monkeypatch) -> None:
    reqs = [BenchRequest([20, 21], 3), BenchRequest([22, 23, 24], 3)]
    monkeypatch.setitem(sys.modules, "vllm", _FakeVLLM())
    tokens: list[list[int]] = []
    fig = run_vllm("/nowhere", reqs, tokens)
    assert fig["output_tokens"] == 6 and fig["input_tokens"] == 5 and tokens == [[7, 7, 7], [7, 7, 7]]
    monkeypatch.setitem(sys.modules, "vllm", _FakeVLLM(fail=True))
    assert _peer("vllm", lambda: run_vllm("/nowhere", reqs)) == {"skipped": "vllm failed: RuntimeError: no CPU backend"}
    assert agreement([[1, 2], [3]], [[1, 2], [4]]) == 0.5


FAKE_VLLM_PACKAGE = '''
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, ids):
        self.token_ids = ids

class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]

class LLM:
    def __init__(self, model, dtype, seed):
        assert dtype == "float32"

    def generate(self, prompts, params, use_tqdm):
        # echo each prompt's first id max_tokens times: the caller must get them back in order
        return [_Req([p["prompt_token_ids"][0]] * sp.max_tokens) for p, sp in zip(prompts, params)]
'''


def test_vllm_in_its_own_interpreter_plumbing(tmp_path: Path, monkeypatch) -> None:
    """``--vllm-python``: the job goes to vllm_peer.py in a subprocess and the results come back in order.
    A stand-in vllm package (vLLM needs its own venv) checks the plumbing, not vLLM."""
    from benchmarks.compare import run_vllm_elsewhere

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM_PACKAGE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    reqs = [BenchRequest([20, 21], 3), BenchRequest([22, 23, 24], 2)]
    tokens: list[list[int]] = []
    fig = run_vllm_elsewhere(sys.executable, "some-model", reqs, tokens)
    assert tokens == [[20, 20, 20], [22, 22]]
    assert fig["output_tokens"] == 5 and fig["input_tokens"] == 5 and fig["output_throughput"] > 0
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="(?s)vllm_peer.py exited with 1.*No module named 'vllm'"):
        run_vllm_elsewhere(sys.executable, "some-model", reqs)


def test_gguf_cache_key_follows_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A rewritten checkpoint (new weights, same directory) must be converted again, not reused."""
    from benchmarks.compare import gguf_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    first = gguf_path(str(model), "f32")
    assert first.startswith(str(tmp_path / "tmp" / "plugserve-gguf")) and first.endswith("-f32.gguf")
    assert gguf_path(str(model), "f32") == first and gguf_path(str(model), "f16") != first
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert gguf_path(str(model), "f32") != first


LLAMACPP_PYTHON = os.environ.get("PLUGSERVE_LLAMACPP_PYTHON")
LLAMACPP_CONVERTER = os.environ.get("PLUGSERVE_LLAMACPP_CONVERTER")


@pytest.mark.skipif(not (LLAMACPP_PYTHON and LLAMACPP_CONVERTER),
                    reason="llama-cpp-python compiles llama.cpp at install (~16 min on 2 cores), so CI does not "
                           "install it; set PLUGSERVE_LLAMACPP_PYTHON and PLUGSERVE_LLAMACPP_CONVERTER to run")
def test_llamacpp_peer_generates_the_same_greedy_tokens(tmp_path: Path, monkeypatch) -> None:
    """The real llama.cpp in its own venv: the checkpoint is converted to GGUF f32, every request gets
    exactly its output length, and greedy tokens agree with plugserve's on most requests (a near-tie
    in a random model may flip one; a wrong conversion or position bug would flip nearly all)."""
    from benchmarks.compare import run_llamacpp_elsewhere
    from framework.bench.datasets import random_dataset
    from framework.bench.offline import run_offline
    from framework.bench.random_model import make_random_model
    from framework.config.loader import resolve_config
    from framework.engine.engine import Engine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = make_random_model("llama-tiny", tmp_path / "models")
    requests = random_dataset(6, 24, 10, 512, seed=3, range_ratio=0.5)
    ours: list[list[int]] = []
    run_offline(Engine(resolve_config(None, [f"model.path={path}"]), progress=False), requests, outputs=ours)
    theirs: list[list[int]] = []
    fig = run_llamacpp_elsewhere(LLAMACPP_PYTHON, LLAMACPP_CONVERTER, str(path), requests, theirs)
    assert [len(t) for t in theirs] == [r.output_len for r in requests]
    assert fig["output_tokens"] == sum(r.output_len for r in requests) and fig["output_throughput"] > 0
    assert agreement(ours, theirs) >= 0.5, (ours, theirs)


def test_llamacpp_job_matches_plugserves_precision(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp defaults to an f16 KV cache; the job must ask for plugserve's KV precision instead
    (and a GGUF of the model's dtype), or the comparison reads half the K/V bytes on one side."""
    from benchmarks import compare

    jobs = []
    monkeypatch.setattr(compare, "_run_peer_script", lambda py, script, job, reqs, outs: jobs.append((script, job)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    reqs = [BenchRequest([1, 2], 3)]
    compare.run_llamacpp_elsewhere("py", "conv.py", str(tmp_path / "m"), reqs, threads=2)
    compare.run_llamacpp_elsewhere("py", "conv.py", str(tmp_path / "m"), reqs, threads=2, kv_dtype="bfloat16")
    assert [j["kv_type"] for _, j in jobs] == ["float32", "bfloat16"]
    assert all(s == "llamacpp_peer.py" and j["outtype"] == "f32" and j["threads"] == 2 for s, j in jobs)
    from benchmarks.llamacpp_peer import GGML_KV_TYPES

    assert set(GGML_KV_TYPES) >= {"float32", "bfloat16"}
    with pytest.raises(ValueError, match="--llamacpp-converter is needed"):
        compare.run_llamacpp_elsewhere("py", None, str(tmp_path / "m"), reqs)
