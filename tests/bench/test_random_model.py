"""Random bench models get a tokenizer that covers their vocab (issue 21, item 8), and bench
commands run them in fp32 explicitly (item 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from framework.bench import random_model
from framework.bench.random_model import PRESETS, build_covering_tokenizer, make_random_model
from framework.testing.tiny_models import build_tokenizer


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tokenizer_has_exactly_the_preset_vocab(preset: str) -> None:
    vocab = PRESETS[preset]["vocab_size"]
    tok = build_covering_tokenizer(vocab)
    assert len(tok) == vocab
    # Trained merges, not filler: the vocabulary is BPE all the way up.
    assert not any(t.startswith("<|reserved_") for t in tok.get_vocab())
    text = "héllo wörld, 日本 and the quick brown fox."
    assert tok.decode(tok.encode(text)) == text


def test_every_id_of_the_model_decodes(tmp_path: Path) -> None:
    path = make_random_model("llama-tiny", tmp_path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) >= vocab == PRESETS["llama-tiny"]["vocab_size"]
    # Every id is a real token: a special one, or one with text of its own.
    specials = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    blank = [i for i in range(vocab) if i not in specials and tok.decode([i]) == ""]
    assert blank == []


def test_a_model_written_before_keeps_its_weights_and_gets_a_covering_tokenizer(tmp_path: Path) -> None:
    from framework.testing.tiny_models import save_tiny_model

    old = save_tiny_model(tmp_path / "llama-tiny", "LlamaForCausalLM", **PRESETS["llama-tiny"])
    assert len(AutoTokenizer.from_pretrained(old)) < PRESETS["llama-tiny"]["vocab_size"]
    weights = (old / "model.safetensors").read_bytes()
    assert make_random_model("llama-tiny", tmp_path) == old
    assert len(AutoTokenizer.from_pretrained(old)) == PRESETS["llama-tiny"]["vocab_size"]
    assert (old / "model.safetensors").read_bytes() == weights


def test_reserved_tokens_fill_a_vocab_the_corpus_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random_model, "WORDS_PER_TOKEN", 0)  # no text: only the byte alphabet
    tok = build_covering_tokenizer(400)
    assert len(tok) == 400
    assert len(build_tokenizer()) < 400  # the tests' own tokenizer would not have covered it


def test_bench_runs_random_models_in_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from framework.bench.offline import engine_from_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = argparse.Namespace(random_model="llama-tiny", model_path=None, config=None, overrides=[])
    _, cfg = engine_from_args(args)
    assert cfg.model.dtype.value == "float32"
    args.overrides = ["model.dtype=bfloat16"]  # an explicit choice still wins
    engine, cfg = engine_from_args(args)
    assert cfg.model.dtype.value == "bfloat16" and str(engine.runner.dtype) == "torch.bfloat16"
