"""A conformance kit for request pools (the "memory pool" plugin kind).

A pool author runs it from their own test suite::

    from framework.testing.pool_conformance import assert_conformant

    def test_my_pool_conforms():
        assert_conformant(MyPool.create)                 # or assert_conformant("my_pool")

It builds pools through the factory the plugin registers
(``factory(size, max_context_len, device, options) -> RequestPool``) and checks the contract of
:class:`framework.memory.request_pool.RequestPool`:

- ``declaration`` (a pool given by registered name): it is a
  :class:`~framework.memory.request_pool.PreallocatingRequestPool` exactly when it registered
  ``Capabilities(preallocation=True)`` (config resolution trusts the flag, the decode server the
  type);
- ``table``: ``size <= num_rows``; ``req_to_token`` is an int32 tensor of shape
  ``(num_rows, max_context_len)`` on the device; ``write`` lands in it; a fresh pool has every
  row free and ``available_size() + in_use() == num_rows``;
- ``exhaust``: ``alloc(num_rows)`` hands out every row of ``0 .. num_rows - 1`` exactly once,
  then ``alloc(1)`` is ``None``; ``alloc(num_rows + 1)`` is ``None`` and takes nothing;
  ``alloc(0) == []``;
- ``bad_free``: freeing a row that is not in use, out of range (-1, ``num_rows``), twice in one
  call, twice in a row, or a list mixing a valid row with a bad one raises ``ValueError`` and
  changes nothing (the valid row stays in use);
- ``preallocation`` (pre-allocating pools only, see :func:`is_preallocating`): ``activate`` of a
  row that is not reserved (free, freed, or out of range) raises ``ValueError``; at most
  ``size`` rows run at once (``activate`` answers ``False`` past that, ``True`` for a row already
  running); freeing or ``deactivate`` of a running row stops it; ``running_count()`` agrees;
- ``random_ops``: property-based (hypothesis): random sequences of alloc / free / bad free
  (/ activate / bad activate / deactivate) on pools of random size, each step compared with a model of the free and
  running sets; a failure is shrunk to a minimal sequence, printed with the report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.memory.request_pool import PreallocatingRequestPool
from framework.testing.conformance_common import (
    CheckFailed,
    CheckResult,
    ConformanceReport,
    resolve_component,
    run_check,
)

__all__ = [
    "CHECKS",
    "CheckResult",
    "ConformanceReport",
    "assert_conformant",
    "is_preallocating",
    "run_conformance",
]

CHECKS = ("declaration", "table", "exhaust", "bad_free", "preallocation", "random_ops")
#: (size, max_context_len) of the pools the deterministic checks build.
SHAPES = ((1, 1), (3, 16), (8, 33))
DEFAULT_MAX_EXAMPLES = 150

PoolFactory = Callable[[int, int, Any, Any], Any]


def is_preallocating(pool: Any) -> bool:
    """Whether ``pool`` reserves rows beyond its running cap (PD decode): the one place the kit
    decides whether the ``preallocation`` checks apply. A pool declares it by being a
    :class:`PreallocatingRequestPool`, which is what ``framework.disaggregation.decode_side``
    requires (and ``Capabilities(preallocation=True)`` at registration, see ``declaration``)."""
    return isinstance(pool, PreallocatingRequestPool)


@dataclass
class _Model:
    """What the pool's state must be: the rows in use and, for pre-allocating pools, running."""

    size: int
    num_rows: int
    prealloc: bool
    in_use: set[int] = field(default_factory=set)
    running: set[int] = field(default_factory=set)
    trace: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> CheckFailed:
        steps = "\n".join(f"  {s}" for s in self.trace[-25:])
        more = f"  ... ({len(self.trace) - 25} earlier steps)\n" if len(self.trace) > 25 else ""
        return CheckFailed(
            f"{msg}\npool size={self.size} num_rows={self.num_rows}; steps so far:\n{more}{steps}"
        )

    def free_rows(self) -> list[int]:
        return sorted(set(range(self.num_rows)) - self.in_use)


def _device_matches(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _make(factory: PoolFactory, options: Any, size: int, ctx: int, device: torch.device) -> tuple[Any, _Model]:
    pool = factory(size, ctx, str(device), options)
    for attr in ("size", "num_rows", "max_context_len"):
        if not isinstance(getattr(pool, attr, None), int):
            raise CheckFailed(f"pool.{attr} must be an int, got {getattr(pool, attr, None)!r}")
    if pool.size != size:
        raise CheckFailed(f"pool.size is {pool.size}, the factory was given size={size}")
    if pool.max_context_len != ctx:
        raise CheckFailed(f"pool.max_context_len is {pool.max_context_len}, the factory was given {ctx}")
    if pool.num_rows < pool.size:
        raise CheckFailed(f"num_rows ({pool.num_rows}) < size ({pool.size}): the running cap must fit the table")
    return pool, _Model(pool.size, pool.num_rows, is_preallocating(pool))


def _check_counts(pool: Any, m: _Model) -> None:
    free = m.num_rows - len(m.in_use)
    avail = pool.available_size()
    if avail != free:
        raise m.fail(f"available_size() is {avail}, expected {free} ({len(m.in_use)} of {m.num_rows} rows in use)")
    if pool.in_use() + avail != m.num_rows:
        raise m.fail(f"available_size() + in_use() = {avail} + {pool.in_use()} != num_rows {m.num_rows}")
    if m.prealloc and pool.running_count() != len(m.running):
        raise m.fail(f"running_count() is {pool.running_count()}, expected {len(m.running)} ({sorted(m.running)})")


def _alloc(pool: Any, m: _Model, n: int) -> list[int] | None:
    free_before = m.num_rows - len(m.in_use)
    try:
        rows = pool.alloc(n)
    except Exception as exc:
        m.trace.append(f"alloc({n}) raised {type(exc).__name__}: {exc}")
        raise m.fail(f"alloc({n}) raised {type(exc).__name__} with {free_before} rows free") from exc
    m.trace.append(f"alloc({n}) -> {rows}")
    if rows is None:
        if n <= free_before:
            raise m.fail(f"alloc({n}) returned None with {free_before} rows free")
    else:
        rows = list(rows)
        for r in rows:
            if not isinstance(r, int) or isinstance(r, bool):
                raise m.fail(f"alloc({n}) returned {r!r} ({type(r).__name__}); rows must be Python ints")
            if not 0 <= r < m.num_rows:
                raise m.fail(f"alloc({n}) returned row {r}, outside 0 .. {m.num_rows - 1}")
            if r in m.in_use:
                raise m.fail(f"alloc({n}) returned row {r}, which is already in use (handed out twice)")
        if len(set(rows)) != len(rows):
            raise m.fail(f"alloc({n}) returned the same row twice: {rows}")
        if n > free_before:
            raise m.fail(f"alloc({n}) with only {free_before} rows free returned {rows}, expected None")
        if len(rows) != n:
            raise m.fail(f"alloc({n}) returned {len(rows)} rows: {rows}")
        m.in_use.update(rows)
    _check_counts(pool, m)
    return rows


def _free(pool: Any, m: _Model, rows: int | list[int]) -> None:
    try:
        pool.free(rows)
    except Exception as exc:
        m.trace.append(f"free({rows}) raised {type(exc).__name__}: {exc}")
        raise m.fail(f"free({rows}) of rows in use raised {type(exc).__name__}") from exc
    m.trace.append(f"free({rows})")
    freed = [rows] if isinstance(rows, int) else rows
    m.in_use.difference_update(freed)
    m.running.difference_update(freed)
    _check_counts(pool, m)


def _bad_free(pool: Any, m: _Model, rows: int | list[int], why: str) -> None:
    """``free(rows)`` must raise ValueError and change nothing."""
    try:
        pool.free(rows)
    except ValueError:
        m.trace.append(f"free({rows}) [{why}] raised ValueError")
    except Exception as exc:
        m.trace.append(f"free({rows}) [{why}] raised {type(exc).__name__}: {exc}")
        raise m.fail(f"free({rows}) ({why}) raised {type(exc).__name__}, expected ValueError") from exc
    else:
        m.trace.append(f"free({rows}) [{why}] returned")
        raise m.fail(f"free({rows}) ({why}) did not raise ValueError")
    _check_counts(pool, m)


def _deactivate(pool: Any, m: _Model, row: int) -> None:
    pool.deactivate(row)
    m.trace.append(f"deactivate({row})")
    m.running.discard(row)
    _check_counts(pool, m)


def _activate(pool: Any, m: _Model, row: int) -> None:
    """Activate a reserved row: True iff it already runs or fewer than ``size`` rows run."""
    want = row in m.running or len(m.running) < m.size
    try:
        got = pool.activate(row)
    except Exception as exc:
        m.trace.append(f"activate({row}) raised {type(exc).__name__}: {exc}")
        raise m.fail(f"activate({row}) of a reserved row raised {type(exc).__name__}") from exc
    m.trace.append(f"activate({row}) -> {got}")
    if bool(got) != want:
        raise m.fail(
            f"activate({row}) returned {got!r} with {len(m.running)} of size={m.size} rows running"
            f"{' (this one among them)' if row in m.running else ''}; expected {want}"
        )
    if want:
        m.running.add(row)
    _check_counts(pool, m)


def _bad_activate(pool: Any, m: _Model, row: int, why: str) -> None:
    try:
        got = pool.activate(row)
    except ValueError:
        m.trace.append(f"activate({row}) [{why}] raised ValueError")
        return
    except Exception as exc:
        m.trace.append(f"activate({row}) [{why}] raised {type(exc).__name__}: {exc}")
        raise m.fail(f"activate({row}) ({why}) raised {type(exc).__name__}, expected ValueError") from exc
    m.trace.append(f"activate({row}) [{why}] -> {got!r}")
    raise m.fail(f"activate({row}) ({why}) returned {got!r}, expected ValueError")


# -- the deterministic checks --------------------------------------------------------------------


def _check_declaration(comp: Any, factory: PoolFactory, options: Any, device: torch.device) -> str:
    declared = bool(comp.capabilities.preallocation)
    actual = is_preallocating(factory(2, 4, str(device), options))
    if declared != actual:
        if declared:
            raise CheckFailed("registered with Capabilities(preallocation=True) but the pool is not a "
                              "PreallocatingRequestPool: a PD decode server would accept it at config "
                              "resolution, then refuse it")
        raise CheckFailed("the pool is a PreallocatingRequestPool but registered without "
                          "Capabilities(preallocation=True): PD decode servers will not accept it")
    return f"preallocation={declared}"


def _check_table(factory: PoolFactory, options: Any, device: torch.device) -> str:
    notes = []
    for size, ctx in SHAPES:
        pool, m = _make(factory, options, size, ctx, device)
        t = pool.req_to_token
        if not isinstance(t, torch.Tensor):
            raise CheckFailed(f"req_to_token is a {type(t).__name__}, expected a torch.Tensor")
        if tuple(t.shape) != (pool.num_rows, ctx):
            raise CheckFailed(f"req_to_token has shape {tuple(t.shape)}, expected (num_rows, max_context_len) "
                              f"= {(pool.num_rows, ctx)}")
        if t.dtype != torch.int32:
            raise CheckFailed(f"req_to_token has dtype {t.dtype}, expected torch.int32")
        if not _device_matches(t, device):
            raise CheckFailed(f"req_to_token is on {t.device}, expected {device}")
        _check_counts(pool, m)
        row = _alloc(pool, m, 1)[0]
        values = torch.arange(7, 7 + ctx, dtype=torch.int32, device=device)
        pool.write((row, slice(0, ctx)), values)
        if not torch.equal(pool.req_to_token[row].cpu(), values.cpu()):
            raise CheckFailed("write((row, slice(0, ctx)), values) did not land in req_to_token[row]")
        pool.write((row, ctx - 1), 3)
        if int(pool.req_to_token[row, ctx - 1]) != 3:
            raise CheckFailed("write((row, pos), 3) did not land in req_to_token[row, pos]")
        notes.append(f"size={size}: num_rows={pool.num_rows}")
    return "; ".join(notes)


def _check_exhaust(factory: PoolFactory, options: Any, device: torch.device) -> str:
    for size, ctx in SHAPES:
        pool, m = _make(factory, options, size, ctx, device)
        if _alloc(pool, m, 0) != []:
            raise m.fail("alloc(0) must return [] (nothing taken)")
        _alloc(pool, m, m.num_rows + 1)  # None, nothing taken
        rows = _alloc(pool, m, m.num_rows)
        if sorted(rows) != list(range(m.num_rows)):
            raise m.fail(f"alloc(num_rows) returned {rows}, not every row once")
        _alloc(pool, m, 1)  # None
        _free(pool, m, rows)
        again = _alloc(pool, m, m.num_rows)
        if sorted(again) != list(range(m.num_rows)):
            raise m.fail(f"after freeing everything, alloc(num_rows) returned {again}")
    return f"shapes {', '.join(f'{s}x{c}' for s, c in SHAPES)}"


def _check_bad_free(factory: PoolFactory, options: Any, device: torch.device) -> str:
    pool, m = _make(factory, options, 3, 8, device)
    if m.num_rows < 2:
        raise CheckFailed("the bad-free check needs a pool of at least 2 rows for size=3")
    (used,) = _alloc(pool, m, 1)
    unused = m.free_rows()[0]
    _bad_free(pool, m, unused, "not in use")
    _bad_free(pool, m, [unused], "not in use, as a list")
    _bad_free(pool, m, -1, "out of range")
    _bad_free(pool, m, m.num_rows, "out of range")
    _bad_free(pool, m, [used, used], "the same row twice in one call")
    _bad_free(pool, m, [used, unused], "a row in use with one that is not")
    _bad_free(pool, m, [used, m.num_rows], "a row in use with one out of range")
    # Nothing changed: ``used`` is still in use (``_alloc`` fails if it comes back), the rest is free.
    _alloc(pool, m, m.num_rows - 1)
    _free(pool, m, [used])
    _bad_free(pool, m, used, "freed twice")
    return f"num_rows={m.num_rows}: 8 bad frees rejected"


def _check_preallocation(factory: PoolFactory, options: Any, device: torch.device) -> str:
    pool, m = _make(factory, options, 3, 8, device)
    _bad_activate(pool, m, m.free_rows()[0], "a free row")
    reserved = _alloc(pool, m, m.num_rows)
    _bad_activate(pool, m, -1, "out of range, with every row reserved")
    _bad_activate(pool, m, m.num_rows, "out of range")
    for row in reserved:
        _activate(pool, m, row)  # the first ``size`` succeed, then False
    if len(m.running) != m.size:
        raise m.fail(f"{len(m.running)} rows running after activating all, expected size={m.size}")
    _activate(pool, m, sorted(m.running)[0])  # already running: True
    if m.num_rows > m.size:
        waiting = [r for r in reserved if r not in m.running]
        _activate(pool, m, waiting[0])  # False: the cap is reached
        _free(pool, m, sorted(m.running)[0])  # stops running
        _activate(pool, m, waiting[0])  # True now
        if len(waiting) > 1:
            _deactivate(pool, m, waiting[0])  # stops running, stays reserved
            _activate(pool, m, waiting[1])
            _activate(pool, m, waiting[0])  # False again: waiting[1] took the slot
    freed = reserved[0]
    if freed in m.in_use:
        _free(pool, m, freed)
    _bad_activate(pool, m, freed, "a freed row")
    return f"size={m.size} num_rows={m.num_rows}"


# -- the property-based check --------------------------------------------------------------------

def _step(pool: Any, m: _Model, data: Any) -> None:
    """One random operation, chosen among those that apply to the current state."""
    from hypothesis import strategies as st

    used, free = sorted(m.in_use), m.free_rows()
    ops = ["alloc", "alloc"]
    if used:
        ops += ["free", "free_many"]
    ops.append("bad_free")
    if m.prealloc and used:
        ops += ["activate", "activate", "deactivate"]
    if m.prealloc and free:
        ops.append("activate_bad")
    op = data.draw(st.sampled_from(ops))
    if op == "alloc":
        _alloc(pool, m, data.draw(st.integers(0, m.num_rows + 1)))
    elif op == "free":
        _free(pool, m, data.draw(st.sampled_from(used)))
    elif op == "free_many":
        _free(pool, m, data.draw(st.lists(st.sampled_from(used), min_size=1, unique=True)))
    elif op == "bad_free":
        kinds = ["negative", "past_end"] + (["unused"] if free else []) + (["duplicate"] if used else [])
        kinds += ["mixed"] if used and free else []
        kind = data.draw(st.sampled_from(kinds))
        if kind == "negative":
            _bad_free(pool, m, data.draw(st.integers(-3, -1)), "out of range")
        elif kind == "past_end":
            _bad_free(pool, m, data.draw(st.integers(m.num_rows, m.num_rows + 2)), "out of range")
        elif kind == "unused":
            _bad_free(pool, m, data.draw(st.sampled_from(free)), "not in use")
        elif kind == "duplicate":
            r = data.draw(st.sampled_from(used))
            _bad_free(pool, m, [r, r], "the same row twice in one call")
        else:
            _bad_free(pool, m, [data.draw(st.sampled_from(used)), data.draw(st.sampled_from(free))],
                      "a row in use with one that is not")
    elif op == "deactivate":
        _deactivate(pool, m, data.draw(st.sampled_from(used)))
    elif op == "activate":
        _activate(pool, m, data.draw(st.sampled_from(used)))
    else:
        _bad_activate(pool, m, data.draw(st.sampled_from(free)), "not reserved")


def _check_random_ops(factory: PoolFactory, options: Any, device: torch.device, max_examples: int) -> str:
    from hypothesis import HealthCheck, Verbosity, given, settings
    from hypothesis import strategies as st

    counts = {"examples": 0, "steps": 0}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(size=st.integers(1, 5), ctx=st.integers(1, 6), steps=st.integers(1, 40), data=st.data())
    def prop(size: int, ctx: int, steps: int, data: Any) -> None:
        pool, m = _make(factory, options, size, ctx, device)
        counts["examples"] += 1
        for _ in range(steps):
            _step(pool, m, data)
            counts["steps"] += 1

    prop()
    return f"{counts['examples']} random sequences, {counts['steps']} steps"


# -- entry points --------------------------------------------------------------------------------


def run_conformance(
    factory: PoolFactory | str,
    options: Any = None,
    device: str | torch.device = "cpu",
    checks: Iterable[str] = CHECKS,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
) -> ConformanceReport:
    """Check a request pool and report per check.

    ``factory`` is what the plugin registers (``factory(size, max_context_len, device, options)``)
    or a registered memory-pool name; ``options`` its options (a mapping or the dataclass for a
    name, passed through as given for a factory). ``checks`` narrows the run to some of
    :data:`CHECKS`; ``max_examples`` sizes the hypothesis search of ``random_ops``. The
    ``preallocation`` check is skipped for pools that are not pre-allocating."""
    comp = None
    if isinstance(factory, str):
        from framework.plugins import get_registry

        comp = get_registry().get("memory_pool", factory, key="memory_pool.name")
    factory, options, name = resolve_component("memory_pool", factory, options, "memory_pool.name")
    dev = torch.device(device)
    report = ConformanceReport("memory pool", name)
    wanted = list(checks)
    unknown = set(wanted) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown pool checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    prealloc = None
    for check in wanted:
        if check == "declaration":
            if comp is None:
                report.results.append(CheckResult(check, False, "given a factory: no registration", skipped=True))
            else:
                report.results.append(run_check(check, lambda: _check_declaration(comp, factory, options, dev)))
            continue
        if check == "preallocation":
            if prealloc is None:
                prealloc = is_preallocating(factory(1, 1, str(dev), options))
            if not prealloc:
                report.results.append(CheckResult(check, False, "not a pre-allocating pool", skipped=True))
                continue
        if check == "random_ops":
            report.results.append(run_check(check, lambda: _check_random_ops(factory, options, dev, max_examples)))
            continue
        fn = {"table": _check_table, "exhaust": _check_exhaust, "bad_free": _check_bad_free,
              "preallocation": _check_preallocation}[check]
        report.results.append(run_check(check, lambda fn=fn: fn(factory, options, dev)))
    return report


def assert_conformant(factory: PoolFactory | str, options: Any = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with every failing check if any fails."""
    return run_conformance(factory, options, **kwargs).raise_for_failures()
