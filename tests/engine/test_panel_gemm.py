"""The panel GEMM C kernel (``device.cpu_prefill_gemm=kernel``) against torch's ``F.linear`` computed
in float64 (within fp32's worst-case rounding bound), and the packed layers that send it the calls past the small-GEMM kernel's rows."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.kernels import panel_gemm, small_gemm
from framework.models.cpu_linear import PackedLinear, PackedSwiGLU, onednn_linear_available

pytestmark = pytest.mark.skipif(panel_gemm._load() is None, reason="no C compiler to build the kernel")
needs_vector = pytest.mark.skipif(not panel_gemm.kernel_available(), reason="the kernel's AVX2 build needs AVX2 and FMA")

# The micro-kernel is AVX2 + FMA intrinsics or plain C, chosen at compile time; both are built here
# (plain C with those switched off: x86 compilers only), so one host tests both.
VARIANT_FLAGS = {"native": [], "scalar": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


@pytest.fixture(params=sorted(VARIANT_FLAGS))
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """panel_linear running the kernel built for one path."""
    from framework.kernels.build import build_and_load

    if request.param == "scalar" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -mno-avx2 flags are x86 compilers' own")
    lib = build_and_load(panel_gemm.SOURCE, f"panel_gemm_{request.param}",
                         [*panel_gemm.CFLAGS, *VARIANT_FLAGS[request.param]])
    native = panel_gemm._load()
    for name in ("panel_gemm", "panel_gemm_swiglu", "panel_gemm_vector"):
        getattr(lib, name).argtypes = getattr(native, name).argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.panel_gemm_held_bytes.restype = ctypes.c_int64
    assert lib.panel_gemm_vector() == (request.param == "native" and panel_gemm.kernel_available())
    monkeypatch.setattr(panel_gemm, "_load", lambda: lib)
    return request.param


U32 = 2.0 ** -24  # float32's unit roundoff


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None, swiglu: bool = False) -> None:
    """``got`` against torch's float64 result, within the worst-case rounding error of an fp32 sum of
    k products in any order (k u sum |x_i w_i|, plus the bias and add roundings), carried through
    SiLU and the product for SwiGLU: a misplaced weight or row is off by far more."""
    x64, w64 = x.double(), w.double()
    k = x.shape[-1]
    y = F.linear(x64, w64, None if bias is None else bias.double())
    err = (k + 2) * U32 * (F.linear(x64.abs(), w64.abs()) + (0 if bias is None else bias.double().abs()))
    if swiglu:
        (gate, up), (gate_err, up_err) = y.chunk(2, dim=-1), err.chunk(2, dim=-1)
        y = F.silu(gate) * up
        # silu's slope is within [-0.1, 1.1]; then a few ulps for SiLU's exp and the product.
        err = 1.1 * gate_err * up.abs() + (F.silu(gate).abs() + gate_err * 1.1) * up_err + 8 * U32 * y.abs()
    if add is not None:
        y = y + add.double()
        err = err + 2 * U32 * y.abs()
    assert got.dtype is torch.float32 and got.shape == y.shape
    excess = (got.double() - y).abs() - err - 1e-30
    assert excess.max() <= 0, f"off by {(got.double() - y).abs().flatten()[excess.argmax()]:.3g} past the bound"


# Row counts around the 6-row tiles and the row blocks (at most 32 tiles, split evenly: 192 rows one
# block, 193 two of 17 and 16 tiles, 400 three of 23, 23 and 21), K around the 8-column padding and
# the 256-deep K blocks (600 = two whole blocks and a partial one), N of 1-3 panels and half panels.
SHAPES = [(1, 48, 8), (5, 64, 100), (7, 16, 600), (65, 96, 257), (97, 32, 768), (192, 48, 40), (193, 80, 64),
          (300, 64, 520), (400, 48, 40)]


@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(variant: str, rows: int, n: int, k: int, bias: bool) -> None:
    torch.manual_seed(rows * 7 + n + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    add = torch.randn(rows, n)
    weight = small_gemm.pack_weight(w)
    _check(panel_gemm.panel_linear(x, weight, b, vector_only=False), x, w, b)
    _check(panel_gemm.panel_linear(x, weight, b, add=add, vector_only=False), x, w, b, add)
    if n % 32 == 0:
        _check(panel_gemm.panel_linear(x, weight, b, swiglu=True, vector_only=False), x, w, b, swiglu=True)


def test_inputs_of_any_layout_and_leading_shape(variant: str) -> None:
    """A strided view (a slice of wider rows) and a 3-D input give the 2-D contiguous results."""
    torch.manual_seed(3)
    wide, w = torch.randn(130, 200), torch.randn(48, 150)
    weight = small_gemm.pack_weight(w)
    x = wide[:, 10:160]  # row stride 200, not 150
    want = panel_gemm.panel_linear(x.contiguous(), weight, vector_only=False)
    assert torch.equal(panel_gemm.panel_linear(x, weight, vector_only=False), want)
    three_d = panel_gemm.panel_linear(x.contiguous().view(2, 65, 150), weight, vector_only=False)
    assert three_d.shape == (2, 65, 48) and torch.equal(three_d.view(130, 48), want)


@needs_vector
def test_results_do_not_depend_on_threads_or_on_the_call() -> None:
    """Each output tile is summed by one thread in one k order, whichever thread takes it: results are
    bit for bit the same with one or two threads and from call to call (the input-copy buffer is
    reused between calls, grown when a call needs more)."""
    torch.manual_seed(4)
    w = small_gemm.pack_weight(torch.randn(96, 300))
    small, large = torch.randn(70, 300), torch.randn(400, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [panel_gemm.panel_linear(x, w) for x in (small, large)]
        torch.set_num_threads(2)
        two = [panel_gemm.panel_linear(x, w) for x in (large, small)][::-1]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert torch.equal(panel_gemm.panel_linear(small, w), one[0])


@needs_vector
def test_buffers_kept_between_calls_are_bounded() -> None:
    """The input copy and SwiGLU sums stay allocated between calls (a fresh mapping page-faults),
    but a call past 64 MiB of them frees them afterwards: the process keeps only what small calls
    need."""
    torch.manual_seed(6)
    w = small_gemm.pack_weight(torch.randn(64, 256))
    panel_gemm.panel_linear(torch.randn(100, 256), w, swiglu=True)
    assert 100 * 256 * 4 <= panel_gemm.held_bytes() <= 64 << 20  # (earlier calls may have grown them)
    wide = small_gemm.pack_weight(torch.randn(2048, 256))
    x = torch.randn(9000, 256)  # sums alone: 9000 x 2048 x 4 bytes = 70 MiB
    _check(panel_gemm.panel_linear(x, wide, swiglu=True), x, wide.dense(), swiglu=True)
    assert panel_gemm.held_bytes() <= 64 << 20
    assert panel_gemm.held_bytes() >= 9000 * 256 * 4  # the 9 MiB input copy stays


def test_declines_what_it_does_not_take() -> None:
    """``None`` (the caller runs its usual GEMM) for bf16, an output width off the 16-column tiles,
    SwiGLU off whole 32-column halves or with an add, and inputs autograd tracks."""
    w = torch.randn(40, 64)
    x = torch.randn(100, 64)
    assert panel_gemm.panel_linear(x, small_gemm.pack_weight(w)) is None  # 40 columns
    assert panel_gemm.panel_linear(x, small_gemm.pack_weight(torch.randn(48, 64)), swiglu=True) is None
    wide = small_gemm.pack_weight(torch.randn(64, 64))
    assert panel_gemm.panel_linear(x, wide, add=torch.randn(100, 32), swiglu=True) is None
    assert panel_gemm.panel_linear(x.bfloat16(), small_gemm.pack_weight(torch.randn(64, 64).bfloat16())) is None
    assert panel_gemm.panel_linear(x.requires_grad_(), wide) is None


@needs_vector
@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_send_it_the_rows_past_the_small_kernel(bias: bool, monkeypatch) -> None:
    """With ``panel``, PackedLinear (plain and with the residual add) and PackedSwiGLU run calls past
    ``small_gemm.max_rows`` through the kernel, bit for bit what it gives alone; calls of fewer rows
    stay on the small-GEMM kernel."""
    from framework.models import cpu_linear

    calls: list[int] = []
    real = cpu_linear.panel_linear
    monkeypatch.setattr(cpu_linear, "panel_linear", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    torch.manual_seed(12)
    lin, gate_up = nn.Linear(72, 48, bias=bias), nn.Linear(72, 128, bias=bias)
    packed, swiglu = PackedLinear(lin, small_gemm=True, panel=True), PackedSwiGLU(gate_up, small_gemm=True, panel=True)
    assert packed.panel and swiglu.panel
    limit = small_gemm.max_rows(torch.float32)
    for rows in (limit, limit + 1, 333):
        x, residual = torch.randn(rows, 72), torch.randn(rows, 48)
        calls.clear()
        with torch.no_grad():
            y, y_add, act = packed(x), packed.forward_add(x, residual), swiglu(x)
        if rows <= limit:
            assert calls == []
            continue
        assert calls == [rows] * 3
        assert torch.equal(y, panel_gemm.panel_linear(x, packed.small_weight, packed.bias))
        assert torch.equal(y_add, panel_gemm.panel_linear(x, packed.small_weight, packed.bias, add=residual))
        assert torch.equal(act, panel_gemm.panel_linear(x, swiglu.small_weight, swiglu.small_bias, swiglu=True))
        _check(y_add, x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), residual)
        _check(act, x, gate_up.weight.detach(), None if gate_up.bias is None else gate_up.bias.detach(), swiglu=True)
    # Without the small-GEMM copy there is nothing for the kernel to read: the flag is dropped.
    assert not PackedLinear(lin, panel=True).panel and not PackedSwiGLU(gate_up, panel=True).panel
