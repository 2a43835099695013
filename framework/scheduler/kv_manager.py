"""KVManager: the glue between requests, the request pool, the page allocator and the prefix cache.

Ownership follows ``framework.memory.radix_cache``: a KV slot belongs to the allocator (free), the
prefix cache, or exactly one request. A request's first ``prefix_len`` slots are the cache's
(locked through ``req.last_node`` while it runs); the rest are its own until it is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from framework.memory.kv_allocator import PagedKVAllocator
from framework.memory.no_prefix_cache import NoPrefixCache
from framework.memory.radix_cache import MatchResult, RadixCache
from framework.memory.request_pool import RequestPool
from framework.scheduler.request import Req


class KVManager:
    """Allocates and releases the KV memory of requests."""

    def __init__(
        self, req_pool: RequestPool, allocator: PagedKVAllocator, radix_enabled: bool
    ) -> None:
        self.req_pool = req_pool
        self.allocator = allocator
        self.page_size = allocator.page_size
        cache_cls = RadixCache if radix_enabled else NoPrefixCache
        self.cache: RadixCache | NoPrefixCache = cache_cls(allocator, allocator.page_size)
        self.req_to_token = req_pool.req_to_token
        self._device = self.req_to_token.device
        self._numpy_table = self._device.type == "cpu" and type(req_pool).write is RequestPool.write
        """Decode steps write ``req_to_token`` through a numpy view (:meth:`_write_decode_slots`):
        the table is on the host and the pool's ``write`` is the plain assignment."""

    # -- accounting ------------------------------------------------------------------------

    def total_tokens(self) -> int:
        return self.allocator.total_size()

    def available_tokens(self) -> int:
        """Tokens that can be allocated now, evicting unlocked cache entries if needed."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def used_tokens(self) -> int:
        return self.total_tokens() - self.available_tokens()

    def leak_report(self, held_by_requests: int = 0) -> dict[str, int]:
        """free + evictable + protected + held == total must hold; when idle, held is 0."""
        report = {
            "total": self.total_tokens(),
            "free": self.allocator.available_size(),
            "evictable": self.cache.evictable_size(),
            "protected": self.cache.protected_size(),
            "held_by_requests": held_by_requests,
            "req_slots_total": self.req_pool.num_rows,
            "req_slots_free": self.req_pool.available_size(),
        }
        report["leaked"] = report["total"] - (
            report["free"] + report["evictable"] + report["protected"] + held_by_requests
        )
        return report

    # -- prefix matching and admission -----------------------------------------------------

    def match(self, req: Req) -> MatchResult:
        """Longest cached prefix the request may reuse (not locked yet)."""
        return self.cache.match_prefix(req.fill_ids[: req.max_cacheable_prefix()])

    def admit(self, req: Req, match: MatchResult) -> bool:
        """Give the request a pool row holding its cached prefix; lock the prefix. False if no row."""
        rows = self.req_pool.alloc(1)
        if rows is None:
            return False
        req.req_pool_idx = rows[0]
        n = match.prefix_len
        if n:
            self.req_pool.write((req.req_pool_idx, slice(0, n)), match.indices.to(torch.int32))
        self.cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.prefix_len = req.kv_len = n
        req.cached_tokens = max(req.cached_tokens, min(n, len(req.input_ids)))
        return True

    # -- allocation --------------------------------------------------------------------------

    def _last_locs(self, reqs: Sequence[Req]) -> list[int]:
        if self.page_size == 1:
            return [-1] * len(reqs)  # every token takes a fresh page: the allocator ignores them
        return [
            int(self.req_to_token[r.req_pool_idx, r.kv_len - 1]) if r.kv_len > 0 else -1 for r in reqs
        ]

    def _ensure_free(self, tokens: int) -> bool:
        short = tokens - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.available_size() >= tokens

    def alloc_extend(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """Slots for each request's next ``extend_len`` tokens; written into ``req_to_token``."""
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + r.extend_len for r in reqs]
        if not self._ensure_free(self.extend_tokens_needed(reqs)):
            return None
        slots = self.allocator.alloc_extend(prefix, seq, self._last_locs(reqs))
        if slots is None:
            return None
        self._write(reqs, prefix, [r.extend_len for r in reqs], slots)
        return slots

    def extend_tokens_needed(self, reqs: Sequence[Req]) -> int:
        """Free KV (whole new pages) that extending each request by ``extend_len`` takes."""
        page = self.page_size
        pages = sum(-(-(r.kv_len + r.extend_len) // page) - -(-r.kv_len // page) for r in reqs)
        return pages * page

    def decode_tokens_needed(self, reqs: Sequence[Req]) -> int:
        """Tokens of free KV one decode step of these requests needs (new pages only)."""
        if self.page_size == 1:
            return len(reqs)
        return self.page_size * sum(1 for r in reqs if r.kv_len % self.page_size == 0)

    def alloc_decode(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """One slot per request for its token at position ``kv_len``."""
        if not self._ensure_free(self.decode_tokens_needed(reqs)):
            return None
        slots = self.allocator.alloc_decode([r.kv_len + 1 for r in reqs], self._last_locs(reqs))
        if slots is None:
            return None
        self._write_decode_slots(reqs, slots)
        return slots

    def _write_decode_slots(self, reqs: Sequence[Req], slots: torch.Tensor) -> None:
        """``req_to_token[row, kv_len] = slot`` for each request.

        Why numpy on the host: right after a forward has streamed the weights through the caches,
        each small torch op costs 20-30 us (the dispatcher's code and data were evicted) against
        ~2 when hot, and the four ops of a torch write (two index tensors, a cast, an index_put)
        took ~90 us of a ~8 ms batch-1 decode step (llama-120m bf16, Sapphire Rapids host). One
        numpy assignment into a view of the same memory does it in one call. The view is taken
        per call (one C call), so it can never outlive the tensor's storage.
        """
        if self._numpy_table:
            table = self.req_to_token.numpy()
            table[[r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]] = slots.numpy()
            return
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self._device)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=self._device)
        self.req_pool.write((rows, cols), slots.to(torch.int32))

    def _write(self, reqs: Sequence[Req], starts: list[int], lens: list[int], slots: torch.Tensor) -> None:
        total = sum(lens)
        if total == 0:
            return
        lens_t = torch.tensor(lens, dtype=torch.int64)
        rows = torch.repeat_interleave(
            torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64), lens_t, output_size=total
        )
        offsets = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(total) - torch.repeat_interleave(
            offsets - torch.tensor(starts, dtype=torch.int64), lens_t, output_size=total
        )
        self.req_pool.write((rows.to(self._device), cols.to(self._device)), slots.to(torch.int32))

    # -- release -----------------------------------------------------------------------------

    def release(self, req: Req) -> None:
        """Hand the request's computed KV to the prefix cache (or free it) and free its row."""
        if req.req_pool_idx is None:
            return
        kv = req.kv_indices(self.req_to_token)
        self.cache.cache_finished_request(req.fill_ids[: req.kv_len], kv, req.prefix_len, req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.prefix_len = 0

    def reserve(self, req: Req) -> torch.Tensor | None:
        """A row and KV pages for the request's whole prompt, with nothing from the prefix cache:
        its KV will be written from elsewhere (PD decode: by the transfer). Returns the slots;
        None, with nothing held, if no row or KV is free."""
        if not self.admit(req, self.cache.match_prefix([])):
            return None
        req.extend_len = len(req.input_ids)
        slots = self.alloc_extend([req])
        req.extend_len = 0
        if slots is None:
            self.release(req)
            return None
        req.kv_len = len(req.input_ids)
        return slots

    def discard(self, row: int, indices: torch.Tensor, last_node: Any) -> None:
        """Free a reservation whose pages hold no valid KV (a failed transfer): the pages go back
        to the allocator, never to the prefix cache; the prefix lock and the row are released."""
        self.allocator.free(indices)
        self.cache.dec_lock_ref(last_node)
        self.req_pool.free(row)

    def cache_prefix(self, req: Req) -> None:
        """Put a running request's computed KV (whole pages) into the prefix cache now, so that
        requests arriving while it still runs share its prompt (SGLang's cache_unfinished_req).
        The request keeps the pages past the cached part; its row now points at the tree's slots."""
        if not isinstance(self.cache, RadixCache) or req.kv_len - req.prefix_len < self.page_size:
            return
        kv = req.kv_indices(self.req_to_token)
        result = self.cache.cache_unfinished_request(req.fill_ids[: req.kv_len], kv, req.prefix_len, req.last_node)
        n = result.prefix_len
        self.req_pool.write((req.req_pool_idx, slice(0, n)), result.indices.to(torch.int32))
        req.prefix_len = n
        req.last_node = result.last_node

    def held_by(self, reqs: Sequence[Req]) -> int:
        """Tokens of pages that running requests own outright (beyond their cached prefix)."""
        held = 0
        for r in reqs:
            if r.req_pool_idx is None:
                continue
            own = r.kv_len - r.prefix_len
            # Own slots start on a fresh page (prefixes are page-aligned): count whole pages.
            held += -(-own // self.page_size) * self.page_size
        return held

    def flush(self) -> bool:
        """Drop every cached prefix (only when no request holds KV). False if busy."""
        if self.cache.protected_size() > 0:
            return False
        self.cache.reset()
        return True
