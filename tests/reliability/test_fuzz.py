"""Fuzz every route of /openapi.json with schemathesis-generated requests: no 5xx, the server
alive afterwards, no KV leaked.

The bounded run (the default) draws ``PLUGSERVE_FUZZ_EXAMPLES`` (15) examples per operation, about
two minutes here; ``--run-slow`` draws 200 per operation.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import Server, assert_no_leak

FUZZ_EXAMPLES = int(os.environ.get("PLUGSERVE_FUZZ_EXAMPLES", "15"))
LONG_FUZZ_EXAMPLES = 200


def operations(server: Server) -> list:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.timeout(900)
def test_no_route_answers_5xx(fuzz_server: Server, request: pytest.FixtureRequest) -> None:
    examples = LONG_FUZZ_EXAMPLES if request.config.getoption("--run-slow") else FUZZ_EXAMPLES
    ops = operations(fuzz_server)
    assert {op.path for op in ops} >= {"/generate", "/v1/completions", "/v1/chat/completions"}
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for op in ops:

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def fuzz(case) -> None:
            response = case.call(base_url=fuzz_server.url, timeout=60)
            statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code}: "
                                f"{response.text[:300]}")

        fuzz()
    assert failures == []
    # The fuzzer really reached the inference routes, with valid and invalid bodies.
    for route in ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        codes = statuses.get(route, set())
        assert any(c < 300 for c in codes) or any(400 <= c < 500 for c in codes), (route, codes)
    assert any(400 <= c < 500 for codes in statuses.values() for c in codes), statuses
    assert httpx.get(f"{fuzz_server.url}/health", timeout=30).status_code == 200, "the server died"
    assert_no_leak(fuzz_server)
