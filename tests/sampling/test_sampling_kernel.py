"""The sampling step's token draws (framework/kernels/sampling.c and its torch fallback) against
references computed here independently: torch.argmax, and the inverse CDF in exact rational
arithmetic (fractions.Fraction) for the draws."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from framework.kernels import sampling
from framework.kernels.sampling import argmax_rows, inverse_cdf_torch, sample_from_probs

pytestmark = pytest.mark.skipif(not sampling.kernel_available(), reason="no C compiler: the torch ops run instead")

ALMOST_ONE = 1.0 - 2.0**-53  # the largest float64 below 1 (torch.rand's largest draw)


def exact_draw(row: list[float], u: float) -> int:
    """First index whose exact cumulative sum exceeds u * exact total."""
    total = sum(Fraction(p) for p in row)
    target = Fraction(u) * total
    acc = Fraction(0)
    for i, p in enumerate(row):
        acc += Fraction(p)
        if acc > target:
            return i
    raise AssertionError("u < 1 always lands inside the row")


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 64, 65, 200, 1000])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_argmax_matches_torch_including_ties(vocab: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab * 100 + rows)
    x = torch.randint(-5, 5, (rows, vocab), generator=gen).float()  # many ties for the maximum
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_of_special_rows_matches_torch() -> None:
    x = torch.randn(6, 100)
    x[0] = float("-inf")
    x[1, 40] = float("nan")
    x[1, 70] = float("nan")
    x[2, 99] = float("inf")
    x[3, 5] = float("inf")
    x[3, 6] = float("inf")
    x[4, 33] = float("nan")
    x[4, 10] = float("inf")
    x[5] = 0.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_of_strided_rows() -> None:
    wide = torch.randn(9, 130)
    view = wide[:, 3:120]
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_kernels_decline_what_they_do_not_handle() -> None:
    assert argmax_rows(torch.randn(3, 10, dtype=torch.float64)) is None
    assert argmax_rows(torch.randn(10, 3).t()) is None  # rows not contiguous
    assert sample_from_probs(torch.rand(3, 10, dtype=torch.bfloat16), torch.rand(3, dtype=torch.float64)) is None
    with pytest.raises(ValueError, match="one uniform per row"):
        sample_from_probs(torch.rand(3, 10), torch.rand(2, dtype=torch.float64))


@pytest.mark.parametrize("draw", ["kernel", "torch"])
@pytest.mark.parametrize("vocab", [1, 7, 63, 64, 65, 300])
def test_draws_equal_the_exact_inverse_cdf(draw: str, vocab: int) -> None:
    rng = random.Random(vocab)
    rows = []
    for _ in range(40):
        # Unnormalised rows with zeros (filtered tokens), tiny and large entries.
        row = [0.0 if rng.random() < 0.3 else rng.random() * 10 ** rng.randint(-9, 0) for _ in range(vocab)]
        if not any(row):
            row[rng.randrange(vocab)] = 0.5
        rows.append(row)
    probs = torch.tensor(rows, dtype=torch.float32)
    exact_rows = probs.tolist()  # the float32 values the kernel sees
    for uniforms in ([rng.random() for _ in rows], [0.0] * len(rows), [ALMOST_ONE] * len(rows)):
        u = torch.tensor(uniforms, dtype=torch.float64)
        got = sample_from_probs(probs, u) if draw == "kernel" else inverse_cdf_torch(probs, u)
        want = [exact_draw(row, x) for row, x in zip(exact_rows, uniforms, strict=True)]
        assert got.tolist() == want


@pytest.mark.parametrize("draw", ["kernel", "torch"])
def test_an_entry_of_probability_zero_is_never_drawn(draw: str) -> None:
    """Rows whose last entries are zero, with u at 0 and just under 1 (where u * total can round up
    to the total): the draw stays on an entry above 0."""
    probs = torch.zeros(4, 200)
    probs[0, 10] = 1.0
    probs[1, [0, 199]] = torch.tensor([0.3, 0.7])
    probs[2, 50:60] = 1e-30
    probs[3, 120:130] = torch.rand(10) * 1e3
    allowed = [set(torch.nonzero(row).flatten().tolist()) for row in probs]
    for value in (0.0, 0.5, ALMOST_ONE, math.nextafter(ALMOST_ONE, 0.0)):
        u = torch.full((4,), value, dtype=torch.float64)
        got = sample_from_probs(probs, u) if draw == "kernel" else inverse_cdf_torch(probs, u)
        assert all(i in ok for i, ok in zip(got.tolist(), allowed, strict=True))


def test_kernel_draws_follow_the_distribution() -> None:
    """Pearson chi-square over 50k rows sharing one distribution (deterministic uniforms); bound:
    the 99.99th percentile of chi-square with 7 degrees of freedom (~29.9)."""
    p = torch.tensor([0.3, 0.0, 0.2, 0.15, 0.1, 0.1, 0.0, 0.05, 0.05, 0.05])
    n = 50_000
    gen = torch.Generator().manual_seed(3)
    ids = sample_from_probs(p.expand(n, -1).contiguous() * 7.0, torch.rand(n, dtype=torch.float64, generator=gen))
    counts = torch.bincount(ids, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    expected = p.double() * n
    keep = expected > 0
    assert float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) < 29.9
