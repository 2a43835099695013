"""Embedded assets shipped inside the plugserve package, so it can serve a model with no download.

Each asset is a sub-directory in Hugging Face format (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``), loadable with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` like any hub model:

``tiny-shakespeare``
    A ~3.5M-parameter ``LlamaForCausalLM`` (GQA, tied embeddings, fp32) with a 2048-token byte-level
    BPE tokenizer and a ``<|user|>`` / ``<|assistant|>`` / ``<|end|>`` chat template, trained on the
    Tiny Shakespeare corpus. It is the server's default model. Rebuild it with
    ``python scripts/train_demo_model.py``; its ``training_log.json`` records losses and versions.
"""

from __future__ import annotations

from pathlib import Path

_ASSETS_DIR = Path(__file__).resolve().parent


def available_assets() -> list[str]:
    """Names of the embedded assets, sorted."""
    return sorted(p.name for p in _ASSETS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def asset_path(name: str) -> Path:
    """Return the directory of the embedded asset ``name`` (e.g. ``"tiny-shakespeare"``).

    Raises:
        FileNotFoundError: if there is no such asset; the message lists the available names.
    """
    path = _ASSETS_DIR / name
    # Reject anything that is not a plain child name, so a config value cannot escape the package.
    if not name or Path(name).name != name or name.startswith(("_", ".")) or not path.is_dir():
        available = ", ".join(available_assets()) or "none"
        raise FileNotFoundError(f"no embedded asset named {name!r}; available: {available}")
    return path


__all__ = ["asset_path", "available_assets"]
