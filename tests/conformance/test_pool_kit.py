"""The request-pool conformance kit on every built-in pool, and on broken pools it must fail."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from framework.hookspecs import Capabilities, hookimpl
from framework.memory.request_pool import PreallocatingRequestPool, RequestPool
from framework.plugins import get_registry
from framework.testing import pool_conformance
from framework.testing.pool_conformance import CHECKS, assert_conformant, is_preallocating, run_conformance

BUILTIN_POOLS = ("standard", "decode_prealloc")


def test_every_builtin_pool_is_covered() -> None:
    builtins = {c.name for c in get_registry().all() if c.kind == "memory_pool" and c.module.startswith("plugins.")}
    assert builtins == set(BUILTIN_POOLS)


@pytest.mark.parametrize("options", [None, {"extra_rows": 3}], ids=["default", "extra_rows"])
def test_standard_pool_conforms(options) -> None:
    report = assert_conformant("standard", options)
    assert report.result("preallocation").skipped and report.result("declaration").passed
    assert report.result("random_ops").passed


@pytest.mark.parametrize("options", [None, {"pre_alloc_size": 0}, {"pre_alloc_ratio": 2.5}],
                         ids=["default", "no_extra_rows", "ratio"])
def test_decode_prealloc_pool_conforms(options) -> None:
    """Every check, out-of-range ``activate`` calls included (``activate(-1)`` once wrapped around
    to the last row: the kit found it)."""
    assert_conformant("decode_prealloc", options)


def test_the_preallocation_check_runs_only_on_preallocating_pools() -> None:
    standard = get_registry().get("memory_pool", "standard")
    prealloc = get_registry().get("memory_pool", "decode_prealloc")
    assert not is_preallocating(standard.factory(2, 4, "cpu", standard.make_options()))
    assert is_preallocating(prealloc.factory(2, 4, "cpu", prealloc.make_options()))


# --- broken pools: the kit must fail them, naming the problem --------------------------------------


class _ListPool(RequestPool):
    """A simple correct pool to break in subclasses."""

    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        self.size = self.num_rows = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._free = list(range(size))
        self._used: set[int] = set()

    @classmethod
    def create(cls, size, max_context_len, device, options=None):
        return cls(size, max_context_len, device)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        rows, self._free = self._free[:n], self._free[n:]
        self._used.update(rows)
        return rows

    def free(self, slots: int | Iterable[int]) -> None:
        rows = [slots] if isinstance(slots, int) else list(slots)
        if len(set(rows)) != len(rows) or any(r not in self._used for r in rows):
            raise ValueError(f"bad free {rows}")
        self._used.difference_update(rows)
        self._free.extend(rows)

    def available_size(self) -> int:
        return len(self._free)


class _DoubleHandingPool(_ListPool):
    """Off by one: a multi-row alloc leaves its last row on the free list, so it is handed out again."""

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        rows = self._free[:n]
        self._free = self._free[n - 1 if n > 1 else n :]
        self._used.update(rows)
        return rows

    def available_size(self) -> int:
        return self.num_rows - len(self._used)  # the books look right


class _LenientFreePool(_ListPool):
    """Ignores frees of rows that are not in use instead of raising."""

    def free(self, slots: int | Iterable[int]) -> None:
        rows = [slots] if isinstance(slots, int) else list(slots)
        for r in rows:
            if r in self._used:
                self._used.discard(r)
                self._free.append(r)


class _Int64TablePool(_ListPool):
    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        super().__init__(size, max_context_len, device)
        self.req_to_token = self.req_to_token.long()


class _UncappedPreallocPool(_ListPool, PreallocatingRequestPool):
    """Pre-allocating (two rows per running slot) but ``activate`` ignores the running cap."""

    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        super().__init__(2 * size, max_context_len, device)
        self.size = size
        self._running: set[int] = set()

    def free(self, slots: int | Iterable[int]) -> None:
        super().free(slots)
        self._running.difference_update([slots] if isinstance(slots, int) else slots)

    def activate(self, row: int) -> bool:
        if not 0 <= row < self.num_rows or row not in self._used:
            raise ValueError(f"row {row} is not reserved")
        self._running.add(row)
        return True

    def deactivate(self, row: int) -> None:
        self._running.discard(row)

    def running_count(self) -> int:
        return len(self._running)


def test_a_pool_that_hands_a_row_out_twice_fails() -> None:
    report = run_conformance(_DoubleHandingPool.create)
    assert not report.passed
    assert "already in use (handed out twice)" in report.result("random_ops").detail
    assert not report.result("exhaust").passed
    with pytest.raises(AssertionError, match=r"memory pool _DoubleHandingPool.create fails"):
        report.raise_for_failures()


def test_a_pool_that_ignores_bad_frees_fails_the_bad_free_checks() -> None:
    report = run_conformance(_LenientFreePool.create)
    assert {r.name for r in report.failures} == {"bad_free", "random_ops"}
    assert "did not raise ValueError" in report.result("bad_free").detail


def test_a_pool_with_an_int64_table_fails_the_table_check() -> None:
    report = run_conformance(_Int64TablePool.create, checks=["table"])
    assert [r.name for r in report.failures] == ["table"]
    assert "expected torch.int32" in report.failures[0].detail


def test_a_preallocating_pool_without_a_running_cap_fails() -> None:
    report = run_conformance(_UncappedPreallocPool.create)
    assert {r.name for r in report.failures} == {"preallocation", "random_ops"}
    assert "rows running" in report.result("preallocation").detail


def test_a_pool_declared_preallocating_that_is_not_fails_the_declaration(register_plugin) -> None:
    class Plugin:
        @hookimpl
        def register_memory_pools(self, register) -> None:
            register("kit_misdeclared", _ListPool.create, capabilities=Capabilities(preallocation=True))

    register_plugin(Plugin(), "kit-misdeclared-pool")
    report = run_conformance("kit_misdeclared")
    assert [r.name for r in report.failures] == ["declaration"]
    assert "not a PreallocatingRequestPool" in report.failures[0].detail
    assert report.result("preallocation").skipped


def test_a_raising_pool_is_reported_with_its_traceback() -> None:
    def factory(size, max_context_len, device, options):
        raise RuntimeError("boom")

    report = run_conformance(factory, checks=["table", "random_ops"])
    assert len(report.failures) == 2
    assert report.result("table").error and "RuntimeError: boom" in report.result("table").error
    text = str(report)
    assert text.startswith("memory pool conformance of ") and "FAIL" in text


def test_the_preallocation_helper_is_the_single_place_that_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit asks :func:`is_preallocating` and nothing else (so declaring it differently later
    is a one-line change there)."""
    monkeypatch.setattr(pool_conformance, "is_preallocating", lambda pool: False)
    report = run_conformance("decode_prealloc", checks=["preallocation", "random_ops"])
    assert report.result("preallocation").skipped and report.passed


@pytest.mark.gpu
@pytest.mark.parametrize("name", BUILTIN_POOLS)
def test_builtin_pools_conform_on_cuda(name: str) -> None:
    checks = [c for c in CHECKS if c != "preallocation"]
    assert_conformant(name, device="cuda", checks=checks, max_examples=30)
