"""What the conformance kits of ``framework.testing`` share: a check's result, the report, and
looking a component up by its registered name.

Every kit has the same three entry points (``attention_conformance`` has its own grid-shaped
variant of the same API):

- ``run_conformance(component, ...) -> ConformanceReport``: runs every check, never raises for a
  failing check (an exception from the component fails that check and the run goes on);
- ``assert_conformant(component, ...)``: the same, raising ``AssertionError`` with every failing
  check and the first traceback;
- ``ConformanceReport``: ``passed``, ``failures``, ``results``; ``str(report)`` is a table.

``component`` is a registered name (looked up in this process's plugin registry, options built
from its options dataclass) or the factory itself.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """The outcome of one named check."""

    name: str
    passed: bool
    detail: str = ""
    """What was measured, or why it failed."""
    error: str | None = None
    """The traceback when the component raised where it must not have."""
    optional: bool = False
    """The component declared this check optional: a failure is reported but does not fail the run."""
    skipped: bool = False
    """The check does not apply to this component (e.g. pre-allocation checks on a plain pool)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Passed, skipped, or failed but optional."""
        return self.passed or self.skipped or self.optional

    @property
    def verdict(self) -> str:
        if self.skipped:
            return "SKIP"
        if self.passed:
            return "PASS"
        return "OPT-FAIL" if self.optional else "FAIL"

    def __str__(self) -> str:
        line = f"{self.verdict:<8} {self.name:<28} {self.seconds:6.2f}s"
        detail = self.detail.strip()
        if self.error and not detail:
            detail = "raised: " + self.error.strip().splitlines()[-1]
        if detail:
            first, *rest = detail.splitlines()
            line += "  " + first + "".join("\n" + " " * 47 + r for r in rest)
        return line


@dataclass
class ConformanceReport:
    """Every check's result; ``passed`` when none failed (optional failures and skips are fine)."""

    kind: str
    component: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    @property
    def optional_failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed and r.optional and not r.skipped]

    def result(self, name: str) -> CheckResult:
        """The result of the check called ``name`` (KeyError if it did not run)."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check {name!r} in this report; ran: {', '.join(r.name for r in self.results)}")

    def __str__(self) -> str:
        ok = sum(r.ok for r in self.results)
        head = f"{self.kind} conformance of {self.component}: {ok}/{len(self.results)} checks pass"
        return "\n".join([head, *(str(r) for r in self.results)])

    def raise_for_failures(self) -> ConformanceReport:
        """Raise ``AssertionError`` listing every failed check (and the first traceback)."""
        if self.passed:
            return self
        first_error = next((r.error for r in self.failures if r.error), None)
        detail = f"\nfirst exception:\n{first_error}" if first_error else ""
        raise AssertionError(
            f"{self.kind} {self.component} fails {len(self.failures)}/{len(self.results)} conformance checks:\n"
            + "\n".join(str(r) for r in self.failures)
            + detail
        )


class CheckFailed(AssertionError):
    """Raised inside a check for a contract violation (as opposed to the component raising)."""


def run_check(name: str, fn: Callable[[], str | None], optional: bool = False) -> CheckResult:
    """Run ``fn`` as check ``name``: it returns a detail line (or None) when the check passes and
    raises :class:`CheckFailed` (or any ``AssertionError``) when it fails; any other exception is
    the component raising and fails the check with its traceback."""
    start = time.monotonic()
    try:
        detail = fn() or ""
    except AssertionError as exc:
        return CheckResult(name, False, str(exc), optional=optional, seconds=time.monotonic() - start)
    except Exception as exc:
        return CheckResult(name, False, f"raised {type(exc).__name__}: {exc}", traceback.format_exc(),
                           optional=optional, seconds=time.monotonic() - start)
    return CheckResult(name, True, detail, optional=optional, seconds=time.monotonic() - start)


def display_name(factory: Any) -> str:
    """``Class.create`` for a classmethod factory (the class it was looked up on, not the one that
    defines it), else the qualified name."""
    owner = getattr(factory, "__self__", None)
    if isinstance(owner, type):
        return f"{owner.__name__}.{factory.__name__}"
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def resolve_component(kind: str, factory: Callable[..., Any] | str, options: Any, key: str) -> tuple[Any, Any, str]:
    """``(factory, options, display name)`` for a registered name or a factory.

    A name is looked up in this process's registry (entry points included) and ``options`` (a
    mapping, a dataclass instance or None for the defaults) goes through the component's options
    dataclass, as the config loader would build it. A factory is used as given, with ``options``
    passed through unchanged."""
    if not isinstance(factory, str):
        return factory, options, display_name(factory)
    from framework.plugins import get_registry

    comp = get_registry().get(kind, factory, key=key)
    return comp.factory, comp.make_options(options), factory
