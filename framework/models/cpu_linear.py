"""Pre-packed oneDNN linear layers for fp32 (and, where the CPU has bf16 dot products, bf16)
inference on CPU.

Why: torch's fp32 ``F.linear`` goes through MKL's sgemm on the plain weight layout, which measured
90-160 GFLOP/s for prefill-sized GEMMs on this project's 2-core hosts (AVX2-only ones and a Zen 4
with AVX-512 and bf16 dot products) and ~9-12 GB/s of weight reads for the single-token GEMV.
oneDNN's inner-product primitive with the weight reordered once into its blocked layout (what
``torch.compile``'s CPU freezing pass does) measured ~200 GFLOP/s and ~1.4x faster GEMV. The code
needs neither AVX-512 nor bf16 instructions: it asks torch what oneDNN supports here. Reordering
costs a copy per weight at load time and nothing per call. (Later, on an AVX2-only Zen 3 host, MKL
ran the prefill-sized GEMMs faster than the packed weights: layers packed with ``blas`` keep their
dense weights for those calls too, see :data:`BLAS_MIN_ROWS` and ``device.cpu_prefill_gemm``; layers
packed with ``panel`` send them to plugserve's own blocked GEMM on the small-GEMM copy instead,
:mod:`framework.kernels.panel_gemm`, as fast as MKL there with no further copy.)

Row counts: oneDNN builds (and caches, in two LRU caches of 1024 entries) one primitive per input
shape, so packed GEMMs run at a bounded set of row counts (:func:`bucket_rows`): with a new count
per prefill batch the caches evicted on nearly every call and the churn fragmented glibc's heap.

Numerics: oneDNN accumulates in a different order than MKL, so results differ from ``F.linear`` by
float32 rounding (~1e-6 relative); greedy outputs stay equal to transformers' on the test models.

bf16: on a CPU with AVX512-BF16 (or AMX), torch's ``F.linear`` already runs oneDNN, but on the
plain weight layout; packed, the same GEMMs measured 1.1x (1024 rows), 1.3x (64 rows) and 2.6x
(one row) faster here, bitwise equal to ``F.linear``. Without those instructions bf16 stays on
``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from framework.kernels.huge_pages import empty_on_huge_pages, huge_pages_available
from framework.kernels.panel_gemm import panel_linear
from framework.kernels.small_gemm import PANEL_COLS, PanelWeight, amx_available, pack_weight, small_linear
from framework.models.onednn_rows import padded_rows, unpadded

logger = logging.getLogger(__name__)

# The batch-size hint only picks oneDNN's weight blocking; one reorder serves every batch size. A
# decode-sized hint measured best for the GEMV that dominates single-request decode.
_BATCH_SIZE_HINT = 64

BLAS_MIN_ROWS = 256
"""Calls of at least this many rows go to torch's ``F.linear`` (MKL's sgemm) on a dense copy of the
weight when packing was asked to keep one (``blas=True``; ``device.cpu_prefill_gemm``). Why: on the
AVX2-only Zen 3 host, llama-120m's four GEMM shapes, 6 weights each, alternating in one process,
GFLOP/s MKL / oneDNN packed: 96 rows 112-135 / 140-146 (oneDNN ahead), 256 rows 135-162 / 139-152,
512 rows 159-173 / 143-157, 1024 rows 146-178 / 139-149, 1792 rows 148-172 / 132-151; in the engine
eight 128-token prompts prefilled in 1097 ms against 1194 (medians of 8, alternating), the same
first tokens. On the AVX-512 Zen 4 host the two measured equal at 1664 rows (docs/benchmarks.md)."""


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes :func:`pack_linear_layers` packs here: fp32, plus bf16 where oneDNN has native
    bf16 kernels for this CPU (elsewhere it would emulate them, slower than ``F.linear``)."""
    try:
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16 = False
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops (``torch.ops.mkldnn``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def _without_weight(linear: nn.Linear) -> nn.Linear:
    """A copy of ``linear`` (same class, attributes and bias) whose weight is a meta placeholder,
    so keeping it costs no memory; ``linear`` itself is left as it was."""
    copy = object.__new__(type(linear))
    copy.__dict__.update(linear.__dict__)
    copy._parameters = dict(linear._parameters)
    copy._buffers, copy._modules = dict(linear._buffers), dict(linear._modules)
    copy._parameters["weight"] = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)
    return copy


def _small_gemm_weight(weight: torch.Tensor) -> PanelWeight | None:
    """The copy of the weight the small-GEMM kernel reads (its panel layout): fp32 or bf16 only
    (the kernel's types)."""
    return pack_weight(weight) if weight.dtype in (torch.float32, torch.bfloat16) else None


class PackedLinear(nn.Module):
    """Inference-only stand-in for an fp32 or bf16 ``nn.Linear`` on CPU, its weight pre-packed for oneDNN.

    The packed weight is an opaque oneDNN tensor, so it is kept as a plain attribute (not a
    parameter or buffer): it is never saved, moved or trained. ``weight`` stays available for code
    that reads it (the shape, tied embeddings) only when the caller keeps it; otherwise it is freed.
    """

    def __init__(self, linear: nn.Linear, keep_dense_weight: bool = False, small_gemm: bool = False,
                 blas: bool = False, panel: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_SIZE_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # A tied lm_head shares its Parameter with the embedding, which still needs it.
        self.weight = linear.weight if keep_dense_weight else None
        # The small-GEMM kernel's own copy for calls of a few rows (see pack_linear_layers).
        self.small_weight = _small_gemm_weight(weight) if small_gemm else None
        # The dense weight for calls of BLAS_MIN_ROWS rows and more (F.linear), when asked for.
        self.blas_weight = weight.contiguous() if blas else None
        # Calls past the small-GEMM kernel's rows to the panel GEMM, on the same copy (fp32).
        self.panel = panel and self.small_weight is not None
        # The collective that completes a tensor-parallel layer (framework.models.parallel).
        self.output_op = getattr(linear, "output_op", None)
        # The replaced module, its dense weight dropped, for unpack_linear_layers to put back (as a
        # plain attribute: not a submodule, so its parameters are not the model's any more).
        object.__setattr__(self, "source", _without_weight(linear) if not keep_dense_weight else linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gemm_warmup.reaches_onednn predicts this dispatch by row count: keep the two in step.
        y = None if self.small_weight is None else small_linear(x, self.small_weight, self.bias)
        if y is None and self.panel:
            y = panel_linear(x, self.small_weight, self.bias)
        if y is None and _blas_rows(x, self.blas_weight):
            y = F.linear(x, self.blas_weight, self.bias)
        if y is None:
            # oneDNN wants a dense row-major input; the model's inputs already are, so this is free.
            y = torch.ops.mkldnn._linear_pointwise(padded_rows(x), self.packed_weight, self.bias, "none", [], "")
            y = unpadded(y, x)
        return y if self.output_op is None else self.output_op(y)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``, bitwise; a bf16 call on the small-GEMM kernel writes the fp32 values
        itself instead of a bf16 tensor and a widening pass over it (an LM head's logits)."""
        if self.output_op is None and self.small_weight is not None and x.dtype == torch.bfloat16:
            y = small_linear(x, self.small_weight, self.bias, float_out=True)
            if y is not None:
                return y
        return self.forward(x).float()

    def forward_add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``linear(x) + other`` with the add done by oneDNN as a post-op while the output tile is
        still in cache (bitwise equal to the separate add: IEEE addition is commutative). Measured
        1-4% faster than GEMM-then-add at 1 and 64 rows, equal at 1024; it also saves an allocation.
        A tensor-parallel layer adds after its collective (each rank adding would count it N times)."""
        if self.output_op is not None:
            return other + self.forward(x)
        y = None if self.small_weight is None else small_linear(x, self.small_weight, self.bias, add=other)
        if y is None and self.panel:
            y = panel_linear(x, self.small_weight, self.bias, add=other)
        if y is not None:
            return y
        if _blas_rows(x, self.blas_weight):
            return F.linear(x, self.blas_weight, self.bias).add_(other)  # the same bits as other + y
        y = torch.ops.mkldnn._linear_pointwise.binary(
            padded_rows(x), padded_rows(other), self.packed_weight, self.bias, "add"
        )
        return unpadded(y, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSwiGLU(nn.Module):
    """``silu(x W_gate^T) * (x W_up^T)`` from a merged ``[gate; up]`` linear, as two packed GEMMs.

    Why: the merged GEMM's output halves are strided views, and torch's ``silu`` on a strided view
    measured 5x slower than on a contiguous tensor; here both halves come out contiguous and SiLU
    runs in place on the gate's.
    """

    def __init__(self, gate_up: nn.Linear, small_gemm: bool = False, blas: bool = False, panel: bool = False) -> None:
        super().__init__()
        weight = gate_up.weight.detach()
        half = weight.shape[0] // 2
        self.in_features, self.out_features = gate_up.in_features, half
        self.gate = torch.ops.mkldnn._reorder_linear_weight(weight[:half].contiguous(), _BATCH_SIZE_HINT)
        self.up = torch.ops.mkldnn._reorder_linear_weight(weight[half:].contiguous(), _BATCH_SIZE_HINT)
        bias = gate_up.bias
        self.gate_bias = None if bias is None else bias.detach()[:half].contiguous()
        self.up_bias = None if bias is None else bias.detach()[half:].contiguous()
        # The merged [gate; up] weight for the small-GEMM kernel (see PackedLinear).
        self.small_weight = _small_gemm_weight(weight) if small_gemm else None
        self.small_bias = None if bias is None or not small_gemm else bias.detach().contiguous()
        # The kernel's fused SwiGLU needs the up rows to start a panel of its weight copy.
        self.small_swiglu = self.small_weight is not None and half % PANEL_COLS == 0
        self.panel = panel and self.small_swiglu  # see PackedLinear
        # Dense halves for calls of BLAS_MIN_ROWS rows and more (see PackedLinear).
        self.blas_gate = weight[:half].contiguous() if blas else None
        self.blas_up = weight[half:].contiguous() if blas else None
        # bf16 where oneDNN multiplies on AMX tiles: SiLU and the product as post-ops of the two
        # GEMMs (see forward).
        self.post_ops = weight.dtype == torch.bfloat16 and amx_available()
        object.__setattr__(self, "source", _without_weight(gate_up))  # see PackedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gemm_warmup.reaches_onednn predicts this dispatch by row count: keep the two in step.
        if self.small_swiglu:
            # A few rows: the GEMM, SiLU and product in one C call (as torch ops they were ~20 us a
            # layer at batch 1, with the strided halves of the merged output).
            act = small_linear(x, self.small_weight, self.small_bias, swiglu=True)
            if act is None and self.panel:
                act = panel_linear(x, self.small_weight, self.small_bias, swiglu=True)
            if act is not None:
                return act
        elif self.small_weight is not None:
            merged = small_linear(x, self.small_weight, self.small_bias)
            if merged is not None:
                gate, up = merged.split(self.out_features, dim=-1)
                return F.silu(gate) * up
        if _blas_rows(x, self.blas_gate):
            gate = F.linear(x, self.blas_gate, self.gate_bias)
            F.silu(gate, inplace=True)
            return gate.mul_(F.linear(x, self.blas_up, self.up_bias))
        rows = padded_rows(x)
        if self.post_ops:
            # bf16 on AMX: oneDNN applies SiLU to the gate GEMM's fp32 accumulators and multiplies
            # the up GEMM's by that gate while each output tile is still in registers, so the
            # [rows, 2 x width] intermediate is not streamed through memory twice more. The whole
            # block took 0.81-0.87x the separate passes' time at 128-1728 rows on Sapphire Rapids
            # (llama-120m's 768 -> 2 x 2048), and one bf16 rounding less moves it closer to the fp32
            # result (max error against fp32 0.125 vs 0.168 at 1728 rows). fp32 gained nothing.
            gate = torch.ops.mkldnn._linear_pointwise(rows, self.gate, self.gate_bias, "swish", [], "")
            return unpadded(torch.ops.mkldnn._linear_pointwise.binary(rows, gate, self.up, self.up_bias, "mul"), x)
        gate = torch.ops.mkldnn._linear_pointwise(rows, self.gate, self.gate_bias, "none", [], "")
        # SiLU and the multiply in place into the gate output, as torch ops. oneDNN's "swish"
        # post-op on the gate GEMM measured 15-23% slower for the whole block at 16-1024 rows on
        # the AVX2 host (53.1 vs 44.3 ms at 1024) than this separate pass over a contiguous
        # tensor, and it is transformers' own F.silu. oneDNN's binary "mul" post-op on the up GEMM
        # measured ~5% slower at 1 and 64 rows (equal at 1024), so the multiply stays separate too.
        F.silu(gate, inplace=True)
        gate.mul_(torch.ops.mkldnn._linear_pointwise(rows, self.up, self.up_bias, "none", [], ""))
        return unpadded(gate, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (silu(gate) * up)"


def _blas_rows(x: torch.Tensor, blas_weight: torch.Tensor | None) -> bool:
    """Whether a call with input ``x`` goes to ``F.linear`` on the dense copy (see BLAS_MIN_ROWS)."""
    return blas_weight is not None and x.numel() >= BLAS_MIN_ROWS * x.shape[-1]


def float_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x).float()`` (an LM head's logits, which the sampler takes in fp32), the widening
    done by the GEMM where ``linear`` is a :class:`PackedLinear` that can (bitwise the same)."""
    if isinstance(linear, PackedLinear):
        return linear.forward_float(x)
    return linear(x).float()


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + linear(x)`` (just ``linear(x)`` when ``residual`` is None), fused into the GEMM
    when ``linear`` is a :class:`PackedLinear`; the plain path keeps transformers' operation."""
    if residual is None:
        return linear(x)
    if isinstance(linear, PackedLinear):
        return linear.forward_add(x, residual)
    return residual + linear(x)


def _fuse_swiglu(model: nn.Module, dtypes: tuple[torch.dtype, ...], small_gemm: bool, blas: bool, panel: bool) -> int:
    """Give the MLPs that declare :class:`~framework.models.layers.FusableSwiGLU` a
    :class:`PackedSwiGLU`; a module that declares it but breaks its contract is an error."""
    from framework.models.layers import FusableSwiGLU, SiluAndMul

    fused = 0
    for module in model.modules():
        if not isinstance(module, FusableSwiGLU):
            continue
        gate_up, act = getattr(module, "gate_up_proj", None), getattr(module, "act", None)
        if isinstance(gate_up, PackedSwiGLU):
            continue  # packed already (a repack after a weight update packs only what was unpacked)
        if not isinstance(gate_up, nn.Linear) or not isinstance(act, SiluAndMul):
            raise TypeError(f"{type(module).__name__} declares FusableSwiGLU but has no nn.Linear gate_up_proj "
                            "and SiluAndMul act")
        if _packable(gate_up, dtypes) and getattr(gate_up, "output_op", None) is None:
            module.gate_up_proj = PackedSwiGLU(gate_up, small_gemm=small_gemm, blas=blas, panel=panel)
            module.act = nn.Identity()
            fused += 1
    return fused


def pack_linear_layers(model: nn.Module, small_gemm: bool = False, huge_pages: bool = True,
                       blas: bool = False, panel: bool = False) -> int:
    """Replace every ``nn.Linear`` in ``model`` whose weight dtype is in :func:`packable_dtypes` by a
    :class:`PackedLinear` (and the merged SwiGLU projections of modules that declare
    :class:`~framework.models.layers.FusableSwiGLU` by a :class:`PackedSwiGLU`); return how many
    layers were replaced.

    Linear layers whose weight is shared with another module (a tied ``lm_head``) keep the shared
    dense weight; the others drop it, so packing does not double the model's memory. With
    ``small_gemm`` the fp32 and bf16 layers also keep a copy of their weight in the small-GEMM
    kernel's layout (:mod:`framework.kernels.small_gemm`), which runs calls of up to
    ``small_gemm.max_rows(dtype)`` rows (decode steps): faster there than oneDNN, at the price of a
    second copy of the linear weights. With ``huge_pages`` those copies go into one buffer on 2 MiB
    pages where Linux offers them (:func:`gather_small_weights`). With ``blas`` they also keep the
    dense weight, for calls of :data:`BLAS_MIN_ROWS` rows and more (``F.linear``): one more copy.
    With ``panel`` (and ``small_gemm``) the fp32 calls past the small-GEMM kernel's rows go to the
    panel GEMM (:mod:`framework.kernels.panel_gemm`) on that same copy.
    """
    shared = _shared_parameter_ids(model)
    dtypes = packable_dtypes()
    replaced = _fuse_swiglu(model, dtypes, small_gemm, blas, panel)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child, dtypes):
                packed = PackedLinear(child, keep_dense_weight=id(child.weight) in shared, small_gemm=small_gemm,
                                      blas=blas, panel=panel)
                setattr(parent, name, packed)
                replaced += 1
    # Every packed layer's copy, not only the new ones: after a repack of some layers (a weight
    # update) their old slices of the previous buffer would otherwise stay held by the others until
    # all are repacked. Gathered before anything runs on them: the fused decoder takes the copies'
    # addresses at its first step.
    if small_gemm and huge_pages and replaced:
        gather_small_weights([m for m in model.modules() if isinstance(m, (PackedLinear, PackedSwiGLU))])
    logger.info("packed %d linear layers for oneDNN%s%s%s", replaced, " (+ plain copies for small GEMMs)" * small_gemm,
                f" (+ dense copies for BLAS from {BLAS_MIN_ROWS} rows)" * blas,
                " (panel GEMM past the small-GEMM rows)" * (panel and small_gemm))
    return replaced


def gather_small_weights(modules: list[nn.Module]) -> int:
    """Move the small-GEMM weight copies of ``modules`` into one buffer on 2 MiB pages (see
    :mod:`framework.kernels.huge_pages`), each at a 4 KiB boundary in it, one copy at a time
    (memory grows by one weight while copies leave their own allocations, by the old buffer until
    the last copy leaves it on a repack); return the buffer's size, 0 where huge pages are not
    available (the copies stay where they are). The values are the same bytes either way.

    One buffer rather than one allocation per weight: only the 2 MiB-aligned middle of a buffer can
    be on huge pages, and the weights' own allocations left a quarter of llama-120m's copy (its
    2.3 MiB o_proj weights, the ends of the others) on small pages."""
    owners = [m for m in modules if getattr(m, "small_weight", None) is not None]
    if not owners or not huge_pages_available():
        return 0
    slots = [-(-m.small_weight.data.nbytes // 4096) * 4096 for m in owners]
    buffer = empty_on_huge_pages(sum(slots))
    offset = 0
    for module, slot in zip(owners, slots, strict=True):
        old = module.small_weight
        view = buffer[offset:offset + old.data.nbytes].view(old.data.dtype).view(old.data.shape)
        view.copy_(old.data)
        module.small_weight = PanelWeight(view, old.out_features, old.in_features)
        offset += slot
    return offset


def small_gemm_extra_bytes(model: nn.Module) -> int:
    """Bytes the small-GEMM kernel's weight copies would add to ``model`` (its fp32 and bf16 linear
    layers, padding to whole panels aside)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if _packable(m, (torch.float32, torch.bfloat16)))


def _packable(module: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    """A plain ``nn.Linear`` or a tensor-parallel one, on CPU, in a dtype oneDNN packs here."""
    from framework.models.parallel import ParallelLinear

    plain = type(module) is nn.Linear or isinstance(module, ParallelLinear)
    return plain and module.weight.dtype in dtypes and module.weight.device.type == "cpu"


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one module name (tied weights)."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def _dense_from_packed(packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight a packed oneDNN weight was made from. oneDNN's reordered layout is
    opaque, so it is read back through the GEMM itself: ``I @ W^T`` is exact (every product but one
    is a multiplication by zero, and adding zeros rounds nothing), checked bitwise in the tests."""
    eye = torch.eye(in_features, dtype=dtype)
    return torch.ops.mkldnn._linear_pointwise(eye, packed, None, "none", [], "").t().contiguous()


def _unpacked_linear(source: nn.Linear, weight: torch.Tensor | nn.Parameter) -> nn.Linear:
    """The module a packed layer replaced, with its dense weight back (its bias never left)."""
    source.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return source


def unpack_linear_layers(model: nn.Module, names: set[str] | None = None) -> int:
    """Undo :func:`pack_linear_layers` (for the modules named in ``names``, or all): put back plain
    ``nn.Linear`` layers (and the SwiGLU activation) with the same weights, so weight updates can
    write HF-named tensors and the memory saver can release dense storage. Returns how many were
    unpacked; :func:`pack_linear_layers` packs them again."""
    from framework.models.layers import SiluAndMul

    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if names is not None and full not in names:
                continue
            if isinstance(child, PackedLinear):
                weight = child.weight if child.weight is not None else child.blas_weight
                if weight is None and child.small_weight is not None:
                    weight = child.small_weight.dense()
                if weight is None:
                    weight = _dense_from_packed(child.packed_weight, child.in_features, child.packed_weight.dtype)
                setattr(parent, name, _unpacked_linear(child.source, weight))
                count += 1
            elif isinstance(child, PackedSwiGLU):
                merged = None if child.blas_gate is None else torch.cat([child.blas_gate, child.blas_up])
                if merged is None and child.small_weight is not None:
                    merged = child.small_weight.dense()
                if merged is None:
                    dtype = child.gate.dtype
                    gate = _dense_from_packed(child.gate, child.in_features, dtype)
                    up = _dense_from_packed(child.up, child.in_features, dtype)
                    merged = torch.cat([gate, up])
                setattr(parent, name, _unpacked_linear(child.source, merged))
                parent.act = SiluAndMul()
                count += 1
    return count
