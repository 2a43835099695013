"""The C RMSNorm kernel (fp32 and bf16) against transformers' LlamaRMSNorm, and where it must step aside."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from framework.kernels import rmsnorm

pytestmark = pytest.mark.skipif(not rmsnorm.kernel_available(), reason="no C compiler to build the kernel")

EPS32 = torch.finfo(torch.float32).eps


def _hf(width: int, eps: float, weight: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (1024, 768), (3, 5, 100), (7, 4096), (2, 15)])
@pytest.mark.parametrize("scale", [3.0, 1e-3])  # at 1e-3 the mean square is ~1e-6: eps matters
def test_matches_transformers(shape: tuple[int, ...], scale: float) -> None:
    """Within a few float roundings (the squares are summed in another order); a wrong eps, a
    missing weight or a mean over the wrong count is off by far more."""
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    width = shape[-1]
    weight = torch.rand(width, generator=g) + 0.5
    x = torch.randn(*shape, generator=g) * scale
    with torch.no_grad():
        expected = _hf(width, 1e-6, weight)(x)
        got = rmsnorm.rms_norm(x, weight, 1e-6)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=4 * EPS32, atol=0)


def test_rows_with_a_stride() -> None:
    """A view of every other row (row stride 2 x width) reads the right rows."""
    x = torch.randn(10, 2, 64)[:, 0]
    weight = torch.rand(64) + 0.5
    with torch.no_grad():
        expected = _hf(64, 1e-5, weight)(x)
    got = rmsnorm.rms_norm(x, weight, 1e-5)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=4 * EPS32, atol=0)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_into_a_given_output(dtype: torch.dtype) -> None:
    """``out`` (the leading rows of a GEMM's row bucket, in the models) gets the same values a
    fresh output would, and its rows past the norm's are untouched; a wrong ``out`` is an error
    naming what it must be, not a write out of bounds."""
    x = (torch.randn(37, 96) * 2).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    buffer = torch.full((40, 96), 7.0, dtype=dtype)
    got = rmsnorm.rms_norm(x, weight, 1e-6, out=buffer[:37])
    assert got is not None and got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got, rmsnorm.rms_norm(x, weight, 1e-6))
    assert torch.equal(buffer[37:], torch.full((3, 96), 7.0, dtype=dtype))
    for bad in (torch.empty(36, 96, dtype=dtype), torch.empty(37, 96, dtype=torch.float16),
                torch.empty(96, 37, dtype=dtype).t()):
        with pytest.raises(ValueError, match="out must be a contiguous CPU"):
            rmsnorm.rms_norm(x, weight, 1e-6, out=bad)

def test_steps_aside() -> None:
    """None (the caller runs the torch ops) for fp16, mixed dtypes, autograd, a strided last dim or a
    wrong weight."""
    weight = torch.ones(64)
    assert rmsnorm.rms_norm(torch.randn(4, 64, dtype=torch.float16), weight.half(), 1e-6) is None
    assert rmsnorm.rms_norm(torch.randn(4, 64, dtype=torch.bfloat16), weight, 1e-6) is None
    assert rmsnorm.rms_norm(torch.randn(4, 64, requires_grad=True), weight, 1e-6) is None
    assert rmsnorm.rms_norm(torch.randn(64, 4).t(), weight, 1e-6) is None
    assert rmsnorm.rms_norm(torch.randn(4, 64), torch.ones(32), 1e-6) is None
    assert rmsnorm.rms_norm(torch.randn(0, 64), weight, 1e-6).shape == (0, 64)


@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (300, 2048), (3, 5, 100)])
def test_bf16_rounds_where_transformers_does(shape: tuple[int, ...]) -> None:
    """bf16 in, bf16 out: the statistics in fp32, ``x * r`` rounded to bf16, then the weight product
    rounded again. Against transformers, at most one bf16 step off on a rare element (a mean that
    lands on the other side of a rounding boundary); rounding only once, or skipping the first
    rounding, is off on many."""
    g = torch.Generator().manual_seed(shape[0])
    width = shape[-1]
    weight = (torch.rand(width, generator=g) + 0.5).to(torch.bfloat16)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    with torch.no_grad():
        expected = _hf(width, 1e-6, weight.float()).to(torch.bfloat16)(x)
        got = rmsnorm.rms_norm(x, weight, 1e-6)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)
    assert (got != expected).float().mean() < 0.01
