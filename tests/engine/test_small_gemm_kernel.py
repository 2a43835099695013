"""The small-GEMM C kernel (``device.cpu_small_gemm=kernel``) against torch's ``F.linear`` computed
in float64, and the packed layers that use it at a few rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.kernels import small_gemm
from framework.models.cpu_linear import (
    PackedLinear,
    PackedSwiGLU,
    float_linear,
    onednn_linear_available,
    pack_linear_layers,
    packable_dtypes,
    small_gemm_extra_bytes,
    unpack_linear_layers,
)
from framework.models.layers import SiluAndMul

pytestmark = pytest.mark.skipif(not small_gemm.kernel_available(), reason="no C compiler to build the kernel")
needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")


# The kernel's vector paths are chosen at compile time (-march=native): the AVX-512 (+ AVX512-BF16)
# blocks, the AVX2 ones, or plain C. Each is built here with the wider ones switched off, so one host
# tests every path it can run.
VARIANT_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


@pytest.fixture(params=sorted(VARIANT_FLAGS))
def kernel_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """small_linear running the kernel built for one vector path."""
    import ctypes

    from framework.kernels.build import build_and_load

    lib = build_and_load(small_gemm.SOURCE, f"small_gemm_{request.param}", [*small_gemm.CFLAGS,
                                                                           *VARIANT_FLAGS[request.param]])
    for fn in (lib.small_gemm, lib.small_gemm_bf16):
        fn.argtypes = small_gemm._load().small_gemm.argtypes
        fn.restype = ctypes.c_int
    lib.small_gemm_swiglu.argtypes = small_gemm._load().small_gemm_swiglu.argtypes
    lib.small_gemm_swiglu.restype = ctypes.c_int
    lib.small_gemm_bf16_f32out.argtypes = small_gemm._load().small_gemm_bf16_f32out.argtypes
    lib.small_gemm_bf16_f32out.restype = ctypes.c_int
    monkeypatch.setattr(small_gemm, "_gemm_fn", lambda fp32: lib.small_gemm if fp32 else lib.small_gemm_bf16)
    monkeypatch.setattr(small_gemm, "_swiglu_fn", lambda: lib.small_gemm_swiglu)
    monkeypatch.setattr(small_gemm, "_float_out_fn", lambda: lib.small_gemm_bf16_f32out)
    # Every row count computes correctly on every build; the per-build limit is a speed choice.
    monkeypatch.setattr(small_gemm, "max_rows", lambda dtype=torch.float32: small_gemm.MAX_ROWS)
    return request.param


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor | None:
    """The kernel on a plain weight (packed into its panel layout first)."""
    return small_gemm.small_linear(x, small_gemm.pack_weight(w), bias, add=add)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               add: torch.Tensor | None = None) -> torch.Tensor:
    """The exact result, to within float64 rounding: a yardstick neither fp32 GEMM is nearer to."""
    y = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    return (y if add is None else y + add.double()).float()


def _assert_fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the error bound of an fp32 dot product of length K (~K eps |x| |w|, here 4x tighter
    in practice), checked element by element; a wrong row, column or missed tail is far outside."""
    k = x.shape[-1]
    scale = (x.abs().double() @ w.abs().double().t()).float()
    bound = 2 * k * torch.finfo(torch.float32).eps * scale + 1e-30
    assert got.shape == expected.shape
    err = (got - expected).abs()
    assert torch.all(err <= bound.view_as(err)), float((err / bound.view_as(err)).max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 24, 30, 37, 61, 64, 97, 128])
@pytest.mark.parametrize("n_out,k_in", [(40, 24), (130, 768), (257, 1001), (3, 8), (64, 5)])
def test_matches_float64_reference(rows: int, n_out: int, k_in: int, kernel_variant: str) -> None:
    """Row counts within one tile and over several row blocks (on AVX2 1-2 rows in a full-panel
    tile, fp32 from 3 rows in half-panel tiles of up to 6 rows, whose tiles fetch the next panel:
    whole up to 56 rows, past that at most its first 128 KB, which 1001 inputs (129 KB panels) pass
    and 768 do not, and which from 24 rows read a block-wise copy of the input; up to 12 rows a
    tile on AVX-512, where two or more blocks read such a copy: 37 and 61 rows end on a smaller
    block), outputs around the 32-column panels and the per-thread split, input lengths with and
    without a tail past the last multiple of 8."""
    g = torch.Generator().manual_seed(rows * 1000 + n_out + k_in)
    x, w = torch.randn(rows, k_in, generator=g), torch.randn(n_out, k_in, generator=g)
    got = _linear(x, w)
    assert got is not None and got.is_contiguous()
    _assert_fp32_close(got, x, w, _reference(x, w))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bias_add_and_thread_counts(threads: int, kernel_variant: str) -> None:
    g = torch.Generator().manual_seed(threads)
    x, w = torch.randn(5, 300, generator=g), torch.randn(515, 300, generator=g)
    bias, add = torch.randn(515, generator=g), torch.randn(5, 515, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _linear(x, w, bias, add=add)
    finally:
        torch.set_num_threads(before)
    assert got is not None
    _assert_fp32_close(got, x, w, _reference(x, w, bias, add))


def test_strided_and_shaped_inputs(kernel_variant: str) -> None:
    """A leading shape comes back as it went in; a strided row (a view of every other column, a
    slice of a bigger batch) is read as its values, not its memory."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(33, 20, generator=g)
    x3 = torch.randn(2, 3, 20, generator=g)
    got = _linear(x3, w)
    assert got is not None and got.shape == (2, 3, 33)
    _assert_fp32_close(got.view(6, 33), x3.view(6, 20), w, _reference(x3.view(6, 20), w))
    wide = torch.randn(4, 40, generator=g)
    strided = wide[:, ::2]
    got = _linear(strided, w)
    _assert_fp32_close(got, strided, w, _reference(strided, w))
    last = torch.randn(3, 5, 20, generator=g)[:, -1, :]  # rows 100 floats apart
    got = _linear(last, w)
    _assert_fp32_close(got, last, w, _reference(last, w))


def _bf16_bounds(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, add: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and greatest bf16 results an fp32-accumulating kernel may return: the exact
    ``x w^T + bias`` (float64) moved by the fp32 dot-product error bound either way, rounded to
    bf16, then (rounding being monotonic) ``+ add`` rounded again, as ``add + F.linear`` in bf16."""
    exact = F.linear(x.double(), w.double(), bias.double())
    err = 2 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t())
    lo, hi = (exact - err).to(torch.bfloat16), (exact + err).to(torch.bfloat16)
    if add is not None:
        lo, hi = (lo.double() + add.double()).to(torch.bfloat16), (hi.double() + add.double()).to(torch.bfloat16)
    return lo, hi


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 17, 24, 37, 48, 64, 97, 128])
@pytest.mark.parametrize("n_out,k_in", [(40, 24), (257, 1001), (3, 8), (64, 5), (96, 40), (96, 64), (130, 768)])
@pytest.mark.parametrize("with_add", [False, True])
def test_bf16_within_fp32_accumulation_of_the_exact_result(rows: int, n_out: int, k_in: int, with_add: bool,
                                                          kernel_variant: str) -> None:
    """bf16 weights (pair dot products, or widened in the kernel): every output lies between the
    bf16 roundings of the exact result moved by fp32 accumulation error, the residual added after
    rounding the linear's output (a kernel that dropped a column, a K tail or the bias, or summed in
    bf16, falls outside). Whole panels (96 outputs) take the vector epilogue, a last partial panel
    the scalar one. Where the kernel uses AMX (native build), K a multiple of 32 and 2+ rows run on
    the tiles: one or two A tiles a pass (17 rows: a pass of two, 37: two passes, the last of one),
    rows padded past M."""
    g = torch.Generator().manual_seed(rows * 1000 + n_out + k_in + with_add)
    x, w = torch.randn(rows, k_in, generator=g).bfloat16(), torch.randn(n_out, k_in, generator=g).bfloat16()
    bias = torch.randn(n_out, generator=g).bfloat16()
    add = torch.randn(rows, n_out, generator=g).bfloat16() if with_add else None
    got = _linear(x, w, bias, add=add)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    lo, hi = _bf16_bounds(x, w, bias, add)
    assert torch.all((lo.float() <= got.float()) & (got.float() <= hi.float()))


@pytest.mark.parametrize("rows", [1, 3, 4, 13, 37, 128])
@pytest.mark.parametrize("half,k_in", [(64, 96), (224, 130), (32, 5)])
def test_swiglu_is_silu_of_gate_times_up(rows: int, half: int, k_in: int, kernel_variant: str) -> None:
    """``swiglu=True`` on a merged ``[gate; up]`` weight: fp32 within float rounding of SiLU(gate) *
    up computed in float64 from the exact GEMM; bf16 what torch's bf16 ``F.silu(gate) * up`` gives
    on the kernel's own (rounded) GEMM output, SiLU and product each rounded, bit for bit except
    where libm's and torch's exp differ in the last bit and that flips one rounding."""
    g = torch.Generator().manual_seed(rows * 100 + half + k_in)
    x, w = torch.randn(rows, k_in, generator=g), torch.randn(2 * half, k_in, generator=g) / k_in**0.5
    bias = torch.randn(2 * half, generator=g)
    got = small_gemm.small_linear(x, small_gemm.pack_weight(w), bias, swiglu=True)
    assert got is not None and got.shape == (rows, half) and got.dtype == torch.float32
    gate, up = F.linear(x.double(), w.double(), bias.double()).split(half, dim=-1)
    torch.testing.assert_close(got, (F.silu(gate) * up).float(), atol=1e-5, rtol=1e-5)

    xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    packed = small_gemm.pack_weight(wb)
    got = small_gemm.small_linear(xb, packed, bb, swiglu=True)
    merged = small_gemm.small_linear(xb, packed, bb)
    assert got is not None and merged is not None and got.dtype == torch.bfloat16
    gate, up = merged.split(half, dim=-1)
    expected = F.silu(gate) * up
    differ = got != expected
    assert differ.float().mean() <= 0.02, int(differ.sum())
    spacing = expected.float().abs() * 2**-7 + 1e-30  # one bf16 step at most
    assert torch.all((got.float() - expected.float()).abs() <= spacing)


@pytest.mark.skipif(not small_gemm.kernel_uses_amx(), reason="bf16 SwiGLU runs on AMX tiles only on a CPU with AMX")
@pytest.mark.parametrize("rows", [2, 16, 17, 33, 64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_swiglu_epilogue_is_bitwise_the_scratch_path(rows: int, with_bias: bool) -> None:
    """On AMX a bf16 SwiGLU call applies SiLU and the product straight from each pass's sums
    (``pair_amx``); the kernel built with ``-DAMX_PAIRS=0`` goes through the GEMM's bf16 output in a
    scratch buffer and the separate SwiGLU loop instead. Same bits, padding rows and bias included,
    and over every bf16 bit pattern as a gate (NaN, infinities, denormals)."""
    import ctypes

    from framework.kernels.build import build_and_load

    scratch = build_and_load(small_gemm.SOURCE, "small_gemm_scratch_swiglu", [*small_gemm.CFLAGS, "-DAMX_PAIRS=0"])
    scratch.small_gemm_swiglu.argtypes = small_gemm._load().small_gemm_swiglu.argtypes
    scratch.small_gemm_swiglu.restype = ctypes.c_int
    fused = small_gemm._swiglu_fn()

    def both(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        packed, n, k = small_gemm.pack_weight(w), w.shape[0], x.shape[1]
        outs = []
        for fn in (fused, scratch.small_gemm_swiglu):
            out = torch.full((x.shape[0], n // 2), float("nan"), dtype=torch.bfloat16)
            rc = fn(x.data_ptr(), k, packed.data.data_ptr(), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), n // 2, x.shape[0], n, k, 2, 1)
            assert rc == 0
            outs.append(out.view(torch.int16))
        return outs[0], outs[1]

    g = torch.Generator().manual_seed(rows)
    for half, k_in in ((64, 96), (2048, 768), (96, 64)):
        x = (torch.randn(rows, k_in, generator=g) * 3).bfloat16()
        w = (torch.randn(2 * half, k_in, generator=g) / k_in**0.5).bfloat16()
        bias = torch.randn(2 * half, generator=g).bfloat16() if with_bias else None
        got, expected = both(x, w, bias)
        assert torch.equal(got, expected)
    # Identity weights pass every bf16 pattern through as both gate and up.
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 64)
    eye = torch.cat([torch.eye(64), torch.eye(64)]).bfloat16()
    for start in range(0, patterns.shape[0], rows):
        got, expected = both(patterns[start:start + rows].contiguous(), eye, None)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [1, 3, 16, 37, 64, 128])
@pytest.mark.parametrize("n_out,k_in", [(130, 768), (3, 8), (1000, 64)])
def test_float_out_is_the_bf16_result_widened(rows: int, n_out: int, k_in: int, kernel_variant: str) -> None:
    """``float_out=True`` (the LM head's logits): float32, bitwise ``.float()`` of the bf16 result,
    bias and the last panel's padding columns included; refused for fp32, ``add`` and ``swiglu``."""
    g = torch.Generator().manual_seed(rows * 7 + n_out)
    x = torch.randn(rows, k_in, generator=g).bfloat16()
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).bfloat16()
    packed = small_gemm.pack_weight(w)
    for bias in (None, torch.randn(n_out, generator=g).bfloat16()):
        got = small_gemm.small_linear(x, packed, bias, float_out=True)
        assert got is not None and got.dtype == torch.float32
        assert torch.equal(got, small_gemm.small_linear(x, packed, bias).float())
        # Within bf16 rounding of the exact product: the widening is of the right values.
        torch.testing.assert_close(got, _reference(x.float(), w.float(), None if bias is None else bias.float()),
                                   rtol=2**-7, atol=1e-2)
    assert small_gemm.small_linear(x.float(), small_gemm.pack_weight(w.float()), float_out=True) is None
    assert small_gemm.small_linear(x, packed, add=torch.zeros(rows, n_out, dtype=torch.bfloat16),
                                   float_out=True) is None
    merged = small_gemm.pack_weight(torch.randn(64, k_in, generator=g).bfloat16())
    assert small_gemm.small_linear(x, merged, swiglu=True, float_out=True) is None


def test_swiglu_steps_aside_where_it_does_not_apply() -> None:
    """A half that does not start a panel, or a residual add, is not fused (the caller runs the ops)."""
    x = torch.randn(2, 16)
    assert small_gemm.small_linear(x, small_gemm.pack_weight(torch.randn(2 * 48, 16)), swiglu=True) is None
    w = small_gemm.pack_weight(torch.randn(2 * 32, 16))
    assert small_gemm.small_linear(x, w, add=torch.randn(2, 64), swiglu=True) is None
    assert small_gemm.small_linear(x, w, swiglu=True).shape == (2, 32)


def test_row_limit_per_dtype() -> None:
    """The build's row limits: on AVX2 64 in fp32 (its half-panel tiles) and 8 in bf16, 8 in plain
    C; with AVX-512 32 in fp32 and 24 in bf16 (oneDNN's bf16 GEMM out-computes the kernel sooner
    once the weight stream no longer bounds it); where the kernel itself runs on AMX tiles (an Intel
    core, on which oneDNN's fp32 GEMM also overtakes it later) 128 in fp32 and in bf16, 4 in bf16
    where only oneDNN has AMX. A fused decode step takes at most 64 rows on any build."""
    fp32, bf16 = small_gemm.max_rows(torch.float32), small_gemm.max_rows(torch.bfloat16)
    if small_gemm.kernel_uses_amx():
        avx512 = (128, 128)
    else:
        avx512 = (32, small_gemm.AMX_BF16_MAX_ROWS if small_gemm.amx_available() else 24)
    flags = _cpu_flags()
    expected = avx512 if "avx512f" in flags else (64, 8) if {"avx2", "fma"} <= flags else (8, 8)
    assert (fp32, bf16) == expected
    if "avx512f" not in flags:
        assert small_gemm.fused_max_rows(torch.float32) == min(fp32, 64)
        assert small_gemm.fused_max_rows(torch.bfloat16) == bf16


def test_kernel_uses_amx_where_the_cpu_and_os_offer_it() -> None:
    """The native build takes AMX tiles exactly where the CPU has them and the OS grants them (what
    torch's own probe asks too), and never elsewhere."""
    flags = _cpu_flags()
    if not {"amx_tile", "amx_bf16"} <= flags:
        assert not small_gemm.kernel_uses_amx()
    elif small_gemm.amx_available():
        assert small_gemm.kernel_uses_amx()


@pytest.mark.parametrize("kernel_amx", [False, True])
@pytest.mark.parametrize("amx", [False, True])
def test_amx_caps_only_the_bf16_limits(monkeypatch: pytest.MonkeyPatch, amx: bool, kernel_amx: bool) -> None:
    """Where oneDNN has AMX and this kernel does not, bf16 calls of more than a few rows (fused steps
    of more than 14) go to oneDNN; fp32 keeps the build's limits, and so does bf16 without AMX or
    with the kernel's own AMX tiles."""
    monkeypatch.setattr(small_gemm, "amx_available", lambda: amx)
    monkeypatch.setattr(small_gemm, "kernel_uses_amx", lambda: kernel_amx)
    build = {(fn, dt): small_gemm._row_limit(fn, dt) for fn in ("small_gemm_max_rows", "small_gemm_fused_max_rows")
             for dt in (torch.float32, torch.bfloat16)}
    bf16 = torch.bfloat16
    for limit, fn, cap in ((small_gemm.max_rows, "small_gemm_max_rows", small_gemm.AMX_BF16_MAX_ROWS),
                           (small_gemm.fused_max_rows, "small_gemm_fused_max_rows",
                            small_gemm.AMX_BF16_FUSED_MAX_ROWS)):
        assert limit.__wrapped__(torch.float32) == build[(fn, torch.float32)]  # bypass the per-dtype cache
        capped = amx and not kernel_amx
        assert limit.__wrapped__(bf16) == (min(build[(fn, bf16)], cap) if capped else build[(fn, bf16)])


def _cpu_flags() -> set[str]:
    from pathlib import Path

    try:
        return set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return set()


def test_steps_aside_where_it_does_not_apply() -> None:
    w = torch.randn(16, 8)
    assert _linear(torch.randn(small_gemm.max_rows() + 1, 8), w) is None
    assert _linear(torch.randn(2, 8, dtype=torch.float64), w) is None
    assert _linear(torch.randn(2, 8), w.to(torch.bfloat16)) is None  # dtypes differ
    assert _linear(torch.randn(2, 8).half(), w.half()) is None
    assert _linear(torch.randn(2, 9), w) is None
    assert _linear(torch.randn(0, 8), w) is None
    x = torch.randn(2, 8, requires_grad=True)
    assert _linear(x, w) is None  # autograd must see the op
    with torch.no_grad():
        assert _linear(x, w) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_out,k_in", [(16, 64), (13, 40), (1, 1), (9, 33), (70, 17)])
def test_panel_layout_round_trips(dtype: torch.dtype, n_out: int, k_in: int) -> None:
    """pack_weight pads to whole 32-column panels and a multiple of 8 inputs with zeros, puts each
    k's 32 weights side by side (bf16: each output's pair of k), and dense() gives the weight back
    bit for bit (unpacking for weight updates and memory release reads it); a non-contiguous weight
    packs by its values."""
    w = torch.randn(n_out, k_in).to(dtype)
    packed = small_gemm.pack_weight(w)
    panels, k_padded = -(-n_out // 32), -(-k_in // 8) * 8
    if dtype == torch.bfloat16:
        assert packed.data.shape == (panels, k_padded // 2, 32, 2)
        assert torch.equal(packed.data[0, 0, : min(n_out, 32), 0], w[:32, 0])
        if k_in > 1:
            assert torch.equal(packed.data[0, 0, : min(n_out, 32), 1], w[:32, 1])
    else:
        assert packed.data.shape == (panels, k_padded, 32, 1)
        assert torch.equal(packed.data[0, k_in - 1, : min(n_out, 32), 0], w[:32, k_in - 1])
    assert torch.equal(packed.dense(), w)
    assert int((packed.data != 0).sum()) == int((w != 0).sum())  # the padding holds zeros
    assert torch.equal(small_gemm.pack_weight(w.t().contiguous().t()).dense(), w)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 32, 40])
def test_packed_layers_use_it_up_to_its_row_limit(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``small_gemm`` the packed layers send calls of up to ``max_rows()`` rows (8 on AVX2, 32 on
    AVX-512 in fp32) to the kernel (counted) and the rest to oneDNN, and both agree with F.linear; the SwiGLU path with SiLU * up."""
    calls = []
    real = small_gemm.small_linear

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("framework.models.cpu_linear.small_linear", counting)
    torch.manual_seed(rows)
    lin, gate_up = nn.Linear(96, 80), nn.Linear(96, 2 * 64)
    x, residual = torch.randn(rows, 96), torch.randn(rows, 80)
    packed, swiglu = PackedLinear(lin, small_gemm=True), PackedSwiGLU(gate_up, small_gemm=True)
    assert swiglu.small_swiglu  # 64 gate rows: the up rows start a panel
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.forward_add(x, residual), residual + F.linear(x, lin.weight, lin.bias),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(swiglu(x), SiluAndMul()(gate_up(x)), atol=1e-5, rtol=1e-5)
    assert calls == [rows <= small_gemm.max_rows()] * 3


@needs_onednn
def test_packing_keeps_plain_copies_and_unpacks_from_them() -> None:
    """The kernel's copy costs what small_gemm_extra_bytes says, and unpacking hands the same
    weights back bit for bit (from the kernel's panel copy: the dense weights were dropped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 24))
    dense = [m.weight.detach().clone() for m in (model[0], model[2])]
    assert small_gemm_extra_bytes(model) == (24 * 40 + 40 * 24) * 4
    x = torch.randn(3, 24)
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model, small_gemm=True) == 2
        assert all(isinstance(model[i], PackedLinear) and model[i].small_weight is not None for i in (0, 2))
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
        assert unpack_linear_layers(model) == 2
    assert torch.equal(model[0].weight, dense[0]) and torch.equal(model[2].weight, dense[1])


@needs_onednn
def test_engine_setting_and_its_errors(tiny_model, engine_factory) -> None:
    """auto picks the kernel for a small fp32 model (and a bf16 one where oneDNN packs bf16: a CPU
    with native bf16); onednn keeps oneDNN alone; asking for the
    kernel where it cannot run names the key and the allowed values."""
    from framework.errors import ConfigError

    assert engine_factory(tiny_model, "model.dtype=float32").runner.small_gemm is True
    native_bf16 = torch.bfloat16 in packable_dtypes()
    assert engine_factory(tiny_model, "model.dtype=bfloat16").runner.small_gemm is native_bf16
    off = engine_factory(tiny_model, "model.dtype=float32", "device.cpu_small_gemm=onednn")
    assert off.runner.small_gemm is False and off.runner.describe()["cpu_small_gemm"] is False
    with pytest.raises(ConfigError, match=r"device.cpu_small_gemm: kernel needs device.cpu_linear.*auto, kernel"):
        engine_factory(tiny_model, "device.cpu_linear=aten", "device.cpu_small_gemm=kernel")
    with pytest.raises(ConfigError, match=r"device.cpu_small_gemm: kernel needs .*float32 model"):
        engine_factory(tiny_model, "model.dtype=float16", "device.cpu_small_gemm=kernel")
    with pytest.raises(ConfigError, match=r"device.cpu_small_gemm.*expected one of \[auto, kernel, onednn\]"):
        engine_factory(tiny_model, "device.cpu_small_gemm=fast")


@needs_onednn
def test_prefill_gemm_setting(tiny_model, engine_factory, monkeypatch) -> None:
    """``device.cpu_prefill_gemm``: auto picks the panel GEMM for fp32 where torch's best vector unit
    is AVX2 and the small-GEMM copy is kept (dense copies for BLAS when it is not), oneDNN where the
    unit is AVX-512 and for bf16; explicit values are obeyed; ``kernel`` without what it needs, or an
    unknown value, is an error naming the key and the allowed values."""
    from framework.errors import ConfigError
    from framework.kernels import panel_gemm

    kernel = panel_gemm.kernel_available()
    cases = (("AVX2", (), "kernel" if kernel else "aten"), ("AVX2", ("device.cpu_small_gemm=onednn",), "aten"),
             ("AVX512", (), "onednn"))
    for capability, extra, want in cases:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        eng = engine_factory(tiny_model, "model.dtype=float32", *extra)
        assert eng.runner.prefill_gemm == want and eng.runner.describe()["cpu_prefill_gemm"] == want
        layer = next(m for m in eng.runner.model.modules() if isinstance(m, PackedLinear))
        assert (layer.blas_weight is not None) is (want == "aten") and layer.panel is (want == "kernel")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    if torch.bfloat16 in packable_dtypes():
        assert engine_factory(tiny_model, "model.dtype=bfloat16").runner.prefill_gemm == "onednn"
    assert engine_factory(tiny_model, "device.cpu_prefill_gemm=onednn").runner.prefill_blas is False
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert engine_factory(tiny_model, "device.cpu_prefill_gemm=aten").runner.prefill_blas is True
    if kernel:
        assert engine_factory(tiny_model, "device.cpu_prefill_gemm=kernel").runner.prefill_gemm == "kernel"
    assert engine_factory(tiny_model, "device.cpu_linear=aten").runner.describe()["cpu_prefill_gemm"] == "aten"
    with pytest.raises(ConfigError, match=r"device.cpu_prefill_gemm: kernel needs .*small-GEMM weight copy.*"
                                          r"allowed values: auto, onednn, aten, kernel"):
        engine_factory(tiny_model, "device.cpu_small_gemm=onednn", "device.cpu_prefill_gemm=kernel")
    with pytest.raises(ConfigError, match=r"device.cpu_prefill_gemm.*expected one of \[auto, onednn, aten, kernel\]"):
        engine_factory(tiny_model, "device.cpu_prefill_gemm=mkl")


@needs_onednn
@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs bf16 only on a CPU with native bf16")
@pytest.mark.parametrize("rows", [1, 5, 9, 30])
def test_packed_bf16_layers_agree_with_f_linear(rows: int) -> None:
    """bf16 packed layers (kernel up to ``max_rows(bf16)`` rows, oneDNN above) against bf16
    ``F.linear``: equal to within one bf16 rounding (both accumulate in fp32, in different orders)."""
    torch.manual_seed(rows)
    lin, gate_up = nn.Linear(96, 80).bfloat16(), nn.Linear(96, 2 * 64).bfloat16()
    x, residual = torch.randn(rows, 96).bfloat16(), torch.randn(rows, 80).bfloat16()
    with torch.no_grad():
        packed, swiglu = PackedLinear(lin, small_gemm=True), PackedSwiGLU(gate_up, small_gemm=True)
        assert packed.small_weight is not None and packed.small_weight.dtype == torch.bfloat16
        tol = {"atol": 2e-2, "rtol": 1e-2}
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), **tol)
        torch.testing.assert_close(packed.forward_add(x, residual), residual + F.linear(x, lin.weight, lin.bias), **tol)
        torch.testing.assert_close(swiglu(x), SiluAndMul()(gate_up(x)), **tol)
        # The LM head's path: fp32 logits bitwise those of the bf16 layer, on every path it takes.
        logits = float_linear(packed, x)
        assert logits.dtype == torch.float32 and torch.equal(logits, packed(x).float())
        assert torch.equal(float_linear(lin, x), lin(x).float())


def test_rows_past_the_kernels_limit_are_refused_by_the_c_side() -> None:
    """The C entry point rejects more rows than any build takes (``MAX_ROWS``) with -1 rather than
    reading past its tiles; small_linear never sends that many (its per-build limit is lower)."""
    fn = small_gemm._gemm_fn(True)
    x, w = torch.randn(small_gemm.MAX_ROWS + 1, 8), small_gemm.pack_weight(torch.randn(4, 8))
    y = torch.empty(x.shape[0], 4)
    rc = fn(x.data_ptr(), 8, w.data.data_ptr(), None, None, 0, y.data_ptr(), 4, x.shape[0], 4, 8, 1)
    assert rc == -1
    assert small_gemm.max_rows(torch.float32) <= small_gemm.MAX_ROWS
