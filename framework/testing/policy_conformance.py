"""A conformance kit for schedule policies (``register_schedule_policies``).

A policy author runs it from their own test suite::

    from framework.testing.policy_conformance import assert_conformant

    def test_my_policy_conforms():
        assert_conformant(MyPolicy.create)               # or assert_conformant("my_policy")

A policy's ``order(waiting, prefix_len)`` (:class:`framework.scheduler.policy.SchedulePolicy`)
is called on queues of fake requests that have exactly what the contract promises, ``rid``,
``arrival_time`` and ``priority`` (an int or None; a policy reading anything else fails here, as
it could on a real server where that attribute means something else), with a ``prefix_len`` that
answers random cached-prefix lengths. The checks:

- ``empty``: ``order([], prefix_len)`` returns an empty list;
- ``permutation``: the result is a list holding exactly the input's request objects (by
  identity), none lost, none repeated;
- ``no_mutation``: the input list is left as it was (same objects, same order);
- ``deterministic``: the same queue and prefix lengths give the same order, on a fresh policy
  object too;
- ``prefix_len_domain``: ``prefix_len`` is called only with requests from the input;
- ``large_queue``: the above on a queue of 1,000 requests (policies often switch strategy when
  the queue is long);
- ``random_queues``: property-based (hypothesis): all of the above on random queues (arrival
  ties, equal prefix lengths, duplicate rids), a failure shrunk to a minimal queue.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from framework.testing.conformance_common import (
    CheckFailed,
    CheckResult,
    ConformanceReport,
    resolve_component,
    run_check,
)

__all__ = ["CHECKS", "CheckResult", "ConformanceReport", "FakeRequest", "assert_conformant", "run_conformance"]

CHECKS = ("empty", "permutation", "no_mutation", "deterministic", "prefix_len_domain", "large_queue",
          "random_queues")
DEFAULT_MAX_EXAMPLES = 150

PolicyFactory = Callable[[Any], Any]


@dataclass(eq=False)
class FakeRequest:
    """What the policy contract promises a request has. ``eq=False``: compared by identity, as
    the scheduler's requests are."""

    rid: str
    arrival_time: float
    priority: int | None = None
    _index: int = -1
    """Its place in the queue as built (only for messages: rids may repeat)."""

    def __repr__(self) -> str:
        return f"Req#{self._index}({self.rid!r}, t={self.arrival_time:g}, priority={self.priority})"


class _PrefixLen:
    """``prefix_len`` for one queue: fixed random answers, recording every call and every
    argument that is not one of the queue's requests."""

    def __init__(self, queue: list[Any], lens: list[int]) -> None:
        self._lens = {id(r): n for r, n in zip(queue, lens, strict=True)}
        self.calls = 0
        self.foreign: list[Any] = []

    def __call__(self, req: Any) -> int:
        self.calls += 1
        if id(req) not in self._lens:
            self.foreign.append(req)
            return 0
        return self._lens[id(req)]


def _queue(n: int, seed: int) -> tuple[list[FakeRequest], list[int]]:
    rng = random.Random(seed)
    # arrival and priority ties; some requests send no priority
    reqs = [FakeRequest(f"r{i}", float(rng.randrange(max(1, n // 2))), rng.choice((None, -3, 0, 0, 2, 7)), i)
            for i in range(n)]
    return reqs, [rng.choice((0, 0, 16, 32, rng.randrange(200))) for _ in range(n)]


def _describe(queue: list[Any], lens: list[int]) -> str:
    return "[" + ", ".join(f"{r!r} prefix={n}" for r, n in zip(queue, lens, strict=True)) + "]"


_ALL = frozenset({"permutation", "no_mutation", "prefix_len_domain"})


def _order_once(
    policy: Any, queue: list[Any], lens: list[int], enforce: frozenset[str] = _ALL
) -> tuple[list[Any], _PrefixLen]:
    """One ``order`` call, checking the per-call properties in ``enforce`` (a check enforces its
    own property, so a policy that breaks one property fails that check, not every check)."""
    given = list(queue)
    pl = _PrefixLen(queue, lens)
    out = policy.order(given, pl)
    what = f"order() of {len(queue)} requests" + (f" {_describe(queue, lens)}" if len(queue) <= 12 else "")
    if "permutation" in enforce and not isinstance(out, list):
        raise CheckFailed(f"{what} returned a {type(out).__name__}, expected a list")
    mutated = len(given) != len(queue) or any(a is not b for a, b in zip(given, queue, strict=False))
    if "no_mutation" in enforce and mutated:
        raise CheckFailed(f"{what} modified its input list: it became {given!r}")
    if "prefix_len_domain" in enforce and pl.foreign:
        raise CheckFailed(f"{what} called prefix_len with {pl.foreign[0]!r}, which is not one of its requests")
    ids_in = sorted(id(r) for r in queue)
    ids_out = sorted(id(r) for r in out)
    if "permutation" in enforce and ids_in != ids_out:
        lost = [r for r in queue if not any(r is o for o in out)]
        dup = [r for i, r in enumerate(out) if any(r is o for o in out[:i])]
        foreign = [r for r in out if not any(r is q for q in queue)]
        parts = [f"lost {lost!r}" if lost else "", f"repeated {dup!r}" if dup else "",
                 f"added {foreign!r}" if foreign else ""]
        raise CheckFailed(f"{what} returned {len(out)} requests, not a permutation of its input: "
                          + "; ".join(p for p in parts if p))
    return out, pl


def _check_empty(make: Callable[[], Any]) -> str:
    out, pl = _order_once(make(), [], [], frozenset())
    if not isinstance(out, list) or out:
        raise CheckFailed(f"order([]) returned {out!r}")
    return f"prefix_len called {pl.calls} times"


def _check_permutation(make: Callable[[], Any]) -> str:
    policy = make()
    for n in (1, 2, 3, 8, 33):
        for seed in range(3):
            _order_once(policy, *_queue(n, seed), frozenset({"permutation"}))
    return "queues of 1, 2, 3, 8 and 33 requests"


def _check_no_mutation(make: Callable[[], Any]) -> str:
    policy = make()
    queue, lens = _queue(20, 7)
    queue.reverse()  # not already in arrival order: a sort in place would show
    _order_once(policy, queue, lens, frozenset({"no_mutation"}))
    return "20 requests in reverse order"


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=False))


def _check_deterministic(make: Callable[[], Any], n: int = 40, enforce: frozenset[str] = frozenset()) -> str:
    queue, lens = _queue(n, 11)
    policy = make()
    first, _ = _order_once(policy, queue, lens, enforce)
    again, _ = _order_once(policy, queue, lens, enforce)
    fresh, _ = _order_once(make(), queue, lens, enforce)
    for label, other in (("a second call", again), ("a fresh policy", fresh)):
        if not _same(first, other):
            raise CheckFailed(f"order() of the same {n} requests gave another order on {label}: "
                              f"{[r.rid for r in first]} vs {[r.rid for r in other]}")
    return f"{n} requests, 3 calls"


def _check_prefix_len_domain(make: Callable[[], Any]) -> str:
    policy = make()
    calls = 0
    for n in (1, 5, 50):
        _, pl = _order_once(policy, *_queue(n, n), frozenset({"prefix_len_domain"}))
        calls += pl.calls
    return f"prefix_len called {calls} times, always with a queued request"


def _check_large_queue(make: Callable[[], Any]) -> str:
    _check_deterministic(make, n=1000, enforce=_ALL)
    return "1000 requests"


def _check_random_queues(make: Callable[[], Any], max_examples: int) -> str:
    from hypothesis import HealthCheck, Verbosity, given, settings
    from hypothesis import strategies as st

    counts = {"examples": 0}
    item = st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 5), st.integers(0, 64),
                     st.none() | st.integers(-3, 3))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(items=st.lists(item, max_size=30), same_policy=st.booleans())
    def prop(items: list[tuple[str, int, int, int | None]], same_policy: bool) -> None:
        counts["examples"] += 1
        queue = [FakeRequest(rid, float(t), prio, i) for i, (rid, t, _, prio) in enumerate(items)]
        lens = [n for _, _, n, _ in items]
        policy = make()
        first, _ = _order_once(policy, queue, lens)
        again, _ = _order_once(policy if same_policy else make(), queue, lens)
        if not _same(first, again):
            raise CheckFailed(f"order() of {_describe(queue, lens)} is not deterministic: "
                              f"{first!r} then {again!r}")

    prop()
    return f"{counts['examples']} random queues"


def run_conformance(
    factory: PolicyFactory | str,
    options: Any = None,
    checks: Iterable[str] = CHECKS,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
) -> ConformanceReport:
    """Check a schedule policy and report per check.

    ``factory`` is what the plugin registers (``factory(options) -> SchedulePolicy``) or a
    registered policy name; ``options`` its options (a mapping or the dataclass for a name, passed
    through as given for a factory). A fresh policy is built for each check."""
    factory, options, name = resolve_component("schedule_policy", factory, options, "scheduler.policy")
    wanted = list(checks)
    unknown = set(wanted) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown policy checks {sorted(unknown)}; known: {', '.join(CHECKS)}")

    def make() -> Any:
        return factory(options)

    report = ConformanceReport("schedule policy", name)
    fns: dict[str, Callable[[], str]] = {
        "empty": lambda: _check_empty(make),
        "permutation": lambda: _check_permutation(make),
        "no_mutation": lambda: _check_no_mutation(make),
        "deterministic": lambda: _check_deterministic(make),
        "prefix_len_domain": lambda: _check_prefix_len_domain(make),
        "large_queue": lambda: _check_large_queue(make),
        "random_queues": lambda: _check_random_queues(make, max_examples),
    }
    for check in wanted:
        report.results.append(run_check(check, fns[check]))
    return report


def assert_conformant(factory: PolicyFactory | str, options: Any = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with every failing check if any fails."""
    return run_conformance(factory, options, **kwargs).raise_for_failures()
