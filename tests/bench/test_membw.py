"""``plugserve bench membw`` and ``bench decode-bound`` (issue 21, item 4) on tiny buffers: they
run, write sane JSON, and count the bytes a decode step reads as transformers counts parameters."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from framework.bench.membw import measure_bandwidth, run_membw, weight_bytes_per_token
from framework.cli.main import main
from framework.kernels import small_gemm
from framework.models.cpu_linear import onednn_linear_available
from framework.testing.tiny_models import save_tiny_model


def _sane_gb_s(value: float) -> bool:
    # Any machine streams more than 10 MB/s and less than 100 TB/s.
    return isinstance(value, float) and math.isfinite(value) and 0.01 < value < 1e5


def test_measure_bandwidth_restores_threads() -> None:
    before = torch.get_num_threads()
    row = measure_bandwidth(2**22, 1, 2)
    assert torch.get_num_threads() == before
    assert row["threads"] == 1 and _sane_gb_s(row["read_gb_s"]) and _sane_gb_s(row["copy_gb_s"])


def test_membw_command_writes_sane_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["bench", "membw", "--size-mb", "8", "--repeats", "2", "--threads", "1", "2",
                 "--output", str(out), "--tag", "t"]) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["kind"] == "membw" and record["tag"] == "t" and record["buffer_mb"] == 8
    assert [r["threads"] for r in printed["runs"]] == [1, 2]
    assert all(_sane_gb_s(r[k]) for r in printed["runs"] for k in ("read_gb_s", "copy_gb_s"))
    assert printed["read_gb_s"] == max(r["read_gb_s"] for r in printed["runs"])


def test_default_threads_are_one_and_all() -> None:
    assert [r["threads"] for r in run_membw(4, 1)["runs"]] == sorted({1, torch.get_num_threads()})


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_decode_step_reads(tmp_path: Path, tied: bool) -> None:
    path = save_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM.from_pretrained(path)
    embed = hf.model.embed_tokens.weight.numel()
    # Untied: every weight but the input embedding (one row of it is gathered); tied: the
    # embedding is read whole as the LM head. transformers counts a tied matrix once.
    want = hf.num_parameters() - (0 if tied else embed)
    assert weight_bytes_per_token(str(path), torch.float32) == 4 * want
    assert weight_bytes_per_token(str(path), torch.bfloat16) == 2 * want


def test_decode_bound_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "r.jsonl"
    assert main(["bench", "decode-bound", "--random-model", "llama-tiny", "--size-mb", "8", "--repeats", "2",
                 "--input-len", "16", "--decode-steps", "4", "--output", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "float32" and result["one_batch"]["batch_size"] == 1
    assert result["weight_bytes_per_token"] > 0 and result["kv_bytes_per_token"] > 0
    # A tiny model's step is Python overhead, far from any bound: only positive and finite here.
    assert 0 < result["achieved_gb_s"] < math.inf and 0 < result["fraction_of_bound"] < math.inf
    step_s = result["decode_step_median_ms"] / 1e3
    moved = result["weight_bytes_per_token"] + result["kv_bytes_per_token"]
    assert result["achieved_gb_s"] == pytest.approx(moved / step_s / 1e9, rel=0.03)
    assert result["fraction_of_bound"] == pytest.approx(result["achieved_gb_s"] / result["read_bound_gb_s"], rel=0.03)
    # Three rounds (the default), each a bound and a step back to back; the median round reported.
    fractions = result["round_fractions"]
    assert len(fractions) == len(result["round_steps_ms"]) == len(result["round_bounds_gb_s"]) == 3
    assert result["fraction_of_bound"] == sorted(fractions)[1]
    assert json.loads(out.read_text().splitlines()[-1])["kind"] == "decode-bound"


@pytest.mark.skipif(not onednn_linear_available() or not small_gemm.kernel_available(),
                    reason="needs torch's oneDNN linear ops and a C compiler for the small-GEMM kernel")
def test_gemv_command_times_every_packed_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench gemv`` finds the model's packed layers (per layer: qkv, o, the merged SwiGLU, down;
    plus the LM head), counts their weight bytes as the checkpoint has them, and reports both ways
    at each row count with the engine's choice marked."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "r.jsonl"
    assert main(["bench", "gemv", "--random-model", "llama-tiny", "--rows", "1", "4", "9", "--rounds", "2",
                 "--inner", "1", "--output", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    path = next((tmp_path / "plugserve-bench-models").iterdir())
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert result["dtype"] == "float32" and result["layers"] == 4 * cfg.num_hidden_layers + 1
    # What a decode step reads (input embedding row excluded) less the norms' weights: the linears.
    norms = sum(p.numel() for n, p in transformers.AutoModelForCausalLM.from_config(cfg).named_parameters()
                if "norm" in n)
    assert result["weight_bytes"] == weight_bytes_per_token(str(path), torch.float32) - 4 * norms
    assert [r["rows"] for r in result["results"]] == [1, 4, 9]
    for r in result["results"]:
        assert r["engine_uses"] == ("kernel" if r["rows"] <= small_gemm.max_rows() else "onednn")
        assert _sane_gb_s(r["kernel_gb_s"]) and _sane_gb_s(r["onednn_gb_s"])
        assert r["kernel_speedup"] == pytest.approx(r["onednn_ms"] / r["kernel_ms"], rel=0.01)
    assert json.loads(out.read_text().splitlines()[-1])["kind"] == "gemv"
