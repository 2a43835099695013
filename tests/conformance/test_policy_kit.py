"""The schedule-policy conformance kit on every built-in policy, and on broken policies it must fail."""

from __future__ import annotations

import random

import pytest

from framework.plugins import get_registry
from framework.testing.policy_conformance import CHECKS, assert_conformant, run_conformance

BUILTIN_POLICIES = ("fcfs", "lpm", "priority")


def test_every_builtin_policy_is_covered() -> None:
    builtins = {c.name for c in get_registry().all() if c.kind == "schedule_policy" and c.module.startswith("plugins")}
    assert builtins == set(BUILTIN_POLICIES)


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
def test_builtin_policy_conforms(name: str) -> None:
    report = assert_conformant(name)
    assert [r.name for r in report.results] == list(CHECKS)


def test_lpm_conforms_on_its_fcfs_fallback_too() -> None:
    """Above ``max_queue_for_matching`` lpm stops matching: both paths must conform."""
    report = assert_conformant("lpm", {"max_queue_for_matching": 3})
    # queues of 1, 5 and 50: only the first is matched
    assert "prefix_len called 1 times" in report.result("prefix_len_domain").detail


# --- broken policies: the kit must fail them, naming the problem ----------------------------------


class _Dropping:
    """Loses the newest request of any queue longer than two."""

    def order(self, waiting, prefix_len):
        ordered = sorted(waiting, key=lambda r: r.arrival_time)
        return ordered[:-1] if len(ordered) > 2 else ordered


class _SortsInPlace:
    def order(self, waiting, prefix_len):
        waiting.sort(key=lambda r: r.arrival_time)
        return list(waiting)


class _Shuffling:
    def order(self, waiting, prefix_len):
        out = list(waiting)
        random.shuffle(out)
        return out


class _ProbesOtherRequests:
    """Asks the prefix cache about a request it made up."""

    def order(self, waiting, prefix_len):
        if waiting:
            prefix_len(type(waiting[0])("probe", 0.0))
        return list(waiting)


class _ReadsPromptLength:
    """Relies on an attribute the policy contract does not promise."""

    def order(self, waiting, prefix_len):
        return sorted(waiting, key=lambda r: len(r.input_ids))


def test_a_policy_that_drops_a_request_fails_the_permutation_checks() -> None:
    report = run_conformance(lambda options: _Dropping())
    assert {r.name for r in report.failures} == {"permutation", "large_queue", "random_queues"}
    assert "not a permutation of its input: lost [Req#" in report.result("permutation").detail
    with pytest.raises(AssertionError, match=r"schedule policy .*<lambda> fails 3/7 conformance checks"):
        report.raise_for_failures()


def test_a_policy_that_sorts_its_input_in_place_fails_no_mutation() -> None:
    report = run_conformance(lambda options: _SortsInPlace())
    assert {r.name for r in report.failures} == {"no_mutation", "large_queue", "random_queues"}
    assert "modified its input list" in report.result("no_mutation").detail


def test_a_nondeterministic_policy_fails_deterministic() -> None:
    report = run_conformance(lambda options: _Shuffling())
    assert {r.name for r in report.failures} == {"deterministic", "large_queue", "random_queues"}


def test_a_policy_that_calls_prefix_len_on_other_requests_fails() -> None:
    report = run_conformance(lambda options: _ProbesOtherRequests())
    assert {r.name for r in report.failures} == {"prefix_len_domain", "large_queue", "random_queues"}
    assert "called prefix_len with Req#-1('probe'" in report.result("prefix_len_domain").detail


def test_a_policy_reading_attributes_outside_the_contract_fails_with_the_traceback() -> None:
    report = run_conformance(lambda options: _ReadsPromptLength(), checks=["permutation", "empty"])
    assert report.result("empty").passed
    failed = report.result("permutation")
    assert not failed.passed and "AttributeError" in failed.detail and "input_ids" in failed.error
