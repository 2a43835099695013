"""plugserve's core: plugin system, config, KV memory, scheduler, engine and HTTP server.

``framework.Engine`` is imported lazily so that light commands do not pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from framework.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
