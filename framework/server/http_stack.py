"""The HTTP process's event loop and HTTP protocol (``server.event_loop``, ``server.http_parser``):
uvloop and httptools when installed, else asyncio's own loop and h11.

Every token a stream sends passes the event loop a few times (the scheduler's message, the
response chunk, the socket write), on a host whose cores the model's threads also want. uvloop
runs that loop in C (libuv): on the 2-core test host the median served TTFT at one stream dropped
by 0.4-2.9 ms with it and httptools (docs/benchmarks.md), which is why ``uvicorn[standard]``, vLLM and
SGLang serve on it. Nothing in plugserve needs them: ``asyncio`` and h11 behave the same, slower
(the connection guards of :mod:`framework.server.connection` sit on either protocol).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from framework.config.schema import EVENT_LOOPS, HTTP_PARSERS

T = TypeVar("T")


def _resolve(key: str, value: str, choices: tuple[str, ...], fallback: str) -> str:
    """``value`` of config ``key`` as what will run: ``auto`` is ``choices[1]`` (an optional
    package of that name) when it imports, else ``fallback``. Raises ValueError for an unknown
    value, ImportError when the package is asked for by name and missing."""
    if value not in choices:
        raise ValueError(f"{key}: {value!r}, must be one of {', '.join(choices)}")
    package = choices[1]
    if value == fallback:
        return value
    try:
        __import__(package)
    except ImportError:
        if value == package:
            raise ImportError(f"{key}={package} but {package} is not installed (pip install {package}, "
                              f"or set {key} to auto or {fallback})") from None
        return fallback
    return package


def resolve_event_loop(name: str) -> str:
    """``server.event_loop`` as the loop that will run: ``auto`` is uvloop when it imports, else asyncio."""
    return _resolve("server.event_loop", name, EVENT_LOOPS, "asyncio")


def resolve_http_parser(name: str) -> str:
    """``server.http_parser`` as the protocol that will run: ``auto`` is httptools when it
    imports, else h11."""
    return _resolve("server.http_parser", name, HTTP_PARSERS, "h11")


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``main`` to completion on a new event loop of kind ``loop`` (as :func:`resolve_event_loop`
    gives it), like :func:`asyncio.run`."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
