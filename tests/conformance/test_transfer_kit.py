"""The KV transfer conformance kit on every built-in transfer backend (two real processes each), on
a backend that corrupts a byte (it must fail), and the optional-check declaration."""

from __future__ import annotations

import pytest

from framework.plugins import get_registry
from framework.testing.transfer_conformance import CHECKS, assert_conformant, declared_optional, run_conformance
from tests.conformance.broken_transfer import BlindBackend, CorruptingBackend, DeclaredBlindBackend

BUILTIN_TRANSFER = ("nccl", "mooncake", "nixl")
NEEDS = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}


def test_every_builtin_transfer_backend_is_covered() -> None:
    builtins = {c.name for c in get_registry().all() if c.kind == "transfer_backend" and c.module.startswith("plugins.")}
    assert builtins == set(BUILTIN_TRANSFER)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", BUILTIN_TRANSFER)
def test_builtin_transfer_backend_conforms(name: str) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} is not installed")
    optional = declared_optional(get_registry().get("transfer_backend", name).factory)
    # A backend that cannot tell a dead peer gets the sender-side link check only (it shows OPT-FAIL):
    # the receiver-side one would start a second pair of processes (~10 s here) to show the same.
    checks = [c for c in CHECKS if not (optional and c == "link_error_receiver")]
    report = assert_conformant(name, checks=checks, link_error_deadline_s=2.0 if optional else 15.0)
    assert [r.name for r in report.results] == checks
    for r in report.results:
        assert r.passed or r.name in optional, str(report)
    print(report)


@pytest.mark.timeout(120)
def test_a_backend_that_corrupts_a_byte_fails_the_roundtrip() -> None:
    report = run_conformance(CorruptingBackend.create, checks=["roundtrip"])
    assert not report.passed
    detail = report.result("roundtrip").detail
    assert "buffer 1 (layer 0 V): destination page 4 differs from source page 1 at byte 5" in detail
    with pytest.raises(AssertionError, match=r"transfer backend CorruptingBackend.create fails 1/1"):
        report.raise_for_failures()


@pytest.mark.timeout(120)
def test_declared_optional_checks_are_reported_without_failing_the_run() -> None:
    report = run_conformance(DeclaredBlindBackend.create, checks=["roundtrip", "link_error_sender"],
                             link_error_deadline_s=1.0)
    assert report.passed
    blind = report.result("link_error_sender")
    assert not blind.passed and blind.optional and blind.verdict == "OPT-FAIL"
    assert "link_error() still None" in blind.detail


def test_the_declaration_is_read_from_the_factory_owner_and_validated() -> None:
    assert declared_optional(DeclaredBlindBackend.create) == {"link_error_sender", "link_error_receiver"}
    assert declared_optional(BlindBackend.create) == frozenset()
    assert declared_optional(get_registry().get("transfer_backend", "nccl").factory) == frozenset()

    class Bad(BlindBackend):
        conformance_optional = {"roundtrip"}

    class Typo(BlindBackend):
        conformance_optional = {"link_eror_sender"}

    with pytest.raises(ValueError, match="roundtrip cannot be optional"):
        declared_optional(Bad.create)
    with pytest.raises(ValueError, match="unknown checks"):
        declared_optional(Typo.create)
    with pytest.raises(ValueError, match="cannot be optional"):
        run_conformance("nccl", optional={"roundtrip"})


def test_a_local_factory_is_refused_with_a_reason() -> None:
    def local_factory(role, layout, options):
        raise AssertionError("never built")

    with pytest.raises(ValueError, match="cannot be rebuilt in the peer processes"):
        run_conformance(local_factory)
