"""The third-party example plugin package (tests/plugins/plugserve-example-plugin)."""

from __future__ import annotations

import pytest

from framework.config.loader import resolve_config
from framework.errors import ConfigError
from tests.foundation.fake_dists import plugins_json

MODEL = ["model.path=/nonexistent-model-dir-is-fine-for-config"]
pytestmark = pytest.mark.usefixtures("example_plugin_installed")


def test_listed_by_plugserve_plugins():
    out = plugins_json()
    row = next(p for p in out["plugins"] if p["plugin"] == "example")
    assert row["distribution"] == "plugserve-example-plugin" and row["version"] == "0.2.0"
    assert not row["builtin"] and row["error"] is None
    registered = {(r["kind"], r["name"]) for r in row["registered"]}
    assert {("memory_pool", "example_lifo"), ("attention_backend", "example_naive")} <= registered


def test_selected_by_name_with_validated_options():
    cfg = resolve_config(None, [*MODEL, "memory_pool.name=example_lifo",
                                "memory_pool.options.zero_on_free=true",
                                "attention.backend=example_naive"])
    assert cfg.memory_pool.options.zero_on_free is True
    assert cfg.attention.options.softmax_in_fp32 is True
    with pytest.raises(ConfigError, match=r"memory_pool\.options\.zero_on_fre: unknown key\. Did you mean \"zero_on_free\""):
        resolve_config(None, [*MODEL, "memory_pool.name=example_lifo", "memory_pool.options.zero_on_fre=1"])
    with pytest.raises(ConfigError, match=r"memory_pool\.options\.zero_on_free: .*"):
        resolve_config(None, [*MODEL, "memory_pool.name=example_lifo", "memory_pool.options.zero_on_free=maybe"])


def test_plugserve_plugins_env_excludes_it():
    out = plugins_json(env_extra={"PLUGSERVE_PLUGINS": ""})
    assert "example" not in {p["plugin"] for p in out["plugins"]}
    out = plugins_json(env_extra={"PLUGSERVE_PLUGINS": "example"})
    assert "example" in {p["plugin"] for p in out["plugins"]}
