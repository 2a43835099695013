"""The plugin system: entry points, built-ins, registration checks, failure reporting."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from framework.errors import ConfigError, PluginError
from framework.hookspecs import hookimpl
from tests.foundation.fake_dists import POOL_PLUGIN, REPO_ROOT, make_dist, plugins_json

BUILTINS = {
    "attention_backend": {"torch_native", "cpu_paged"},
    "memory_pool": {"standard", "decode_prealloc"},
    "model": {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"},
    "schedule_policy": {"fcfs", "lpm"},
}


def test_builtins_come_through_entry_points(plugins):
    for kind, names in BUILTINS.items():
        for name in names:
            comp = plugins.registry.get(kind, name)
            assert comp.distribution == "plugserve", (kind, name)
            assert plugins.infos[comp.plugin].builtin


def test_core_never_imports_builtin_plugins_by_name():
    offenders = []
    for path in (REPO_ROOT / "framework").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "plugins":
                offenders.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Import):
                offenders += [f"{path}:{node.lineno}" for a in node.names if a.name.split(".")[0] == "plugins"]
    assert offenders == []


def test_registered_object_adds_components_and_unregisters(plugins, register_plugin):
    @dataclasses.dataclass
    class Opts:
        width: int = 3

    class MyPlugin:
        @hookimpl
        def register_schedule_policies(self, register):
            register("my_policy", lambda options=None: None, config=Opts)

    assert not plugins.registry.has("schedule_policy", "my_policy")
    register_plugin(MyPlugin(), "my-plugin")
    comp = plugins.registry.get("schedule_policy", "my_policy")
    assert comp.plugin == "my-plugin" and comp.options_cls is Opts
    plugins.unregister("my-plugin")
    assert not plugins.registry.has("schedule_policy", "my_policy")


def test_misspelt_hookimpl_fails_loudly_with_suggestion(plugins):
    class Typo:
        @hookimpl
        def register_memory_pool(self, register):  # missing "s"
            pass

    with pytest.raises(PluginError, match=r"register_memory_pool.*Did you mean \"register_memory_pools\""):
        plugins.register(Typo(), name="typo")
    assert plugins.pm.get_plugin("typo") is None


def test_duplicate_name_names_both_distributions(plugins, register_plugin):
    class Dup:
        @hookimpl
        def register_memory_pools(self, register):
            register("standard", lambda *a, **k: None)

    register_plugin(Dup(), "dup", distribution="dup-dist")
    with pytest.raises(PluginError) as err:
        _ = plugins.registry
    assert "plugserve" in str(err.value) and "dup-dist" in str(err.value)


def test_options_must_be_a_dataclass(plugins, register_plugin):
    class Bad:
        @hookimpl
        def register_schedule_policies(self, register):
            register("bad", lambda options=None: None, config=dict)

    register_plugin(Bad(), "bad")
    with pytest.raises(PluginError, match="not a dataclass"):
        _ = plugins.registry


def test_unknown_name_lists_installed(plugins):
    with pytest.raises(ConfigError, match=r"Did you mean \"lpm\".*Installed: fcfs, lpm"):
        plugins.registry.get("schedule_policy", "lpn", key="scheduler.policy")


def test_broken_import_is_reported_and_cli_runs(tmp_path: Path):
    make_dist(tmp_path, "broken-dist", "broken_mod", "raise RuntimeError('boom at import')\n")
    out = plugins_json(tmp_path)
    assert out["returncode"] == 0, out["stderr"]
    row = next(p for p in out["plugins"] if p["plugin"] == "broken_mod")
    assert row["distribution"] == "broken-dist"
    assert "RuntimeError: boom at import" in row["error"]
    # the built-ins are still listed and registered
    assert any(r["name"] == "standard" for p in out["plugins"] for r in p["registered"])


def test_misspelt_hookimpl_in_entry_point_is_reported(tmp_path: Path):
    src = "from framework.hookspecs import hookimpl\n@hookimpl\ndef register_modles(register):\n    pass\n"
    make_dist(tmp_path, "typo-dist", "typo_mod", src)
    out = plugins_json(tmp_path)
    row = next(p for p in out["plugins"] if p["plugin"] == "typo_mod")
    assert "register_modles" in row["error"] and "register_models" in row["error"]


def test_duplicate_across_distributions_in_cli(tmp_path: Path):
    make_dist(tmp_path, "first-dist", "first_mod", POOL_PLUGIN.format(name="shared_pool"))
    make_dist(tmp_path, "second-dist", "second_mod", POOL_PLUGIN.format(name="shared_pool"))
    out = plugins_json(tmp_path)
    assert out["returncode"] == 1
    assert "first-dist" in out["registry_error"] and "second-dist" in out["registry_error"]


def test_plugserve_plugins_env_restricts_third_party(tmp_path: Path):
    make_dist(tmp_path, "extra-dist", "extra_mod", POOL_PLUGIN.format(name="extra_pool"))
    listed = {p["plugin"] for p in plugins_json(tmp_path)["plugins"]}
    assert "extra_mod" in listed
    none = plugins_json(tmp_path, {"PLUGSERVE_PLUGINS": ""})
    assert "extra_mod" not in {p["plugin"] for p in none["plugins"]}
    assert any(p["builtin"] for p in none["plugins"])  # built-ins always load
    only = plugins_json(tmp_path, {"PLUGSERVE_PLUGINS": "extra-dist"})
    assert "extra_mod" in {p["plugin"] for p in only["plugins"]}
