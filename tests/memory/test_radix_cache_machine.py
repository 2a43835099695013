"""RadixCache against a page-level reference model, under random insert/match/lock/evict/request flows.

The model is a dict from every cached page-aligned prefix (a tuple of token ids) to the KV slots of
its last page, plus the logical access time of each prefix and the list of lock holders. After
every step the tree is walked and must spell exactly the model: same prefixes, same slots, same
access times, lock_ref equal to the number of holders through each page. Slots are conserved:
free pages + cached pages + pages held by running requests == all pages, with no overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from framework.memory.kv_allocator import PagedKVAllocator
from framework.memory.radix_cache import RadixCache, TreeNode


@dataclass
class Running:
    """A request the test drives like a scheduler: slots [0, prefix_len) are the tree's."""

    tokens: list[int]
    kv: list[int]  # slots of tokens[:computed]
    prefix_len: int
    last_node: TreeNode
    computed: int


def walk(cache: RadixCache) -> dict[tuple[int, ...], tuple[list[int], int, int]]:
    """Brute force: every cached page prefix -> (its page's slots, node access time, node lock_ref)."""
    ps, out = cache.page_size, {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert len(child.key) > 0 and len(child.key) % ps == 0, "node not page-aligned"
            assert child.value.numel() == len(child.key) and child.value.dtype == torch.int64
            assert first == (child.key[0] if ps == 1 else tuple(child.key[:ps]))
            values = child.value.tolist()
            for i in range(0, len(child.key), ps):
                out[prefix + tuple(child.key[: i + ps])] = (
                    values[i : i + ps],
                    child.last_access,
                    child.lock_ref,
                )
            stack.append((child, prefix + tuple(child.key)))
    return out


class RadixMachine(RuleBasedStateMachine):
    page_size = 4
    num_pages = 14

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PagedKVAllocator(self.num_pages, self.page_size, debug=True)
        self.cache = RadixCache(self.alloc, self.page_size)
        self.ref: dict[tuple[int, ...], list[int]] = {}
        self.ref_time: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.locks: list[tuple[tuple[int, ...], TreeNode]] = []
        self.running: dict[int, Running] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ reference model
    def _pages(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[: k * ps]) for k in range(1, len(tokens) // ps + 1)]

    def _model_match(self, tokens: list[int]) -> list[int]:
        self.clock += 1
        slots = []
        for p in self._pages(tokens):
            if p not in self.ref:
                break
            self.ref_time[p] = self.clock
            slots += self.ref[p]
        return slots

    def _model_insert(self, tokens: list[int], slots: list[int]) -> int:
        self.clock += 1
        ps, dup = self.page_size, 0
        for k, p in enumerate(self._pages(tokens)):
            if p in self.ref:
                dup += ps  # the model is prefix-closed: once a page is new, all later ones are
            else:
                self.ref[p] = slots[k * ps : (k + 1) * ps]
            self.ref_time[p] = self.clock
        return dup

    def _holders(self) -> list[tuple[int, ...]]:
        return [p for p, _ in self.locks] + [tuple(r.tokens[: r.prefix_len]) for r in self.running.values()]

    def _protected_pages(self) -> set[tuple[int, ...]]:
        return {p for h in self._holders() for p in self._pages(list(h))}

    def _outside_pages(self) -> set[int]:
        return {s // self.page_size for r in self.running.values() for s in r.kv[r.prefix_len :]}

    def _match_checked(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        result = self.cache.match_prefix(tokens)
        expected = self._model_match(tokens)
        assert result.indices.tolist() == expected
        depth, node = 0, result.last_node
        while node is not self.cache.root:
            depth += len(node.key)
            node = node.parent
        assert depth == len(expected), "last_node does not end exactly at the matched prefix"
        return result.indices, result.last_node

    def _evict_checked(self, num_tokens: int) -> int:
        before = dict(self.ref)
        evictable_before = self.cache.evictable_size()
        free_before = self.alloc.num_free_pages()
        freed = self.cache.evict(num_tokens)
        after = walk(self.cache)
        assert set(after) <= set(before)
        removed = set(before) - set(after)
        assert not removed & self._protected_pages(), "evicted a locked prefix"
        assert freed == len(removed) * self.page_size
        assert self.alloc.num_free_pages() == free_before + len(removed)
        assert freed >= min(num_tokens, evictable_before)
        if freed < num_tokens:
            assert self.cache.evictable_size() == 0
        if removed:
            # LRU: nothing evicted is newer than any unlocked leaf that stayed.
            protected = self._protected_pages()
            remaining_leaves = [
                p for p in after if p not in protected and not any(q[: len(p)] == p and len(q) > len(p) for q in after)
            ]
            newest_removed = max(self.ref_time[p] for p in removed)
            assert all(self.ref_time[p] >= newest_removed for p in remaining_leaves)
        for p in removed:
            del self.ref[p], self.ref_time[p]
        return freed

    def _alloc_checked(self, prefix: int, seq: int, last_loc: int) -> list[int] | None:
        """alloc_extend, evicting the shortfall once (as the scheduler does) when pages run out."""
        out = self.alloc.alloc_extend([prefix], [seq], [last_loc])
        if out is None:
            self._evict_checked(seq - prefix + self.page_size)
            out = self.alloc.alloc_extend([prefix], [seq], [last_loc])
        return None if out is None else out.tolist()

    # ------------------------------------------------------------------------- rules
    # Sequences built from a few 4-token blocks share long prefixes (page-aligned for page_size 4)
    # and diverge mid-page ((0,0,0,0) vs (0,0,0,1)); the random tail leaves partial pages.
    tokens_st = st.builds(
        lambda blocks, tail: [t for b in blocks for t in b] + tail,
        st.lists(st.sampled_from([(0, 0, 0, 0), (1, 1, 1, 1), (0, 0, 0, 1), (2, 1, 0, 2)]), max_size=5),
        st.lists(st.integers(0, 2), max_size=3),
    )

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        self._match_checked(tokens)

    @rule(tokens=tokens_st)
    def insert_raw(self, tokens: list[int]) -> None:
        """Insert freshly computed KV with no matched prefix: the caller frees [0, dup) and the tail."""
        slots = self._alloc_checked(0, len(tokens), -1)
        if slots is None:
            return
        dup = self.cache.insert(tokens, torch.tensor(slots, dtype=torch.int64))
        assert dup == self._model_insert(tokens, slots)
        aligned = len(tokens) - len(tokens) % self.page_size
        self.alloc.free(torch.tensor(slots[:dup] + slots[aligned:], dtype=torch.int64))

    @rule(tokens=tokens_st)
    def lock(self, tokens: list[int]) -> None:
        indices, node = self._match_checked(tokens)
        prefix = tuple(tokens[: indices.numel()])
        newly = set(self._pages(list(prefix))) - self._protected_pages()
        assert self.cache.inc_lock_ref(node) == len(newly) * self.page_size
        self.locks.append((prefix, node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        prefix, node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        still = self._protected_pages()
        freed = set(self._pages(list(prefix))) - still
        assert self.cache.dec_lock_ref(node) == len(freed) * self.page_size

    @rule(num_tokens=st.integers(0, 30))
    def evict(self, num_tokens: int) -> None:
        self._evict_checked(num_tokens)

    @rule(tokens=tokens_st.filter(bool), data=st.data())
    def start_request(self, tokens: list[int], data: st.DataObject) -> None:
        indices, node = self._match_checked(tokens)
        self.cache.inc_lock_ref(node)
        prefix = indices.numel()
        rid, self.next_id = self.next_id, self.next_id + 1
        req = Running(tokens, indices.tolist(), prefix, node, prefix)
        self.running[rid] = req  # before allocating: eviction must see this lock
        end = len(tokens) if prefix == len(tokens) else data.draw(st.integers(prefix + 1, len(tokens)))
        new = self._alloc_checked(prefix, end, req.kv[-1] if prefix else -1)
        if new is None:
            self.cache.dec_lock_ref(node)
            del self.running[rid]
            return
        req.kv += new
        req.computed = end

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def start_same_as_running(self, data: st.DataObject) -> None:
        """Two requests with one prompt: whichever caches a page second holds duplicates."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.start_request(list(self.running[rid].tokens), data)

    @precondition(lambda self: any(r.computed < len(r.tokens) for r in self.running.values()))
    @rule(data=st.data())
    def next_chunk(self, data: st.DataObject) -> None:
        """Chunked prefill: cache what is computed so far, then allocate the next chunk."""
        rid = data.draw(st.sampled_from([i for i, r in self.running.items() if r.computed < len(r.tokens)]))
        req = self.running[rid]
        done = req.tokens[: req.computed]
        result = self.cache.cache_unfinished_request(
            done, torch.tensor(req.kv, dtype=torch.int64), req.prefix_len, req.last_node
        )
        self._model_insert(done, req.kv)
        expected = self._model_match(done)
        assert result.indices.tolist() == expected
        assert result.prefix_len == len(done) - len(done) % self.page_size
        req.kv[: result.prefix_len] = expected
        req.prefix_len, req.last_node = result.prefix_len, result.last_node
        end = data.draw(st.integers(req.computed + 1, len(req.tokens)))
        new = self._alloc_checked(req.computed, end, req.kv[-1] if req.kv else -1)
        if new is not None:
            req.kv += new
            req.computed = end

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        done = req.tokens[: req.computed]
        self.cache.cache_finished_request(done, torch.tensor(req.kv, dtype=torch.int64), req.prefix_len, req.last_node)
        self._model_insert(done, req.kv)

    # -------------------------------------------------------------------- invariants
    @invariant()
    def tree_matches_model(self) -> None:
        tree = walk(self.cache)
        assert {p: v[0] for p, v in tree.items()} == self.ref
        assert {p: v[1] for p, v in tree.items()} == self.ref_time
        holders = self._holders()
        for p, (_, _, lock_ref) in tree.items():
            assert lock_ref == sum(len(h) >= len(p) and h[: len(p)] == p for h in holders), p
        ps = self.page_size
        assert self.cache.protected_size() == ps * sum(v[2] > 0 for v in tree.values())
        assert self.cache.evictable_size() == ps * sum(v[2] == 0 for v in tree.values())
        assert self.cache.protected_size() == ps * len(self._protected_pages())
        # White box: the eviction candidates are exactly the childless nodes.
        nodes, stack = [], list(self.cache.root.children.values())
        while stack:
            nodes.append(stack.pop())
            stack.extend(nodes[-1].children.values())
        assert self.cache._leaves == {n for n in nodes if not n.children}

    @invariant()
    def slots_conserved(self) -> None:
        ps = self.page_size
        tree_pages = {s // ps for slots in self.ref.values() for s in slots}
        outside = self._outside_pages()
        free = set(self.alloc.free_page_ids().tolist())
        assert len(tree_pages) == len(self.ref), "two cached pages share a KV page"
        assert not (tree_pages & outside) and not (tree_pages & free) and not (outside & free)
        assert len(tree_pages) + len(outside) + len(free) == self.num_pages
        total = (
            self.alloc.available_size() + self.cache.evictable_size() + self.cache.protected_size() + len(outside) * ps
        )
        assert total == self.alloc.total_size()

    def teardown(self) -> None:
        # Leak check: once every request finished and every lock is gone, all KV is free + evictable.
        for rid in sorted(self.running):
            req = self.running.pop(rid)
            done = req.tokens[: req.computed]
            kv = torch.tensor(req.kv, dtype=torch.int64)
            self.cache.cache_finished_request(done, kv, req.prefix_len, req.last_node)
        for _, node in self.locks:
            self.cache.dec_lock_ref(node)
        assert self.cache.protected_size() == 0
        assert self.alloc.available_size() + self.cache.evictable_size() == self.alloc.total_size()
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.total_size()


class RadixMachinePage1(RadixMachine):
    page_size = 1
    num_pages = 30


TestRadixMachinePage4 = RadixMachine.TestCase
TestRadixMachinePage4.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestRadixMachinePage1 = RadixMachinePage1.TestCase
TestRadixMachinePage1.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
