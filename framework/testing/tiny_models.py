"""Tiny random-weight Hugging Face models with a locally trained tokenizer, for tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few built-in sentences and
the model is a transformers model with random weights, saved with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = [
    "To be, or not to be, that is the question.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "All the world's a stage, and all the men and women merely players.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂 and more.",
    "Numbers 0123456789 and symbols !@#$%^&*()[]{} are tokens too.",
]


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    init_std: float = 0.5,
    tokenizer: Any = None,
    **config_overrides: Any,
) -> Path:
    """Build, randomly initialise and save a tiny model of ``architecture`` with a tokenizer
    (``tokenizer``, else :func:`build_tokenizer`'s); the vocab is at least the tokenizer's."""
    import transformers

    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    vocab = max(len(tokenizer), config_overrides.pop("vocab_size", 0))
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[architecture]
    params: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=init_std, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    params.update(config_overrides)
    config = config_cls(**params)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
