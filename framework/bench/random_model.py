"""Random-weight models of a given shape, written in Hugging Face format (nothing downloaded).

``llama-120m`` is the benchmark model of the performance goals: hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000 (134M parameters with untied embeddings), fp32.

Each model gets a byte-level BPE tokenizer of exactly its vocab size, trained here on generated
text, so every token id a random workload or a random model produces decodes to text, and text
prompts round-trip: a benchmark over HTTP then pays for real tokenization and detokenization.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict] = {
    "llama-120m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                       intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048),
    "llama-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=1024),
}

WORDS_PER_TOKEN = 8
"""Words of generated text the tokenizer is trained on, per token of its vocab: enough distinct
pairs for every merge (32,000 tokens take a few seconds, once per model directory)."""

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "st", "tr", "ch", "sh", "th", "pl", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "é", "ö", "ü", "日", "本"]
_CODAS = ["", "n", "r", "s", "t", "l", "m", "ng", "ck", "x"]


def generated_text(words: int, seed: int = 0) -> Iterator[str]:
    """Lines of pseudo-words (syllables, some with multi-byte characters) and punctuation."""
    rng = random.Random(seed)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    for _ in range(0, words, 12):
        line = " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(12))
        yield line + rng.choice([".", ",", "!", "?", ";", "\n"])


def build_covering_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens.

    BPE is trained on :func:`generated_text` up to ``vocab_size``; should it run out of merges
    first, reserved special tokens fill the rest (as Llama 3 fills its vocab), so that no id below
    ``vocab_size`` is unknown to the tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from framework.testing.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(generated_text(WORDS_PER_TOKEN * vocab_size, seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[0], model_max_length=4096,
    )
    missing = vocab_size - len(fast)
    if missing > 0:
        fast.add_special_tokens({"additional_special_tokens": [f"<|reserved_{i}|>" for i in range(missing)]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_random_model(preset: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a random Llama of ``preset`` shape into ``directory`` (reused if already there)."""
    from framework.testing.tiny_models import save_tiny_model

    if preset not in PRESETS:
        raise ValueError(f"unknown random model preset {preset!r}; choose from {', '.join(PRESETS)}")
    path = Path(directory) / preset
    vocab_size = PRESETS[preset]["vocab_size"]
    if (path / "config.json").exists():
        _cover_vocab(path, vocab_size)
        return path
    return save_tiny_model(path, "LlamaForCausalLM", seed=seed, init_std=0.02,
                           tokenizer=build_covering_tokenizer(vocab_size), **PRESETS[preset])


def _cover_vocab(path: Path, vocab_size: int) -> None:
    # A directory written before the tokenizer covered the vocab: give it one that does (the
    # weights do not depend on the tokenizer).
    from transformers import AutoTokenizer

    if len(AutoTokenizer.from_pretrained(path)) < vocab_size:
        build_covering_tokenizer(vocab_size).save_pretrained(path)
