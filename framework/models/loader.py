"""Loading Hugging Face checkpoints: config, dtype choice, safetensors weights and the model itself.

Which model class serves an architecture is the model registry's decision; this module only builds
the module it is given and fills it from a local checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from framework.distributed.state import get_tensor_parallel
from framework.models import cpu_features

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_SAFETENSORS_SINGLE = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"

# Generation defaults worth passing on to the sampler when a checkpoint ships them.
_GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "do_sample",
    "max_new_tokens",
    "bos_token_id",
    "pad_token_id",
)


def load_hf_config(path: str | os.PathLike[str]) -> Any:
    """The transformers config of a local checkpoint directory (never downloads)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)


def _as_dtype(value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(
    config_dtype: Any,
    override: str,
    device: str | torch.device,
    native_bf16: Callable[[], bool] | None = None,
) -> torch.dtype:
    """Choose the dtype the weights are served in.

    ``override`` is ``"auto"`` or an explicit dtype name (``float32``, ``bfloat16``, ``float16``),
    which is always honoured. ``"auto"`` means the checkpoint's ``dtype``/``torch_dtype`` on a GPU.
    On CPU it means bfloat16 for a bfloat16 checkpoint where the CPU has native bf16 dot products
    (AVX512-BF16 or AMX; ``native_bf16`` answers, by default
    :func:`~framework.models.cpu_features.cpu_has_native_bf16`), as SGLang and vLLM choose, and
    float32 otherwise: CPUs without them (AVX2-only) run bf16 matmuls many times slower than fp32,
    and fp16 has no fast CPU path at all. A checkpoint that declares no dtype is served in float32,
    as transformers does.
    """
    if override != "auto":
        return _as_dtype(override)  # type: ignore[return-value]
    declared = _as_dtype(config_dtype)
    if torch.device(device).type == "cpu":
        if declared != torch.bfloat16:
            return torch.float32
        return torch.bfloat16 if (native_bf16 or cpu_features.cpu_has_native_bf16)() else torch.float32
    return declared or torch.float32


def config_dtype(hf_config: Any) -> Any:
    """The dtype a config declares (transformers 5 calls it ``dtype``, 4 called it ``torch_dtype``)."""
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (by its index, else the single file, else
    every ``*.safetensors``); FileNotFoundError when there are none."""
    index = os.path.join(path, _SAFETENSORS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(path, _SAFETENSORS_SINGLE)
    if os.path.exists(single):
        return [single]
    # A checkpoint with shards but no index (rare, hand-made): take every safetensors file.
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path} (only .safetensors is supported)")
    return [os.path.join(path, f) for f in files]


class LazyTensor:
    """A checkpoint tensor not read yet: its ``shape``, and indexing (``t[a:b]``, ``t[:, a:b]``)
    that reads only the rows or columns asked for. A tensor-parallel rank loads its shards through
    these (``framework.models.parallel``), so it never reads the other ranks' parts. Casting
    (``torch.as_tensor``-like use) goes through :meth:`full`."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]

    def full(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]


def iter_safetensors_weights(path: str | os.PathLike[str], progress: bool = True,
                             lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, cpu_tensor)`` for every tensor of a single-file or sharded safetensors checkpoint
    (``(name, LazyTensor)`` with ``lazy``: what a tensor-parallel model's loader slices).

    Shards are opened one at a time and tensors are read lazily, so peak host memory stays around
    one tensor rather than one shard. The progress bar counts tensors over all shards.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(os.fspath(path))
    handles = [safe_open(f, framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file, handle in zip(files, handles, strict=True):
            bar.set_postfix_str(os.path.basename(file))
            for name in handle.keys():
                yield name, LazyTensor(handle, name) if lazy else handle.get_tensor(name)
                bar.update(1)


def load_generation_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The useful parts of ``generation_config.json``: ``eos_token_id`` (always a list) and sampling
    defaults (``temperature``, ``top_p``, ``top_k``, ...) when present. Empty if there is no file."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        raw: dict[str, Any] = json.load(f)
    out: dict[str, Any] = {k: raw[k] for k in _GENERATION_KEYS if raw.get(k) is not None}
    eos = raw.get("eos_token_id")
    if eos is not None:
        out["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos)
    return out


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype`` for the duration of a ``with`` block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one Parameter object (e.g. a tied ``lm_head.weight``), first name first."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    # ``to_empty`` gives every parameter slot its own new tensor, which silently unties weights.
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, shared)


def build_model(
    hf_config: Any,
    factory: Callable[[Any, Any], nn.Module],
    options: Any,
    dtype: torch.dtype,
    device: str | torch.device,
    path: str | os.PathLike[str],
    progress: bool = True,
) -> nn.Module:
    """Construct ``factory(hf_config, options)`` on ``device`` in ``dtype`` and load its weights.

    The module is created on the meta device (no time spent on random init, no double memory), then
    materialised empty on ``device``. Modules that own computed buffers (rotary tables) re-create
    them in a ``reset_buffers()`` method, which is called here. Every parameter is filled with NaN
    before ``model.load_weights(...)`` runs, so a parameter (or a shard of a merged one) that the
    checkpoint did not provide is detected and reported by name. Tied parameters count once.
    """
    device = torch.device(device)
    with torch.device("meta"), default_dtype(dtype):
        model = factory(hf_config, options)
    groups = _tied_groups(model)
    model = model.to_empty(device=device)
    _retie(model, groups)
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()
        for param in model.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))
        # A tensor-parallel rank reads only its slices of each tensor.
        lazy = get_tensor_parallel().size > 1
        model.load_weights(iter_safetensors_weights(path, progress=progress, lazy=lazy))
        missing = [
            name
            for name, param in model.named_parameters()
            if param.is_floating_point() and bool(torch.isnan(param).any())
        ]
    if missing:
        raise ValueError(f"checkpoint {os.fspath(path)} did not provide (all of) these weights: {', '.join(missing)}")
    logger.info("loaded %s from %s as %s on %s", type(model).__name__, os.fspath(path), dtype, device)
    return model.eval()
