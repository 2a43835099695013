"""Decode steps on CPU with every decoder layer in one C call (:mod:`framework.kernels.decode_layers`).

At a decode step of a few rows each layer's kernels take microseconds, and calling them one by one
through modules and ctypes wrappers cost ~2 ms a step at batch 1 on the 2-core Zen 4 host (of
~11 ms in bf16). A model whose decoder stack declares :class:`FusableDecoderStack` (the Llama
family) gets a :class:`FusedDecoder` from the model runner (``device.cpu_fused_decode``); at a
decode step it runs the layers in one call when everything it needs holds, and otherwise returns
None so the model runs its modules:

- every layer declares :class:`FusableDecoderLayer` and says it is fusable (Qwen3's per-head q/k
  norms are not in the C chain), with packed linears carrying the small-GEMM kernel's weight copy
  (``device.cpu_small_gemm``), a fused SwiGLU and no tensor-parallel collective;
- the rows are at most :func:`framework.kernels.small_gemm.fused_max_rows` (64 in fp32 and 48 in
  bf16 with AVX-512; 14 in bf16 where oneDNN has AMX, whose bf16 GEMM is faster from a few rows
  on; with AVX2 64 in fp32 and 8 in bf16). Up to :func:`~framework.kernels.small_gemm.max_rows`
  (32 / 24; 64 / 64 on AMX; 64 / 8 on AVX2) the module path runs the same kernel; between the
  two it runs oneDNN's GEMM, which is as fast as the kernel alone there, but the step through the
  modules measured 9-13% slower at 32-64 rows (per-layer Python and serial torch calls while the
  other thread waits, oneDNN's static split of the work);
- the attention backend hands over its decode attention as a C function
  (:meth:`framework.attention.base.AttentionBackend.native_decode`; ``cpu_paged`` does).

The chain computes what the modules compute when they run the same kernel, bit for bit (tests
compare the logits of both); above ``max_rows`` it differs from oneDNN's GEMMs by fp32 rounding.

The plan (each layer's weight addresses) is rebuilt when the modules or their weights' addresses
change: weight updates and a CPU weights release/resume repack the linears into new modules.
Walking the layers to check that every step cost ~150 us at batch 1, so the walk runs only after
a module or parameter was registered anywhere in the process (torch's global registration hooks);
weights written in place need nothing.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.kernels import decode_layers, small_gemm
from framework.models.cpu_linear import PackedLinear, PackedSwiGLU
from framework.models.layers import RMSNorm

if TYPE_CHECKING:
    from framework.executor.forward_batch import ForwardBatch


class FusableDecoderLayer:
    """Declares a decoder layer's opt-in to :class:`FusedDecoder`: it computes, with ``x`` its input,

    ``x = x + o_proj(attn(rope(split(qkv_proj(input_layernorm(x))))))`` then
    ``x = x + down_proj(act(gate_up_proj(post_attention_layernorm(x))))``,

    through those attributes (``self_attn.qkv_proj``, ``self_attn.o_proj``, ``self_attn.attn``,
    ``self_attn.q_size`` / ``kv_size`` / ``head_dim``, ``mlp.gate_up_proj``, ``mlp.down_proj``,
    :class:`~framework.models.layers.RMSNorm` norms), rope from the model's ``cos_sin`` and
    nothing else in between."""

    def fused_decode_supported(self) -> bool:
        """False when this layer does something the fused chain does not (a subclass's extra op)."""
        return True


class FusableDecoderStack:
    """Declares a decoder stack whose ``forward`` offers its decode steps to ``fused_decoder``
    (None until the model runner enables it)."""

    fused_decoder: FusedDecoder | None = None


class _Registrations:
    """Counts module and parameter registrations anywhere in the process (torch's global hooks):
    every repack of the linears (weight updates, a weights release and resume on CPU) assigns new
    modules, so while the count stands still a plan's modules are still the model's and its
    per-step check can skip the walk over every layer (~150 us a step for llama-120m)."""

    count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        from torch.nn.modules import module as torch_module

        def bump(*_: Any) -> None:
            cls.count += 1

        torch_module.register_module_module_registration_hook(bump)
        torch_module.register_module_parameter_registration_hook(bump)
        cls._installed = True


def enable_fused_decode(model: nn.Module) -> int:
    """Give every :class:`FusableDecoderStack` in ``model`` a :class:`FusedDecoder`; return how many."""
    stacks = [m for m in model.modules() if isinstance(m, FusableDecoderStack)]
    for stack in stacks:
        stack.fused_decoder = FusedDecoder()
    return len(stacks)


class _Plan:
    """One model's layer weights in the C layout, its kernels and shapes."""

    def __init__(self, weights: ctypes.Array, kernels: decode_layers.DecodeKernels, dtype: torch.dtype,
                 shape: dict[str, int]) -> None:
        self.weights, self.kernels, self.dtype, self.shape = weights, kernels, dtype, shape


def _layer_modules(layer: Any) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, layer.input_layernorm,
            layer.post_attention_layernorm)


def _weight_address(module: Any) -> int | None:
    weight = getattr(module, "small_weight", None)
    tensor = weight.data if weight is not None else getattr(module, "weight", None)
    return None if tensor is None else tensor.data_ptr()


class _Fingerprint:
    """The modules a plan's pointers come from (held weakly: a plan must not keep released weights
    alive) and their weights' addresses. A weight update repacks into new modules; a released and
    resumed weight may come back elsewhere; either makes the plan stale."""

    def __init__(self, modules: list[Any]) -> None:
        self.refs = [weakref.ref(m) for m in modules]
        self.addresses = [_weight_address(m) for m in modules]

    def matches(self, modules: list[Any]) -> bool:
        return (len(self.refs) == len(modules) and all(ref() is m for ref, m in zip(self.refs, modules, strict=True))
                and self.addresses == [_weight_address(m) for m in modules])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _layer_shape(layer: Any) -> dict[str, int]:
    attn = layer.self_attn
    return {"hidden": layer.input_layernorm.weight.shape[0], "heads": attn.attn.num_heads,
            "kv_heads": attn.attn.num_kv_heads, "head_dim": attn.head_dim,
            "intermediate": layer.mlp.gate_up_proj.out_features}


def _build_plan(layers: Sequence[Any]) -> _Plan | None:
    """The plan of ``layers``, or None when one of them cannot run fused."""
    if not layers:
        return None
    first_qkv = layers[0].self_attn.qkv_proj
    if not isinstance(first_qkv, PackedLinear) or first_qkv.small_weight is None:
        return None
    dtype = first_qkv.small_weight.dtype
    kernels = decode_layers.kernels(dtype)
    if kernels is None:
        return None
    shape = _layer_shape(layers[0])
    hidden, inter = shape["hidden"], shape["intermediate"]
    q_size, kv_size = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    weights = (decode_layers.DecodeLayerWeights * len(layers))()
    for i, layer in enumerate(layers):
        if not isinstance(layer, FusableDecoderLayer) or not layer.fused_decode_supported():
            return None
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        if not (isinstance(qkv, PackedLinear) and isinstance(o, PackedLinear) and isinstance(down, PackedLinear)
                and isinstance(gate_up, PackedSwiGLU) and gate_up.small_swiglu):
            return None
        if any(m.small_weight is None or m.small_weight.dtype != dtype or m.output_op is not None
               for m in (qkv, o, down)):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
            return None
        sizes = ((qkv.in_features, qkv.out_features), (o.in_features, o.out_features),
                 (gate_up.in_features, gate_up.out_features), (down.in_features, down.out_features),
                 (attn.q_size, attn.kv_size))
        want = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, inter), (inter, hidden), (q_size, kv_size))
        if _layer_shape(layer) != shape or sizes != want:
            return None
        weights[i] = decode_layers.DecodeLayerWeights(
            _ptr(norms[0].weight), _ptr(norms[1].weight), norms[0].eps, norms[1].eps,
            _ptr(qkv.small_weight.data), _ptr(qkv.bias), _ptr(o.small_weight.data), _ptr(o.bias),
            _ptr(gate_up.small_weight.data), _ptr(gate_up.small_bias), _ptr(down.small_weight.data), _ptr(down.bias))
    return _Plan(weights, kernels, dtype, shape)


class FusedDecoder:
    """Runs a decoder stack's layers in one C call at decode steps it can take (module notes)."""

    def __init__(self) -> None:
        _Registrations.install()
        self._plan: _Plan | None = None
        self._fingerprint: _Fingerprint | None = None
        self._checked_at = -1
        """``_Registrations.count`` when the fingerprint was last compared."""
        self.fused_steps = 0
        """Forwards run fused (tests and benchmarks read it)."""

    def plan(self, layers: Sequence[Any]) -> _Plan | None:
        """The plan for ``layers``, rebuilt when their modules or weight memory changed."""
        if self._checked_at == _Registrations.count:
            return self._plan
        self._checked_at = _Registrations.count
        if not all(isinstance(x, FusableDecoderLayer) for x in layers):
            self._plan = self._fingerprint = None
            return None
        modules = [m for layer in layers for m in _layer_modules(layer)]
        if self._fingerprint is None or not self._fingerprint.matches(modules):
            self._plan, self._fingerprint = _build_plan(layers), _Fingerprint(modules)
        return self._plan

    def run(self, layers: Sequence[Any], hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            forward_batch: ForwardBatch) -> torch.Tensor | None:
        """The hidden states after ``layers`` (before the final norm), or None: run the modules."""
        if not forward_batch.mode.is_decode() or hidden.dim() != 2 or not hidden.is_cpu:
            return None
        if torch.is_grad_enabled():
            return None
        plan = self.plan(layers)
        rows = hidden.shape[0]
        if plan is None or hidden.dtype != plan.dtype or rows == 0 or rows > small_gemm.fused_max_rows(plan.dtype):
            return None
        cos, sin = cos_sin
        rot = cos.shape[-1]
        if not (cos.dtype == sin.dtype == plan.dtype and cos.shape == sin.shape == (rows, 1, rot)
                and cos.stride() == sin.stride() and cos.stride(2) == 1):
            return None
        native = forward_batch.attn_backend.native_decode(
            forward_batch, [layer.self_attn.attn for layer in layers], plan.dtype)
        if native is None:
            return None
        shape, dtype = plan.shape, plan.dtype
        q_size, kv_size = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        x_in = hidden.contiguous()
        x, x_mid, normed = (torch.empty(rows, shape["hidden"], dtype=dtype) for _ in range(3))
        qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
        q, attn_out = torch.empty(rows, q_size, dtype=dtype), torch.empty(rows, q_size, dtype=dtype)
        k, v = torch.empty(rows, kv_size, dtype=dtype), torch.empty(rows, kv_size, dtype=dtype)
        act = torch.empty(rows, shape["intermediate"], dtype=dtype)
        step = decode_layers.DecodeStep(
            rows, shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["intermediate"], rot,
            torch.get_num_threads(), int(dtype == torch.bfloat16), x_in.data_ptr(), x.data_ptr(), x_mid.data_ptr(),
            normed.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), attn_out.data_ptr(),
            act.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), native.function, native.context)
        decode_layers.run(plan.kernels, plan.weights, step)
        self.fused_steps += 1
        return x
