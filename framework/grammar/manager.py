"""Grammar compilation off the scheduler's critical path, with a cache of compiled grammars.

``GrammarManager.compile(spec)`` returns a future at once: a cache hit is an already-done future,
a miss is submitted to a small thread pool (the backends' compilers release the GIL). Requests
with the same spec share one future, so a burst of identical schemas compiles once. The scheduler
keeps a request in its grammar queue until its future is done (as SGLang does), and decodes the
others meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from framework.grammar.base import GrammarBackend, GrammarSpec

logger = logging.getLogger(__name__)


class GrammarManager:
    """The backend plus an LRU cache of compile futures (``cache_entries`` specs at most)."""

    def __init__(self, backend: GrammarBackend, compile_threads: int, cache_entries: int) -> None:
        self.backend = backend
        self.cache_entries = cache_entries
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(compile_threads, 1), thread_name_prefix="plugserve-grammar")
        self.hits = 0
        self.misses = 0

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (raises GrammarError from ``result()`` if invalid)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self.backend.compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failure(spec, f))
        return fut

    def _forget_failure(self, spec: GrammarSpec, fut: Future) -> None:
        # A failed compile is not cached: the next request gets the error again, freshly.
        if fut.exception() is not None:
            with self._lock:
                if self._cache.get(spec) is fut:
                    del self._cache[spec]

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Any:
        return self.backend.matcher(compiled, stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
