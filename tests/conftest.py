"""Shared pytest setup: markers, the plugin fixtures, and the example third-party plugin check."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from framework.plugins import PluginSet, get_plugins

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN_DIR = REPO_ROOT / "tests" / "plugins" / "plugserve-example-plugin"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (fuzz, soak)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: run with --run-slow"))


@pytest.fixture(scope="session")
def example_plugin_installed() -> None:
    """The example third-party plugin must be pip-installed (scripts/setup.sh does it)."""
    if importlib.util.find_spec("plugserve_example") is None:
        pytest.fail(
            "the example plugin is not installed: run "
            f"`pip install --no-deps -e {EXAMPLE_PLUGIN_DIR}` (scripts/setup.sh does this)"
        )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a locally trained tokenizer (shared by the server-level tests)."""
    from framework.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture
def plugins() -> PluginSet:
    return get_plugins()


@pytest.fixture
def register_plugin(plugins: PluginSet) -> Iterator:
    """Register plugin objects for one test; they are unregistered afterwards."""
    names: list[str] = []

    def register(obj: object, name: str, distribution: str | None = None) -> str:
        names.append(plugins.register(obj, name=name, distribution=distribution))
        return name

    yield register
    for name in names:
        if plugins.pm.get_plugin(name) is not None:
            plugins.unregister(name)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test, restored after: comparisons against transformers must
    not depend on how a reduction was split across threads, and one thread keeps the two cores'
    other tests (and servers) from oversubscribing. Modules use it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def engine_factory() -> Iterator:
    """``make(path, *overrides)`` builds an in-process Engine on ``path`` (the overrides after
    ``kv_cache.max_total_tokens=2048``, so they win); after the test each engine must be idle,
    with no KV leaked or left protected and every request row free."""
    from framework import Engine

    engines: list[Engine] = []

    def make(path: Path, *overrides: str) -> Engine:
        eng = Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=2048", *overrides], progress=False)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        report = eng.leak_report()
        assert report["leaked"] == 0, report
        assert report["protected"] == 0, report
        assert report["req_slots_free"] == report["req_slots_total"], report
        assert not eng.scheduler.has_work()
