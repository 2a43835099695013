"""The token/page allocator: the second level of KV memory, over the per-layer K/V buffers.

KV slots are indices into every layer's K and V buffers (``framework.memory.kv_cache``). Slots come
in pages of ``page_size`` consecutive slots, page ``p`` covering ``[p * page_size, (p + 1) *
page_size)``. Page 0 is the padding target and is never handed out: usable pages are
``1 .. num_pages``. The allocator hands out whole pages; a request fills its last page token by
token (``alloc_extend`` / ``alloc_decode`` continue a partially used page before taking new ones).

Bookkeeping lives on the host whatever ``device`` is: the scheduler passes Python lists, so one
host-to-device copy of the result per call is cheaper than keeping the free list on the GPU and
syncing to learn its length. The free list is a ring buffer of page ids (a tensor), so taking or
returning ``k`` pages is two slice copies at most: no per-page Python work and no copy of the
whole free list per call. Pages come back out in the order they were freed, so a given sequence
of calls always hands out the same pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IntSeq = Sequence[int] | torch.Tensor


def _as_host_long(values: IntSeq) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device="cpu")


class PagedKVAllocator:
    """Hands out KV pages ``1 .. num_pages`` of ``page_size`` slots each; returns slot tensors.

    Every allocation either succeeds completely or returns ``None`` with nothing taken, so the
    caller can evict from the prefix cache and retry. ``free`` is guarded always (reserved page
    0, out-of-range and double frees raise ``ValueError``; a few O(n) tensor ops per call);
    ``debug=True`` adds a full O(num_pages) consistency check after every call and checks that
    ``last_locs`` agree with ``prefix_lens``.
    """

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu", debug: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.debug = debug
        self.clear()

    # ----------------------------------------------------------------------------- sizes
    def num_free_pages(self) -> int:
        return self._num_free

    def available_size(self) -> int:
        """Free tokens: free pages times ``page_size`` (room left in used pages does not count)."""
        return self._num_free * self.page_size

    def total_size(self) -> int:
        """Usable tokens: ``num_pages * page_size`` (the reserved page 0 is not counted)."""
        return self.num_pages * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """A copy of the free pages, in the order they will be handed out (for tests and debugging)."""
        idx = (self._head + torch.arange(self._num_free)) % self.num_pages
        return self._ring[idx]

    # ------------------------------------------------------------------------ allocation
    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Take ``n`` whole pages; returns their page ids (int64, on ``device``) or ``None``."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        pages = self._take(n)
        if pages is None:
            return None
        self._debug_check()
        return pages.to(self.device)

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_locs: IntSeq) -> torch.Tensor | None:
        """Slots for tokens ``[prefix_lens[i], seq_lens[i])`` of each request, concatenated.

        ``last_locs[i]`` is the slot of request ``i``'s token ``prefix_lens[i] - 1`` (``-1`` when
        the prefix is empty). The rest of that token's page is used first (slots
        ``last_loc + 1, ...``), then whole new pages. Returns ``sum(seq - prefix)`` slots in
        request order, or ``None`` (nothing taken) if there are not enough free pages.
        """
        ps = self.page_size
        prefix, seq, last = _as_host_long(prefix_lens), _as_host_long(seq_lens), _as_host_long(last_locs)
        extend = seq - prefix
        if bool((extend < 0).any()):
            raise ValueError(f"seq_lens {seq.tolist()} shorter than prefix_lens {prefix.tolist()}")
        if self.debug:
            self._check_last_locs(prefix, last)
        total_tokens = int(extend.sum())
        if ps == 1:
            # Every token is its own page: nothing to continue, just take slots.
            slots = self._take(total_tokens)
            if slots is None:
                return None
            self._debug_check()
            return slots.to(self.device)

        # Pages request i needs: those covering [0, seq) minus those already covering [0, prefix).
        prefix_pages = (prefix + ps - 1) // ps
        new_pages_per_req = (seq + ps - 1) // ps - prefix_pages
        new_pages = self._take(int(new_pages_per_req.sum()))
        if new_pages is None:
            return None
        if total_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)

        # One output element per new token, built without a per-token (or per-request) loop:
        # per-request offsets first, then one gather of each by the token's request index.
        req = torch.repeat_interleave(extend, output_size=total_tokens)
        rank = torch.arange(total_tokens) - (torch.cumsum(extend, 0) - extend)[req]  # 0.. within request
        slots = (last + 1)[req] + rank  # continuing the partially used last page
        if new_pages.numel():
            room = (prefix_pages * ps - prefix)[req]  # tokens that still fit in that page
            in_new = rank >= room
            page_starts = torch.cumsum(new_pages_per_req, 0) - new_pages_per_req
            offset = (rank - room)[in_new]  # position counted from the first new page
            page_idx = page_starts[req[in_new]] + offset // ps
            slots[in_new] = new_pages[page_idx] * ps + offset % ps
        self._debug_check()
        return slots.to(self.device)

    def alloc_decode(self, seq_lens: IntSeq, last_locs: IntSeq) -> torch.Tensor | None:
        """One slot per request for its token at position ``seq_lens[i] - 1`` (the decode step).

        Same result as ``alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)``, cheaper:
        a request needs a new page only when that position starts one. With one token per
        request, a pass over plain ints beats a dozen tiny tensor ops (each costs microseconds
        of dispatch), so this path stays in Python lists until the single output tensor.
        """
        if self.page_size == 1:
            slots = self._take(len(seq_lens))
            if slots is None:
                return None
            self._debug_check()
            return slots.to(self.device)
        ps = self.page_size
        seq = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens
        last = last_locs.tolist() if isinstance(last_locs, torch.Tensor) else last_locs
        if self.debug:
            self._check_last_locs(_as_host_long(seq) - 1, _as_host_long(last))
        starts_page = [i for i, n in enumerate(seq) if (n - 1) % ps == 0]
        pages = self._take(len(starts_page))
        if pages is None:
            return None
        slots = [loc + 1 for loc in last]
        for i, page in zip(starts_page, pages.tolist(), strict=True):
            slots[i] = page * ps
        self._debug_check()
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------------------ free
    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that ``slots`` belong to (each page once, however many of its slots).

        Freeing a page frees all of its slots, so pass only slots whose pages the caller owns
        outright. Raises ``ValueError`` (and frees nothing) for page 0, an out-of-range slot or a
        page that is already free. Slots on a GPU are copied to the host first (a sync).
        """
        if slots.numel() == 0:
            return
        pages = slots.detach().to("cpu", torch.int64).flatten() // self.page_size
        if int(pages.min()) < 1 or int(pages.max()) > self.num_pages:
            raise ValueError(
                f"freeing slots outside usable pages 1..{self.num_pages} (page 0 is reserved): "
                f"pages {pages[(pages < 1) | (pages > self.num_pages)].tolist()[:8]}"
            )
        pages = self._unique_pages(pages)
        already_free = self._page_free[pages]
        if bool(already_free.any()):
            raise ValueError(f"double free of KV pages {pages[already_free].tolist()[:8]}")
        self._put(pages)
        self._debug_check()

    def clear(self) -> None:
        """Free every page; the hand-out order starts again at page 1."""
        self._ring = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._head = 0  # ring position of the next page to hand out
        self._num_free = self.num_pages
        # The double-free guard: one flag per page id, page 0 never free (never allocatable).
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_free[0] = False
        self._counts = torch.zeros(self.num_pages + 1, dtype=torch.int32)  # scratch, kept all zero
        # numpy views of the same memory, for _take (see there).
        self._ring_np = self._ring.numpy()
        self._page_free_np = self._page_free.numpy()

    # --------------------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Full O(num_pages) consistency check; raises ``AssertionError`` on corruption."""
        free = self.free_page_ids()
        assert free.numel() == self._num_free == int(self._page_free.sum()), "free count mismatch"
        assert torch.unique(free).numel() == free.numel(), "a page is in the free list twice"
        assert bool(self._page_free[free].all()), "free list and free flags disagree"
        assert not bool(self._page_free[0]), "reserved page 0 is marked free"

    # -------------------------------------------------------------------------- internal
    def _take(self, n: int) -> torch.Tensor | None:
        """Pop ``n`` page ids from the ring (host tensor), or ``None`` with nothing taken.

        Through numpy views of the ring and the flags: a decode step takes its slots right after a
        forward has evicted torch's dispatcher from the caches, where each small torch op costs
        20-30 us (slice, clone and index_put here took ~75 us of a ~8 ms step); numpy's calls are
        shorter paths.
        """
        if n > self._num_free:
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        start, end = self._head, self._head + n
        if end <= self.num_pages:
            # copy: this ring range is overwritten by later frees.
            pages = self._ring_np[start:end].copy()
        else:
            pages = np.concatenate([self._ring_np[start:], self._ring_np[: end - self.num_pages]])
        self._head = end % self.num_pages
        self._num_free -= n
        self._page_free_np[pages] = False
        return torch.from_numpy(pages)

    def _put(self, pages: torch.Tensor) -> None:
        """Push page ids (host tensor, unique, all in use) to the tail of the ring."""
        k = pages.numel()
        tail = (self._head + self._num_free) % self.num_pages
        first = min(k, self.num_pages - tail)
        self._ring[tail : tail + first] = pages[:first]
        self._ring[: k - first] = pages[first:]
        self._num_free += k
        self._page_free[pages] = True

    def _unique_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Each page id once, in first-seen order, in O(n) for the usual input (no sort).

        Slots usually come in position order, so a page's slots are adjacent and
        ``unique_consecutive`` drops the repeats. Any repeat left is counted in a zeroed scratch
        array (integer adds: deterministic); only then does it fall back to a sort.
        """
        pages = torch.unique_consecutive(pages)
        self._counts.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))
        repeated = bool((self._counts[pages] > 1).any())
        self._counts[pages] = 0
        return torch.unique(pages) if repeated else pages

    def _check_last_locs(self, prefix: torch.Tensor, last: torch.Tensor) -> None:
        """Debug: ``last_locs`` must be -1 for empty prefixes and an in-use slot of the right offset."""
        ps = self.page_size
        empty = prefix == 0
        if bool((last[empty] != -1).any()):
            raise ValueError("last_locs must be -1 where prefix_lens is 0")
        p, loc = prefix[~empty], last[~empty]
        if bool((loc % ps != (p - 1) % ps).any()) or bool((loc < ps).any()):
            raise ValueError(f"last_locs {loc.tolist()} do not match prefix_lens {p.tolist()}")
        if bool((loc // ps > self.num_pages).any()) or bool(self._page_free[loc // ps].any()):
            raise ValueError(f"last_locs {loc.tolist()} lie in pages that are not allocated")

    def _debug_check(self) -> None:
        if self.debug:
            self.check_invariants()
