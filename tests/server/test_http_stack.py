"""``server.event_loop`` and ``server.http_parser``: values checked at config time, ``auto`` falling
back to the standard library's loop and h11 where uvloop or httptools is missing, an explicit
choice of a missing one refused with the package to install, and the loop actually used.

The served behaviour of both stacks (limits, malformed HTTP) is in test_connections.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

import pytest

from framework.config.loader import resolve_config
from framework.errors import ConfigError
from framework.server.connection import GuardedH11Protocol, protocol_class
from framework.server.http_stack import resolve_event_loop, resolve_http_parser, run


@pytest.mark.parametrize(("key", "allowed"), [("server.event_loop", "auto, uvloop, asyncio"),
                                              ("server.http_parser", "auto, httptools, h11")])
def test_an_unknown_value_is_a_config_error_naming_key_and_choices(key: str, allowed: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: invalid value 'libevent', must be one of {allowed}"):
        resolve_config(None, [f"{key}=libevent"])


def test_installed_packages_are_taken_by_auto() -> None:
    pytest.importorskip("uvloop", reason="uvloop is a dependency, but not on every platform (not Windows)")
    assert resolve_event_loop("auto") == "uvloop" and resolve_event_loop("asyncio") == "asyncio"
    assert resolve_http_parser("auto") == "httptools" and resolve_http_parser("h11") == "h11"


def test_auto_falls_back_and_an_explicit_missing_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert resolve_event_loop("auto") == "asyncio"
    assert resolve_http_parser("auto") == "h11"
    with pytest.raises(ImportError, match="pip install uvloop"):
        resolve_event_loop("uvloop")
    with pytest.raises(ImportError, match="pip install httptools"):
        resolve_http_parser("httptools")


def test_serve_refuses_a_missing_event_loop_before_binding(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from framework.server.launcher import EXIT_FAILED, serve

    monkeypatch.setitem(sys.modules, "uvloop", None)
    with socket.socket() as busy:  # a port that cannot be bound: the loop's check must come first
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = resolve_config(None, [f"model.path={tiny_model}", "server.event_loop=uvloop", f"server.port={port}"])
        with caplog.at_level(logging.ERROR):
            assert serve(cfg) == EXIT_FAILED
    assert "server.event_loop=uvloop but uvloop is not installed" in caplog.text
    assert "cannot listen" not in caplog.text


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_uses_the_loop_asked_for(loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is a dependency, but not on every platform (not Windows)")

    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(main(), loop).split(".")[0] == loop


def test_protocol_class_binds_the_limits_to_the_parser_asked_for() -> None:
    from framework.server.connection import ConnectionLimits

    limits = ConnectionLimits(max_connections=3, header_read_timeout_s=1.5)
    h11 = protocol_class(limits, "h11")
    assert issubclass(h11, GuardedH11Protocol) and h11.limits == limits
    pytest.importorskip("httptools", reason="httptools is a dependency; this checks the class built with it")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    fast = protocol_class(limits, "httptools")
    assert issubclass(fast, HttpToolsProtocol) and fast.limits == limits
