"""The attention conformance kit: the reference backends pass it, broken backends fail it, per case."""

from __future__ import annotations

import pytest
import torch

from framework.attention.base import Attention
from framework.attention.paged_sdpa import ExtendRequest
from framework.testing.attention_conformance import (
    SCENARIOS,
    ConformanceCase,
    assert_case_conformant,
    assert_conformant,
    conformance_cases,
    run_conformance,
)
from plugins.attention.cpu_paged.backend import CpuPagedAttnBackend
from plugins.attention.torch_native import TorchNativeAttnBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PrefixBlindBackend(TorchNativeAttnBackend):
    """Broken on purpose: in extend, new tokens do not see the cached prefix."""

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        if forward_batch.mode.is_extend():
            forward_batch.attn_metadata = [
                ExtendRequest(r.q_start, r.q_len, None, None) for r in forward_batch.attn_metadata
            ]


class OffByOneDecodeBackend(TorchNativeAttnBackend):
    """Broken on purpose: decode forgets the newest token (reads seq_len - 1 positions)."""

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.mode.is_decode():
            forward_batch.seq_lens = forward_batch.seq_lens - 1
            forward_batch.seq_lens_cpu = [max(1, s - 1) for s in forward_batch.seq_lens_cpu]
        super().init_forward_metadata(forward_batch)


class NoStoreBackend(TorchNativeAttnBackend):
    """Broken on purpose: never writes the new K/V into the cache."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache=False)


@pytest.mark.timeout(60)
def test_torch_native_passes_the_whole_grid() -> None:
    report = assert_conformant(TorchNativeAttnBackend)
    # Every scenario x page size x GQA ratio x head dim x dtype (fp32, bf16, fp16 on CPU).
    assert len(report.results) == len(SCENARIOS) * 2 * 3 * 2 * 3
    assert all(r.max_abs_err > 0 or r.case.dtype == torch.float32 for r in report.results)
    print(report)


@pytest.mark.timeout(60)
def test_cpu_paged_passes_the_whole_grid() -> None:
    """Its C decode kernel on the fp32 cases; the half-type cases exercise its torch fallback."""
    report = assert_conformant("cpu_paged")
    assert len(report.results) == len(SCENARIOS) * 2 * 3 * 2 * 3
    decode_fp32 = [r for r in report.results if r.case.scenario == "decode" and r.case.dtype == torch.float32]
    assert decode_fp32 and all(r.max_abs_err < 1e-5 for r in decode_fp32)
    # Its native_decode (the fused decode step's attention) ran beside forward on every fp32 and
    # bf16 decode case, 4 decode steps x 2 layers each, equal bit for bit; fp16 has none.
    for r in report.results:
        native = r.case.scenario == "decode" and r.case.dtype in (torch.float32, torch.bfloat16)
        assert r.native_checked == (8 if native else 0) and r.native_mismatches == 0, r
    print(report)


class SkewedNativeDecodeBackend(CpuPagedAttnBackend):
    """Broken on purpose: its native decode function runs with a slightly different scale."""

    def native_decode(self, forward_batch, layers, dtype):
        skewed = [Attention(a.num_heads, a.head_dim, a.scaling * 1.001, a.num_kv_heads, a.layer_id) for a in layers]
        return super().native_decode(forward_batch, skewed, dtype)


def test_a_native_decode_that_differs_from_forward_fails() -> None:
    """A native function off by a 0.1% scale (an error far inside the SDPA tolerance) fails: the
    kit wants the fused step's attention bitwise equal to forward's."""
    cases = conformance_cases(dtypes=[torch.float32], scenarios=["decode", "extend"], page_sizes=[16],
                              head_layouts=[(8, 2)], head_dims=[64])
    report = run_conformance(lambda runner, options: SkewedNativeDecodeBackend(runner), cases=cases)
    by_scenario = {r.case.scenario: r for r in report.results}
    assert by_scenario["extend"].passed
    decode = by_scenario["decode"]
    assert not decode.passed and decode.native_mismatches == decode.native_checked == 8
    assert decode.max_abs_err < 1e-5  # forward itself is right
    assert "native_decode_mismatches=8/8" in str(report)


@pytest.mark.timeout(60)
def test_example_plugin_backend_passes_by_registered_name(example_plugin_installed) -> None:
    report = assert_conformant("example_naive")
    assert report.backend == "example_naive"


def test_a_registered_name_gets_its_options_dataclass() -> None:
    report = run_conformance(
        "torch_native",
        {"decode_max_gather_tokens": 40},
        cases=conformance_cases(
            dtypes=[torch.float32], scenarios=["decode"], page_sizes=[16], head_layouts=[(8, 2)], head_dims=[64]
        ),
    )
    assert report.passed, report


def test_prefix_blind_backend_fails_exactly_the_prefix_cases() -> None:
    """Ignoring cached prefixes breaks the prefix scenario and the mixed one (decode rows are one
    token on top of a prefix), and nothing else."""
    cases = conformance_cases(dtypes=[torch.float32], head_dims=[64], head_layouts=[(8, 2)])
    report = run_conformance(PrefixBlindBackend, cases=cases)
    assert not report.passed
    failed = {r.case.scenario for r in report.failures}
    assert failed == {"prefix", "mixed"}, report
    assert all(r.max_abs_err > 0.05 for r in report.failures)
    assert "FAIL  prefix-page1-h8kv2-d64-float32" in str(report)
    with pytest.raises(AssertionError, match="PrefixBlindBackend fails 4/8 conformance cases"):
        assert_conformant(PrefixBlindBackend, cases=cases)


def test_off_by_one_decode_fails_the_decode_cases() -> None:
    cases = conformance_cases(dtypes=[torch.float32], head_dims=[64], head_layouts=[(2, 2)], page_sizes=[16])
    report = run_conformance(OffByOneDecodeBackend, cases=cases)
    assert {r.case.scenario for r in report.failures} == {"decode"}, report


def test_backend_that_does_not_store_kv_fails_on_the_cache_check() -> None:
    case = ConformanceCase("extend", 16, 2, 2, 64, torch.float32)
    report = run_conformance(NoStoreBackend, cases=[case])
    (result,) = report.results
    assert not result.passed and result.cache_max_abs_err > 0.1


def test_a_raising_backend_is_reported_per_case_not_crashing_the_run() -> None:
    def factory(runner, options):
        if runner.kv_cache.page_size == 16:
            raise RuntimeError("page size 16 is not supported")
        return TorchNativeAttnBackend(runner, options)

    cases = conformance_cases(dtypes=[torch.float32], scenarios=["extend"], head_layouts=[(2, 2)], head_dims=[64])
    report = run_conformance(factory, cases=cases)
    assert [(r.case.page_size, r.passed) for r in report.results] == [(1, True), (16, False)]
    assert all("page size 16 is not supported" in r.error for r in report.failures)
    assert "raised: RuntimeError: page size 16 is not supported" in str(report)


# The two-line form a plugin's own test suite uses, one pytest item per case.
@pytest.mark.parametrize("case", conformance_cases(dtypes=[torch.bfloat16], head_dims=[128]), ids=str)
def test_parametrized_form(case: ConformanceCase) -> None:
    assert_case_conformant(TorchNativeAttnBackend, case)


def test_case_ids_are_readable_and_unique() -> None:
    cases = conformance_cases()
    assert len({str(c) for c in cases}) == len(cases)
    assert str(cases[0]) == "extend-page1-h2kv2-d64-float32"
    assert {c.scenario for c in cases} == set(SCENARIOS)


def test_cpu_paged_hands_a_mixed_steps_decode_rows_to_its_decode_kernel(monkeypatch) -> None:
    """A mixed step's trailing one-token requests go to the decode kernel (the extend kernel would
    compute a block of query rows for each); the kit's mixed cases pass that way, and a tail that
    reads one key too few fails them."""
    from plugins.attention.cpu_paged import backend as cpu_paged

    calls: list[int] = []
    real = cpu_paged.paged_decode_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu_paged, "paged_decode_attention", counting)
    cases = conformance_cases(dtypes=[torch.float32, torch.bfloat16], scenarios=["mixed"], page_sizes=[1, 16],
                              head_layouts=[(8, 2)], head_dims=[64])
    report = assert_conformant("cpu_paged", cases=cases)
    # Per case and layer: the 1-row tail of the second step, the 3 rows of the third.
    assert sorted(set(calls)) == [1, 3] and len(calls) == len(report.results) * 2 * 2, calls

    class ShortTail(CpuPagedAttnBackend):
        def init_forward_metadata(self, forward_batch) -> None:
            super().init_forward_metadata(forward_batch)
            tail = getattr(forward_batch.attn_metadata, "decode_tail", None)
            if tail is not None:
                tail.lens -= 1

    broken = run_conformance(lambda runner, options: ShortTail(runner), cases=cases)
    assert len(broken.failures) == len(cases), broken
