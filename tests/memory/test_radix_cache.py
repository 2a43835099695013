"""RadixCache and NoPrefixCache: matching, page-aligned splits, ownership, locks, LRU eviction."""

from __future__ import annotations

import pytest
import torch

from framework.memory.kv_allocator import PagedKVAllocator
from framework.memory.no_prefix_cache import NoPrefixCache
from framework.memory.radix_cache import RadixCache, TreeNode


def make(page_size: int, num_pages: int = 64) -> tuple[PagedKVAllocator, RadixCache]:
    alloc = PagedKVAllocator(num_pages, page_size, debug=True)
    return alloc, RadixCache(alloc, page_size)


def fresh(alloc: PagedKVAllocator, n: int) -> torch.Tensor:
    slots = alloc.alloc_extend([0], [n], [-1])
    assert slots is not None
    return slots


def put(alloc: PagedKVAllocator, cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Insert freshly allocated KV for ``tokens`` and free what the tree did not take."""
    slots = fresh(alloc, len(tokens))
    dup = cache.insert(tokens, slots)
    aligned = len(tokens) - len(tokens) % cache.page_size
    alloc.free(torch.cat([slots[:dup], slots[aligned:]]))
    return slots


def node_sizes(cache: RadixCache) -> tuple[int, int, list[int]]:
    """Brute force: (evictable, protected, every node's key length)."""
    evictable = protected = 0
    lengths, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        lengths.append(len(node.key))
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    return evictable, protected, lengths


def check_accounting(alloc: PagedKVAllocator, cache: RadixCache, held_outside: int = 0) -> None:
    evictable, protected, lengths = node_sizes(cache)
    assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)
    assert all(n > 0 and n % cache.page_size == 0 for n in lengths)
    assert cache.total_cached_tokens() == evictable + protected
    total = alloc.available_size() + evictable + protected + held_outside
    assert total == alloc.total_size()


@pytest.mark.parametrize("ps", [1, 4])
def test_match_insert_and_split_at_page_boundaries(ps: int) -> None:
    alloc, cache = make(ps)
    empty = cache.match_prefix([1, 2, 3])
    assert empty.prefix_len == 0 and empty.last_node is cache.root
    a = list(range(4 * ps - 1))  # three whole pages, and a partial one when ps > 1
    slots = put(alloc, cache, a)
    assert cache.total_cached_tokens() == 3 * ps, "the trailing partial page is never cached"
    m = cache.match_prefix(a + [99])
    assert m.indices.tolist() == slots[: 3 * ps].tolist()
    assert m.indices.dtype == torch.int64
    # Diverge in the middle of the second page: only the first page matches; the node splits there.
    b = a[:ps] + a[ps : 2 * ps - 1] + [77] if ps > 1 else a[:1] + [77]
    m = cache.match_prefix(b)
    assert m.indices.tolist() == slots[:ps].tolist()
    assert m.last_node.key == a[:ps] and m.last_node.parent is cache.root
    assert [len(c.key) for c in m.last_node.children.values()] == [2 * ps]
    check_accounting(alloc, cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_returns_duplicate_length_and_keeps_old_slots(ps: int) -> None:
    alloc, cache = make(ps)
    a = [5] * ps + [6] * ps + [7] * ps
    slots_a = put(alloc, cache, a)
    b = [5] * ps + [6] * ps + [8] * (2 * ps) + [9] * (ps - 1)  # two shared pages, two new, a partial
    slots_b = fresh(alloc, len(b))
    dup = cache.insert(b, slots_b)
    assert dup == 2 * ps
    # The tree keeps a's slots for the shared part and takes b's slots only for the new pages.
    assert cache.match_prefix(b).indices.tolist() == slots_a[: 2 * ps].tolist() + slots_b[2 * ps : 4 * ps].tolist()
    alloc.free(torch.cat([slots_b[:dup], slots_b[4 * ps :]]))
    again = fresh(alloc, len(b))
    assert cache.insert(b, again) == 4 * ps  # everything already there
    alloc.free(again)
    check_accounting(alloc, cache)
    # A mid-page divergence shares only the whole pages before it.
    if ps > 1:
        c = [5] * (ps - 1) + [1] + [2] * ps
        s = fresh(alloc, len(c))
        assert cache.insert(c, s) == 0
        alloc.free(s[len(c) - len(c) % ps :])
        check_accounting(alloc, cache)


def test_insert_copies_indices() -> None:
    """The tree must not alias the caller's tensor (often a view of req_to_token, reused later)."""
    alloc, cache = make(1)
    row = torch.zeros(8, dtype=torch.int64)
    row[:4] = fresh(alloc, 4)
    expected = row[:4].tolist()
    cache.insert([1, 2, 3, 4], row[:4])
    row[:] = 0
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == expected


@pytest.mark.parametrize("ps", [1, 4])
def test_lock_refs_protect_from_eviction(ps: int) -> None:
    alloc, cache = make(ps)
    a, b = [1] * (2 * ps), [1] * ps + [2] * ps
    put(alloc, cache, a)
    put(alloc, cache, b)
    m = cache.match_prefix(a)
    assert cache.inc_lock_ref(m.last_node) == 2 * ps
    assert cache.inc_lock_ref(m.last_node) == 0  # already protected
    assert (cache.evictable_size(), cache.protected_size()) == (ps, 2 * ps)
    check_accounting(alloc, cache)
    d = [7] * (2 * ps)
    put(alloc, cache, d)
    md = cache.match_prefix(d)
    cache.inc_lock_ref(md.last_node)
    cache.match_prefix([7] * ps + [9] * ps)  # splits the locked node: both halves stay locked
    assert (cache.evictable_size(), cache.protected_size()) == (ps, 4 * ps)
    check_accounting(alloc, cache)
    assert cache.dec_lock_ref(md.last_node) == 2 * ps
    assert cache.evict(100 * ps) == 3 * ps  # b's own page and both halves of d
    assert cache.match_prefix(d).prefix_len == 0
    assert cache.match_prefix(a).prefix_len == 2 * ps
    assert cache.match_prefix(b).prefix_len == ps
    assert cache.dec_lock_ref(m.last_node) == 0  # still locked once
    assert cache.dec_lock_ref(m.last_node) == 2 * ps
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)
    check_accounting(alloc, cache)
    assert cache.evict(1) == ps  # a's lower page; then its parent page becomes a leaf
    assert cache.evict(100 * ps) == ps
    assert cache.total_cached_tokens() == 0 and alloc.available_size() == alloc.total_size()


def cached_len(cache: RadixCache, tokens: list[int]) -> int:
    """Matched length found by walking the tree directly (match_prefix would refresh access times)."""
    ps, node, pos = cache.page_size, cache.root, 0
    while pos + ps <= len(tokens):
        child = node.children.get(tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps]))
        if child is None:
            break
        n = 0
        while n < len(child.key) and pos + n < len(tokens) and child.key[n] == tokens[pos + n]:
            n += 1
        pos += n - n % ps
        if n < len(child.key):
            break
        node = child
    return pos


def evict_one_by_one(cache: RadixCache, seqs: dict[str, list[int]]) -> list[tuple[list[str], int]]:
    """evict(1) until empty; per call, the names whose cached length shrank and the tokens freed."""
    steps = []
    while cache.total_cached_tokens():
        before = {k: cached_len(cache, v) for k, v in seqs.items()}
        freed = cache.evict(1)
        steps.append((sorted(k for k, v in seqs.items() if cached_len(cache, v) < before[k]), freed))
    return steps


@pytest.mark.parametrize("ps", [1, 4])
def test_eviction_is_lru_and_parents_become_leaves(ps: int) -> None:
    alloc, cache = make(ps)
    seqs = {name: [tok] * (2 * ps) for name, tok in [("a", 1), ("b", 2), ("c", 3)]}
    for s in seqs.values():
        put(alloc, cache, s)
    seqs["a+"] = seqs["a"] + [4] * ps
    put(alloc, cache, seqs["a+"])  # a's node gains a child and is touched
    cache.match_prefix(seqs["b"])  # b is now the most recent, c the oldest
    steps = evict_one_by_one(cache, seqs)
    # a's node is evicted only after its child: it becomes a leaf candidate then.
    assert steps == [(["c"], 2 * ps), (["a+"], ps), (["a", "a+"], 2 * ps), (["b"], 2 * ps)]
    assert alloc.available_size() == alloc.total_size()


def test_lru_order_after_split() -> None:
    alloc, cache = make(1)
    seqs = {str(t): [t, t] for t in [1, 2, 3, 4]}
    for s in seqs.values():
        put(alloc, cache, s)
    cache.match_prefix([2, 2])
    cache.match_prefix([1])  # splits [1, 1]: only the matched upper half is refreshed
    steps = evict_one_by_one(cache, seqs)
    assert [names for names, _ in steps] == [["1"], ["3"], ["4"], ["2"], ["1"]]


@pytest.mark.parametrize("ps", [1, 4])
def test_request_flow_chunked_then_finished(ps: int) -> None:
    """What the scheduler does: match+lock, alloc, cache a chunk, continue, finish; no leak."""
    alloc, cache = make(ps, num_pages=32)
    shared = [3] * (2 * ps) + [4]
    put(alloc, cache, shared)
    prompt = shared[:-1] + [5] * (3 * ps + 1)
    m = cache.match_prefix(prompt)
    cache.inc_lock_ref(m.last_node)
    assert m.prefix_len == 2 * ps
    partial = 1 if ps > 1 else 0  # the chunk ends mid-page when pages have more than one slot
    chunk = 3 * ps + partial
    kv = torch.cat([m.indices, alloc.alloc_extend([m.prefix_len], [chunk], [int(m.indices[-1])])])
    check_accounting(alloc, cache, held_outside=ps + partial * ps)  # a full page (+ a partial one)
    # Another request cached the same chunk meanwhile: our copy of its page is a duplicate.
    other = put(alloc, cache, prompt[:chunk])
    res = cache.cache_unfinished_request(prompt[:chunk], kv, m.prefix_len, m.last_node)
    assert res.indices.tolist() == m.indices.tolist() + other[2 * ps : 3 * ps].tolist()
    assert cache.protected_size() == 3 * ps
    check_accounting(alloc, cache, held_outside=partial * ps)  # only the partial page is the request's
    kv = torch.cat([res.indices, kv[res.prefix_len :]])  # slots may have changed to the tree's
    kv = torch.cat([kv, alloc.alloc_extend([chunk], [len(prompt)], [int(kv[-1])])])
    cache.cache_finished_request(prompt, kv, res.prefix_len, res.last_node)
    check_accounting(alloc, cache)
    # Again, and this time nobody else caches the chunk first.
    m = cache.match_prefix(prompt[: 2 * ps])
    cache.inc_lock_ref(m.last_node)
    prompt = prompt[: 2 * ps] + [6] * (3 * ps + 1)
    kv = torch.cat([m.indices, alloc.alloc_extend([m.prefix_len], [chunk], [int(m.indices[-1])])])
    res = cache.cache_unfinished_request(prompt[:chunk], kv, m.prefix_len, m.last_node)
    assert res.prefix_len == 3 * ps and res.indices.tolist() == kv[: 3 * ps].tolist()
    assert cache.protected_size() == 3 * ps
    check_accounting(alloc, cache, held_outside=partial * ps)  # only the partial page is the request's
    kv = torch.cat([res.indices, kv[res.prefix_len :]])  # slots may have changed to the tree's
    kv = torch.cat([kv, alloc.alloc_extend([chunk], [len(prompt)], [int(kv[-1])])])
    # A second request computed the same prompt meanwhile and cached it first: duplicates.
    put(alloc, cache, prompt)
    cache.cache_finished_request(prompt, kv, res.prefix_len, res.last_node)
    assert cache.protected_size() == 0
    check_accounting(alloc, cache)
    cache.reset()
    assert alloc.available_size() == alloc.total_size()


def test_evicted_node_cannot_be_locked_and_reset_needs_no_locks() -> None:
    alloc, cache = make(2)
    put(alloc, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.evict(10)
    with pytest.raises(RuntimeError, match="evicted"):
        cache.inc_lock_ref(m.last_node)
    put(alloc, cache, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    cache.reset()
    assert alloc.available_size() == alloc.total_size()
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(m.last_node)
    assert isinstance(cache.root, TreeNode) and cache.total_cached_tokens() == 0


def test_pretty_print(capsys: pytest.CaptureFixture[str]) -> None:
    alloc, cache = make(2)
    put(alloc, cache, [7, 8, 9, 10])
    cache.match_prefix([7, 8])
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "[7 8]" in out and "[9 10]" in out and "evictable=4" in out


def test_no_prefix_cache_caller_keeps_everything() -> None:
    alloc = PagedKVAllocator(8, 2, debug=True)
    cache = NoPrefixCache(alloc, 2)
    m = cache.match_prefix([1, 2, 3])
    assert m.prefix_len == 0
    cache.inc_lock_ref(m.last_node)
    kv = fresh(alloc, 5)
    assert cache.insert([1, 2, 3, 4, 5], kv) == 0
    res = cache.cache_unfinished_request([1, 2, 3, 4, 5], kv, 0, m.last_node)
    assert res.prefix_len == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.evict(100)) == (0, 0, 0)
    assert alloc.available_size() == alloc.total_size() - 6
    cache.cache_finished_request([1, 2, 3, 4, 5], kv, 0, res.last_node)
    assert alloc.available_size() == alloc.total_size()
    cache.reset()
    cache.pretty_print()


def test_page_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        RadixCache(PagedKVAllocator(4, 2), 4)
