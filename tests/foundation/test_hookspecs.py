"""Every hookspec is documented: a docstring here and a section in docs/plugins.md."""

from __future__ import annotations

import inspect

from framework import hookspecs
from tests.foundation.fake_dists import REPO_ROOT


def _specs():
    return [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, f"{hookspecs.PROJECT_NAME}_spec")
    ]


def test_there_are_hookspecs():
    names = {name for name, _ in _specs()}
    assert {"register_attention_backends", "register_memory_pools", "register_transfer_backends",
            "register_models", "register_schedule_policies", "on_batch_scheduled",
            "on_request_finished", "extend_http_routes", "register_grammar_backends", "register_tool_parsers",
            "register_reasoning_parsers"} <= names


def test_every_hookspec_has_a_docstring():
    missing = [name for name, fn in _specs() if not (fn.__doc__ or "").strip()]
    assert missing == []


def test_every_hookspec_is_in_plugins_doc():
    doc = (REPO_ROOT / "docs" / "plugins.md").read_text()
    missing = [name for name, _ in _specs() if f"`{name}`" not in doc]
    assert missing == [], f"hookspecs missing from docs/plugins.md: {missing}"
