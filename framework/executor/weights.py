"""The served model's weights after start: updates in place, reads by name, release and resume.

RL trainers push new weights between rollouts (``/update_weights_from_disk``, ``_from_tensor``,
``_from_distributed``). Every update is checked before anything is written: names and shapes go
through the model's own ``load_weights`` on a meta-device copy of the network (no memory, same
name mapping, merged-parameter shards included), so a mismatch names the tensor and the served
weights stay as they were. Then only the layers the update touches are unpacked from oneDNN's
layout (CPU), written in place and packed again; on GPU the write is in place outright, so CUDA
graphs and registered buffers keep their addresses.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from framework.distributed.state import get_tensor_parallel
from framework.memory.heap import trim_heap
from framework.memory.memory_saver import MemorySaver
from framework.models.cpu_linear import PackedLinear, pack_linear_layers, unpack_linear_layers
from framework.models.loader import default_dtype, iter_safetensors_weights, load_hf_config, safetensors_files

logger = logging.getLogger(__name__)

#: Config fields that must match for a checkpoint to be a new version of the served model.
IDENTITY_FIELDS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")


class WeightUpdateError(ValueError):
    """An update that does not fit the served model; nothing was written. ``name`` is the
    offending tensor (or config field), for the 400 the client gets."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class ModelWeights:
    """Weight operations on a model runner's model (see the module docstring)."""

    def __init__(self, model: nn.Module, factory: Any, options: Any, hf_config: Any, dtype: torch.dtype,
                 packed: bool, saver: MemorySaver, small_gemm: bool = False, huge_pages: bool = True,
                 prefill_gemm: str = "onednn") -> None:
        self.model = model
        self._factory, self._options, self._hf_config = factory, options, hf_config
        self.dtype = dtype
        self.packed = packed
        self.small_gemm = small_gemm  # packing again keeps the plain copies the first packing made
        self.huge_pages = huge_pages  # ... and puts them on huge pages as it did (device.cpu_huge_pages)
        self.prefill_gemm = prefill_gemm  # ... and runs large GEMMs as before (cpu_prefill_gemm)
        self.saver = saver
        self._skeleton: nn.Module | None = None
        self.released = False

    def nbytes(self) -> int:
        """Bytes of the served model's parameters (from the meta copy: works while released)."""
        return sum(p.numel() * p.element_size() for p in self.skeleton().parameters())

    # -- checks ------------------------------------------------------------------------------

    def skeleton(self) -> nn.Module:
        """The network on the meta device: the model's own name and shape rules, no memory."""
        if self._skeleton is None:
            with torch.device("meta"), default_dtype(self.dtype):
                self._skeleton = self._factory(self._hf_config, self._options)
        return self._skeleton

    def check(self, specs: Iterable[tuple[str, tuple[int, ...]]]) -> set[str]:
        """Raise :class:`WeightUpdateError` unless every ``(name, shape)`` maps onto a parameter
        of the served model; return the model's parameter names that would be written."""
        targets: set[str] = set()
        skeleton = self.skeleton()
        for name, shape in specs:
            try:
                targets |= skeleton.load_weights([(name, torch.empty(shape, device="meta", dtype=self.dtype))])
            except (ValueError, RuntimeError) as exc:
                raise WeightUpdateError(f"weight {name!r}: {exc}", name) from None
        return targets

    def check_config(self, path: str) -> None:
        """A checkpoint directory holds a new version of this model (same architecture and shapes)."""
        try:
            new = load_hf_config(path)
        except (OSError, ValueError) as exc:
            raise WeightUpdateError(f"model_path {path!r}: no readable config.json ({exc})", "model_path") from None
        for field in IDENTITY_FIELDS:
            # A vision-language config keeps the language model's sizes in its text config.
            old_cfg, new_cfg = ((self._hf_config, new) if field == "architectures"
                                else (self._hf_config.get_text_config(), new.get_text_config()))
            old_v, new_v = getattr(old_cfg, field, None), getattr(new_cfg, field, None)
            if old_v != new_v:
                raise WeightUpdateError(
                    f"model_path {path!r} is not the served model's architecture: {field} is {new_v!r}, "
                    f"the served model has {old_v!r}", field)

    # -- updates -----------------------------------------------------------------------------

    def _require_resident(self) -> None:
        if self.released:
            raise WeightUpdateError("the weights are released; resume them (tags: weights) before updating")

    @torch.no_grad()
    def update(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Check, then write HF-named tensors into the served weights; returns how many."""
        self._require_resident()
        targets = self.check((name, tuple(t.shape)) for name, t in named)
        with self._dense(targets):
            self.model.load_weights(iter(named))
        return len(named)

    @torch.no_grad()
    def update_from_disk(self, path: str) -> int:
        """Load every tensor of a safetensors checkpoint of the same architecture, in place."""
        self._require_resident()
        if not os.path.isdir(path):
            raise WeightUpdateError(f"model_path {path!r} is not a directory", "model_path")
        self.check_config(path)
        from safetensors import safe_open

        try:
            files = safetensors_files(path)
        except FileNotFoundError as exc:
            raise WeightUpdateError(str(exc), "model_path") from None
        specs = []
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                specs += [(name, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()]
        targets = self.check(specs)
        missing = sorted(set(n for n, _ in self.skeleton().named_parameters()) - targets)
        if missing:
            raise WeightUpdateError(f"model_path {path!r} does not provide {', '.join(missing[:5])}"
                                    + (" ..." if len(missing) > 5 else ""), missing[0])
        with self._dense(targets):
            lazy = get_tensor_parallel().size > 1
            self.model.load_weights(iter_safetensors_weights(path, progress=False, lazy=lazy))
        return len(specs)

    @contextlib.contextmanager
    def _dense(self, targets: set[str]) -> Iterator[None]:
        """Unpack (CPU oneDNN layout) the layers holding ``targets`` for the write, pack after."""
        if not self.packed:
            yield
            return
        modules = {name.rpartition(".")[0] for name in targets}
        params = dict(self.model.named_parameters())
        touched = {id(params[n]) for n in targets if n in params}
        for name, module in self.model.named_modules():
            # A tied lm_head packs the embedding's weight: it must be repacked when that changes.
            if isinstance(module, PackedLinear) and module.weight is not None and id(module.weight) in touched:
                modules.add(name)
        unpack_linear_layers(self.model, modules)
        try:
            yield
        finally:
            pack_linear_layers(self.model, small_gemm=self.small_gemm, huge_pages=self.huge_pages,
                               blas=self.prefill_gemm == "aten", panel=self.prefill_gemm == "kernel")
            trim_heap()  # the dense copies just freed would otherwise stay in the heap

    # -- reads -------------------------------------------------------------------------------

    @torch.no_grad()
    def get(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of a weight (flattened), by its HF name (a shard of a
        merged parameter when the model has ``hf_weight_location``) or the model's own name."""
        self._require_resident()
        locate = getattr(self.model, "hf_weight_location", None)
        target, rows = locate(name) if callable(locate) else (name, None)
        known = dict(self.skeleton().named_parameters(remove_duplicate=False))
        if target not in known:
            raise WeightUpdateError(f"weight {name!r} is not a parameter of the served model", name)
        with self._dense({target}):
            tensor = self.model.get_parameter(target).detach()
            if rows is not None:
                tensor = tensor[rows[0]:rows[1]]
            values = tensor.flatten()[:truncate_size].float().tolist()
        return values

    # -- release and resume ------------------------------------------------------------------

    def release(self) -> None:
        """Free the weights' memory through the saver (contents kept for :meth:`resume`)."""
        if self.released:
            return
        if self.packed and not self.saver.preserves_addresses:
            unpack_linear_layers(self.model)  # oneDNN's packed weights are opaque: release dense ones
        self.saver.track("weights", weight_tensors(self.model), keep_contents=True)
        self.saver.pause("weights")
        self.released = True

    def resume(self) -> None:
        if not self.released:
            return
        self.saver.resume("weights")
        if self.packed and not self.saver.preserves_addresses:
            pack_linear_layers(self.model, small_gemm=self.small_gemm, huge_pages=self.huge_pages,
                               blas=self.prefill_gemm == "aten", panel=self.prefill_gemm == "kernel")
            # The saver must not keep the dense copies alive: the packed layers replaced them.
            self.saver.track("weights", [], keep_contents=True)
            trim_heap()
        self.released = False


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every dense tensor of the model's parameters and buffers (what a weights release frees)."""
    out = [p.data for p in model.parameters()] + [b for b in model.buffers()]
    return [t for t in out if t.layout == torch.strided]
