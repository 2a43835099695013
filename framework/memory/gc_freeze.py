"""Keep the objects a server process made at startup out of Python's garbage collector.

A plugserve process holds a few hundred thousand long-lived Python objects once torch,
transformers and the model are loaded (~330k in the HTTP process on the Sapphire Rapids host), and
CPython's full (generation 2) collection walks all of them: 124 ms there, measured, and 98-147 ms
per full collection logged from a server's processes (those came at startup and at shutdown in the
logged run). Such a collection comes whenever enough objects
have survived into the oldest generation (a quarter of it), which requests that live for seconds
do: then every stream of the HTTP process, or the whole decode loop of a scheduler, stops for that
long. :func:`freeze_startup_objects` collects once and moves everything alive into the permanent
generation (``gc.freeze``), after which a full collection walks only what serving made (0.01 ms
right after). vLLM freezes its engine's heap after startup for the same reason.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects(process: str) -> int:
    """Collect garbage once, then freeze every object alive (they are never collected, nor walked,
    again). Call it when a process has finished starting and before it serves. Returns how many
    objects are frozen now."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d startup objects frozen out of the garbage collector", process, frozen)
    return frozen
