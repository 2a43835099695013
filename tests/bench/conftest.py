"""Fixtures for the benchmark tests: a tiny model and a real ``plugserve serve`` on 127.0.0.1.

The server is started with the helpers of the HTTP server tests (the real CLI as a subprocess on
a free port), so ``bench serve`` is measured against exactly what users run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from framework.testing.tiny_models import save_tiny_model
from tests.server.conftest import Server, start_server

ADMIN_KEY = "bench-admin-key"


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bench-model") / "tiny-llama")


@pytest.fixture(scope="module")
def bench_server(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No api_key (as a local benchmark server runs), an admin key so the warm-up cache is flushed."""
    overrides = [f"model.path={bench_model}", "kv_cache.max_total_tokens=4096"]
    server = start_server(tmp_path_factory.mktemp("bench-server"), overrides, admin_key=ADMIN_KEY)
    try:
        yield server
        assert server.proc.poll() is None, f"the server died during the tests:\n{server.log_text()}"
    finally:
        server.stop()
