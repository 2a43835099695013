"""The fuzzing server, shared by the schemathesis and the hostile-body fuzzers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import Server, start_server

API_KEY = "fuzz-key"


@pytest.fixture(scope="package")
def fuzz_server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    # A short context bounds how long any generated request can run; an admin key lets the
    # fuzzers reach /flush_cache and /abort_request past authentication.
    srv = start_server(tmp_path_factory.mktemp("fuzz"), [
        f"model.path={tiny_model}", "kv_cache.max_total_tokens=2048", "model.context_length=64",
        "scheduler.max_queued_requests=64", "server.max_body_bytes=262144",
    ], admin_key=API_KEY)
    yield srv
    srv.stop()
