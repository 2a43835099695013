"""oneDNN-packed linear layers (``device.cpu_linear=onednn``) against torch's own ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.models.cpu_linear import (
    BLAS_MIN_ROWS,
    PackedLinear,
    PackedSwiGLU,
    linear_add,
    onednn_linear_available,
    pack_linear_layers,
    packable_dtypes,
    unpack_linear_layers,
)
from framework.models.layers import FusableSwiGLU, RMSNorm, SiluAndMul
from framework.models.onednn_rows import bucket_rows, padded_empty, padded_rows

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")


class _MLP(nn.Module, FusableSwiGLU):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(24, 2 * 40, bias=bias)
        self.down_proj = nn.Linear(40, 24, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class _Model(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.mlp = _MLP(bias)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as tie_word_embeddings does

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(ids)))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_model_matches_torch(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    model = _Model(bias)
    ids = torch.randint(0, 50, (rows,))
    with torch.no_grad():
        expected = model(ids)
        assert pack_linear_layers(model) == 3  # gate_up (fused with its activation), down, head
        assert isinstance(model.mlp.gate_up_proj, PackedSwiGLU) and isinstance(model.mlp.act, nn.Identity)
        assert isinstance(model.mlp.down_proj, PackedLinear) and model.mlp.down_proj.weight is None
        # the tied head keeps the embedding's dense weight, which the embedding still reads
        assert model.head.weight is model.embed.weight
        got = model(ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


class _UndeclaredMLP(nn.Module):
    """Same attribute names as _MLP, but no FusableSwiGLU declaration: never fused."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(24, 2 * 40)
        self.act = SiluAndMul()


class _BrokenDeclaration(nn.Module, FusableSwiGLU):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(24, 80)
        self.act = nn.GELU()


def test_swiglu_fusion_is_opt_in_and_checked() -> None:
    undeclared = _UndeclaredMLP()
    assert pack_linear_layers(undeclared) == 1
    assert isinstance(undeclared.gate_up_proj, PackedLinear) and isinstance(undeclared.act, SiluAndMul)
    with pytest.raises(TypeError, match="_BrokenDeclaration declares FusableSwiGLU"):
        pack_linear_layers(_BrokenDeclaration())


def test_packed_linear_takes_any_leading_shape() -> None:
    lin = nn.Linear(16, 8)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.allclose(PackedLinear(lin)(x), F.linear(x, lin.weight, lin.bias), atol=1e-6)


def test_half_precision_layers_pack_only_where_onednn_has_bf16_kernels() -> None:
    """fp16 stays on F.linear; bf16 is packed only where oneDNN has native bf16 dot products (it would
    emulate them otherwise), and then computes what F.linear does, to bf16 rounding (the SwiGLU's
    SiLU is applied before the gate's rounding to bf16, not after)."""
    assert pack_linear_layers(_Model(False).to(torch.float16)) == 0
    torch.manual_seed(5)
    model = _Model(True).to(torch.bfloat16)
    ids = torch.randint(0, 50, (64,))
    with torch.no_grad():
        expected = model(ids)
        packed = pack_linear_layers(model)
        got = model(ids)
    if torch.bfloat16 not in packable_dtypes():
        assert packed == 0
        return
    assert packed == 3 and isinstance(model.mlp.down_proj, PackedLinear)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(lin)(x).float(), lin(x).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 64, 700])
def test_linear_add_fuses_the_residual_exactly(bias: bool, rows: int) -> None:
    """The oneDNN add post-op gives the bits of the packed GEMM followed by a separate add (fp32
    addition commutes), and the unpacked path keeps ``residual + linear(x)``."""
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias)
    x, residual = torch.randn(rows, 96), torch.randn(rows, 80)
    packed = PackedLinear(lin)
    with torch.no_grad():
        fused = linear_add(packed, x, residual)
        assert torch.equal(fused, residual + packed(x))
        assert torch.equal(linear_add(lin, x, residual), residual + lin(x))
        assert torch.equal(linear_add(packed, x, None), packed(x))
        assert torch.allclose(fused, residual + F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_swiglu_matches_separate_ops() -> None:
    torch.manual_seed(3)
    gate_up = nn.Linear(48, 2 * 32)
    x = torch.randn(33, 48)
    fused = PackedSwiGLU(gate_up)
    with torch.no_grad():
        gate = F.silu(torch.ops.mkldnn._linear_pointwise(x, fused.gate, fused.gate_bias, "none", [], ""))
        up = torch.ops.mkldnn._linear_pointwise(x, fused.up, fused.up_bias, "none", [], "")
        assert torch.equal(fused(x), gate * up)
        assert torch.allclose(fused(x), SiluAndMul()(gate_up(x)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [3, 70, 300])
def test_bf16_swiglu_post_ops_on_amx(rows: int, bias: bool) -> None:
    """bf16 where oneDNN has AMX: SiLU and the product run as the GEMMs' post-ops. Against the fp32
    computation of the same bf16 weights the result is within bf16 rounding, and no further from
    it than transformers' sequence of bf16 ops (which rounds the gate GEMM before its SiLU).
    Elsewhere (fp32, or no AMX) the separate passes stay."""
    from framework.kernels.small_gemm import amx_available

    torch.manual_seed(rows)
    gate_up = nn.Linear(96, 2 * 64, bias=bias)
    assert not PackedSwiGLU(gate_up).post_ops  # fp32
    gate_up = gate_up.bfloat16()
    swiglu = PackedSwiGLU(gate_up)
    assert swiglu.post_ops == amx_available()
    if not swiglu.post_ops:
        pytest.skip("oneDNN has no AMX tiles on this CPU: the post-op path is not taken here")
    x = torch.randn(rows, 96).bfloat16()
    with torch.no_grad():
        exact = F.linear(x.float(), gate_up.weight.float(), None if gate_up.bias is None else gate_up.bias.float())
        exact = SiluAndMul()(exact)
        ours = swiglu(x).float()
        ops = SiluAndMul()(gate_up(x)).float()  # transformers' order, rounding after each op
    torch.testing.assert_close(ours, exact, atol=2e-2, rtol=1e-2)
    assert (ours - exact).abs().mean() <= (ops - exact).abs().mean()


@pytest.mark.parametrize("bias", [False, True])
def test_blas_copies_take_the_large_calls(bias: bool) -> None:
    """With ``blas``, calls of BLAS_MIN_ROWS rows and more are torch's ``F.linear`` on the dense
    weight, bit for bit (the residual add and SwiGLU too); fewer rows stay on oneDNN, bit for bit;
    unpacking gives back the exact dense weights."""
    torch.manual_seed(11)
    lin, gate_up = nn.Linear(48, 40, bias=bias), nn.Linear(48, 2 * 32, bias=bias)
    dense, merged = lin.weight.detach().clone(), gate_up.weight.detach().clone()
    packed, swiglu = PackedLinear(lin, blas=True), PackedSwiGLU(gate_up, blas=True)
    for rows in (BLAS_MIN_ROWS - 1, BLAS_MIN_ROWS, 300):
        x, residual = torch.randn(rows, 48), torch.randn(rows, 40)
        with torch.no_grad():
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed.packed_weight, packed.bias, "none", [], "")
            want = F.linear(x, dense, lin.bias) if rows >= BLAS_MIN_ROWS else onednn
            assert torch.equal(packed(x), want)
            assert torch.equal(packed(x.view(1, rows, 48)), want.view(1, rows, 40))
            assert torch.equal(packed.forward_add(x, residual), residual + want)
            if rows >= BLAS_MIN_ROWS:
                gate = F.silu(F.linear(x, merged[:32], None if gate_up.bias is None else gate_up.bias[:32]))
                up = F.linear(x, merged[32:], None if gate_up.bias is None else gate_up.bias[32:])
                assert torch.equal(swiglu(x), gate * up)
    model = _MLP(bias)
    weights = [model.gate_up_proj.weight.detach().clone(), model.down_proj.weight.detach().clone()]
    assert pack_linear_layers(model, blas=True) == 2
    assert model.gate_up_proj.blas_gate is not None and model.down_proj.blas_weight is not None
    assert unpack_linear_layers(model) == 2
    assert torch.equal(model.gate_up_proj.weight, weights[0]) and torch.equal(model.down_proj.weight, weights[1])


def test_row_counts_are_bucketed_to_a_bounded_set() -> None:
    """oneDNN caches one primitive per row count: a new count per prefill batch made its caches
    churn and fragmented the heap (scripts/soak/scheduler_memory.py), so counts are bucketed."""
    assert len({bucket_rows(n) for n in range(0, 1025)}) <= 80
    assert len({bucket_rows(n) for n in range(0, 1793)}) <= 85  # up to a mixed step's default budget on CPU
    for n in range(0, 5000):
        b = bucket_rows(n)
        assert n <= b <= max(n, 32) * (1.0625 if n > 1024 else 1.125) and b == bucket_rows(b)
        assert n > 32 or b == n


@pytest.mark.parametrize("rows", [33, 37, 100, 1000])
def test_padded_rows_change_no_result(rows: int) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(40, 24)
    packed, swiglu = PackedLinear(lin), PackedSwiGLU(nn.Linear(40, 2 * 24))
    x, residual = torch.randn(rows, 40), torch.randn(rows, 24)
    with torch.no_grad():
        exact = torch.ops.mkldnn._linear_pointwise(x, packed.packed_weight, packed.bias, "none", [], "")
        y = packed(x)
        assert y.shape == (rows, 24) and y.is_contiguous() and torch.equal(y, exact)
        assert torch.equal(packed(x.view(1, rows, 40)), exact.view(1, rows, 24))
        assert torch.equal(packed.forward_add(x, residual), residual + exact)
        gate = F.silu(torch.ops.mkldnn._linear_pointwise(x, swiglu.gate, swiglu.gate_bias, "none", [], ""))
        up = torch.ops.mkldnn._linear_pointwise(x, swiglu.up, swiglu.up_bias, "none", [], "")
        # SiLU is elementwise but not bitwise position-independent: torch runs whole vectors through
        # its vectorised exp and the tail past the last one through the scalar path, and padding
        # moves that tail (33 x 24 floats leave 8 past 16-lane AVX-512 vectors; 36 x 24 leave none).
        # So SwiGLU is compared to within fp32 rounding, the GEMMs above bitwise.
        torch.testing.assert_close(swiglu(x), gate * up, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("rows", [33, 100, 1713])
def test_bucketed_activations_reach_the_next_gemm_without_a_copy(rows: int) -> None:
    """A GEMM's output, a norm's and attention's come out as the leading rows of a row bucket
    (``unpadded``, ``padded_empty``), and ``padded_rows`` hands the next GEMM that buffer itself.
    The chain o_proj (+ residual) -> norm -> gate/up -> down (+ residual) must give what the same
    modules give on plain tensors, bitwise: the reused extra rows hold GEMM outputs, not zeros, and
    must reach no kept row."""
    torch.manual_seed(rows)
    width, inter = 64, 96
    o_proj, down = PackedLinear(nn.Linear(width, width)), PackedLinear(nn.Linear(inter, width))
    mlp, norm = PackedSwiGLU(nn.Linear(width, 2 * inter)), RMSNorm(width)
    norm.weight.data.uniform_(0.5, 1.5)
    attn_out, residual = torch.randn(rows, width), torch.randn(rows, width)

    def chain(attn: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h = o_proj.forward_add(attn, res)
        return down.forward_add(mlp(norm(h)), h)

    with torch.inference_mode():
        bucket = bucket_rows(rows)
        buffered = padded_empty(rows, width, torch.float32)
        buffered.copy_(attn_out)
        assert padded_rows(buffered).data_ptr() == buffered.data_ptr()
        assert padded_rows(buffered).shape == (bucket, width) and not padded_rows(buffered)[rows:].any()
        h = o_proj.forward_add(buffered, residual)
        assert padded_rows(h).data_ptr() == h.data_ptr()  # the GEMM output is taken back as it is
        normed = norm(h)
        assert normed.shape == (rows, width) and padded_rows(normed).data_ptr() == normed.data_ptr()
        act = mlp(normed)
        assert padded_rows(act).data_ptr() == act.data_ptr()
        # A tensor that is no bucket's leading rows is still copied, into zeros.
        plain = attn_out.clone()
        assert padded_rows(plain).data_ptr() != plain.data_ptr() and not padded_rows(plain)[rows:].any()
        got = chain(buffered, residual)
        # The reference: every activation a fresh tensor of exactly `rows` rows (each GEMM pads a copy).
        h_ref = o_proj.forward_add(attn_out.clone(), residual).clone()
        ref = down.forward_add(mlp(norm(h_ref).clone()).clone(), h_ref.clone())
    assert torch.equal(got, ref)


_CHURN = r"""
import ctypes, json, random, sys
import torch
from torch import nn
from framework.models.cpu_linear import PackedLinear

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

torch.set_num_threads(1)
layers = [PackedLinear(nn.Linear(256, 704, bias=False)), PackedLinear(nn.Linear(704, 256, bias=False))]
rng = random.Random(0)
samples = {}
with torch.inference_mode():
    for i in range(int(sys.argv[1]) + 1):
        if i in (100, int(sys.argv[1])):
            samples[i] = {"rss": rss_mb(), "heap_free": libc.mallinfo2().fordblks / 2**20}
        layers[1](layers[0](torch.randn(rng.randint(1, 1024), 256)))
print(json.dumps(samples))
"""


@pytest.mark.timeout(300)
def test_varying_row_counts_do_not_fragment_the_heap() -> None:
    """Issue "scheduler memory over a long run": oneDNN caches one primitive per input shape (two
    LRU caches of 1024); a new row count per prefill batch made them evict on nearly every call and
    the churn fragmented glibc's heap (in this fresh process, from call 100 to 400: RSS +276 MB and
    73 MB free in the heap before row counts were bucketed; +26 MB and 11 MB after)."""
    import ctypes
    import json
    import subprocess
    import sys

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 to tell fragmentation from live memory")
    out = subprocess.run([sys.executable, "-c", _CHURN, "400"], capture_output=True, text=True, timeout=240,
                         check=True).stdout
    samples = json.loads(out.strip().splitlines()[-1])
    first, last = samples["100"], samples["400"]
    assert last["heap_free"] < 40, samples  # memory glibc holds but nothing uses
    assert last["rss"] - first["rss"] < 100, samples
