"""The HTTP process's event loop (``server.event_loop``): uvloop when installed, else asyncio's.

Every token a stream sends passes the event loop a few times (the scheduler's message, the
response chunk, the socket write), on a host whose cores the model's threads also want. uvloop
runs that loop in C (libuv): on the 2-core test host the served TTFT at one stream dropped by ~1
ms with it and with httptools (docs/benchmarks.md), which is why ``uvicorn[standard]``, vLLM and
SGLang serve on it. Nothing in plugserve needs it: ``asyncio`` behaves the same, slower.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""The values of ``server.event_loop``."""


def resolve_event_loop(name: str) -> str:
    """``server.event_loop`` as the loop that will run: ``auto`` is uvloop when it imports, else
    asyncio. Raises ValueError for an unknown name, ImportError when uvloop is asked for and missing."""
    if name not in EVENT_LOOPS:
        raise ValueError(f"server.event_loop: {name!r}, must be one of {', '.join(EVENT_LOOPS)}")
    if name == "asyncio":
        return name
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if name == "uvloop":
            raise ImportError("server.event_loop=uvloop but uvloop is not installed "
                              "(pip install uvloop, or set server.event_loop to auto or asyncio)") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``main`` to completion on a new event loop of kind ``loop`` (as :func:`resolve_event_loop`
    gives it), like :func:`asyncio.run`."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
