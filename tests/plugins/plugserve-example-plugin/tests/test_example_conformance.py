"""The example plugin's own conformance tests: what a third-party package runs for what it ships
(a request pool and an attention backend), with plugserve's kits from ``framework.testing``.

Collected by plugserve's test run too (``testpaths = ["tests"]`` reaches this directory)."""

from __future__ import annotations

import pytest
import torch

from framework.testing import attention_conformance, pool_conformance

pytestmark = pytest.mark.usefixtures("example_plugin_installed")


@pytest.mark.parametrize("options", [None, {"zero_on_free": True}], ids=["default", "zero_on_free"])
def test_lifo_pool_conforms_by_registered_name(options) -> None:
    report = pool_conformance.assert_conformant("example_lifo", options)
    assert report.result("declaration").passed  # not pre-allocating, and registered as such
    assert report.result("preallocation").skipped


def test_lifo_pool_conforms_by_factory() -> None:
    from plugserve_example.pool import LifoPoolOptions, LifoRequestPool

    pool_conformance.assert_conformant(LifoRequestPool.create, LifoPoolOptions(zero_on_free=True))


# The naive backend is slow, so a covering subset here (every scenario and page size, a GQA layout,
# float32 and bfloat16); plugserve's tests/attention runs it over the whole grid.
CASES = attention_conformance.conformance_cases(head_layouts=[(8, 2)], head_dims=[64],
                                                dtypes=[torch.float32, torch.bfloat16])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_naive_attention_conforms(case) -> None:
    attention_conformance.assert_case_conformant("example_naive", case)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.bfloat16 and c.page_size == 16], ids=str)
def test_naive_attention_conforms_with_softmax_in_the_cache_dtype(case) -> None:
    """``softmax_in_fp32=False`` computes scores and softmax in bf16: still within the kit's bf16
    tolerance."""
    attention_conformance.assert_case_conformant("example_naive", case, options={"softmax_in_fp32": False})
