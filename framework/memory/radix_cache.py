"""The radix prefix cache: KV of finished (and partly prefilled) requests, shared by prefix.

A radix tree over token ids. Each node holds a key (token ids) and a value (the int64 KV slots of
those tokens, same length); a root-to-node path spells a cached prefix. Keys are page-aligned:
only whole pages are stored and nodes split only at page boundaries, because a page is the unit
the allocator frees and the unit a KV transfer ships.

Slot ownership (the one rule everything else follows): a slot is owned by exactly one of the
allocator (free), the tree (cached), or a request (held outside). The tree frees its slots only
through ``evict`` / ``reset``. ``insert(token_ids, indices)`` returns ``dup``, the number of
leading tokens already in the tree, and then:

- ``indices[:dup]``: still the caller's (the tree keeps its own, older slots for those tokens).
  Where they are slots the caller got from ``match_prefix`` they are the tree's slots and must
  not be freed; the rest are duplicates the caller must free.
- ``indices[dup:L]`` (``L`` = ``len(token_ids)`` rounded down to a page): now the tree's.
- ``indices[L:]`` (the trailing partial page): still the caller's.

``cache_finished_request`` and ``cache_unfinished_request`` apply this rule for a request whose
first ``prefix_len`` slots came from ``match_prefix``; schedulers should use them rather than
``insert``. Invariant: ``allocator.available_size() + evictable_size() + protected_size() +``
(tokens of pages held by requests) ``== allocator.total_size()``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from framework.memory.kv_allocator import PagedKVAllocator

_node_ids = itertools.count()


class TreeNode:
    """One radix-tree node; ``lock_ref`` counts the locked paths that run through it."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.value = value
        # None for the root and for nodes that were evicted or reset away (detached).
        self.parent = parent
        # Keyed by the child's first page: a token id (page_size 1) or a tuple of page_size ids.
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(_node_ids)  # heap tie-break among equal access times

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """The KV slots of the longest cached page-aligned prefix, and its deepest node (to lock)."""

    indices: torch.Tensor
    last_node: TreeNode

    @property
    def prefix_len(self) -> int:
        return self.indices.numel()


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache; ``RadixCache`` and ``NoPrefixCache`` fit it."""

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...
    def insert(self, token_ids: Sequence[int], indices: torch.Tensor) -> int: ...
    def inc_lock_ref(self, node: TreeNode) -> int: ...
    def dec_lock_ref(self, node: TreeNode) -> int: ...
    def evict(self, num_tokens: int) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_cached_tokens(self) -> int: ...
    def reset(self) -> None: ...
    def pretty_print(self) -> None: ...
    def cache_finished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> None: ...
    def cache_unfinished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> MatchResult: ...


def _common_pages_len(key: list[int], tokens: list[int], start: int, end: int, page_size: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[start:end]``, in whole pages.

    ``len(key)`` and ``end - start`` are page multiples (keys are page-aligned, ``end`` too).
    """
    n, i = min(len(key), end - start), 0
    # Compare big blocks with C-level list equality first, then page by page in the block that
    # differs: a per-token Python loop would dominate matching long prompts.
    block = page_size * max(1, 64 // page_size)
    while i + block <= n and key[i : i + block] == tokens[start + i : start + i + block]:
        i += block
    while i + page_size <= n and key[i : i + page_size] == tokens[start + i : start + i + page_size]:
        i += page_size
    return i


class RadixCache:
    """SGLang-style radix prefix cache over a ``PagedKVAllocator``, with lock refs and LRU eviction.

    Access times are a logical clock (one tick per ``match_prefix`` / ``insert``), so eviction
    order is deterministic. ``evictable_size`` and ``protected_size`` are kept incrementally.
    """

    def __init__(self, allocator: PagedKVAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._clock = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode([], self._empty(), None)
        self._evictable = 0
        self._protected = 0
        # Childless non-root nodes: the eviction candidates, kept so evict need not walk the tree.
        self._leaves: set[TreeNode] = set()

    # --------------------------------------------------------------------------- queries
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids``; refreshes its LRU time.

        Splits a node when the match ends inside it, so ``last_node`` covers exactly the match
        and locking it locks nothing more. A full match still leaves the caller to recompute at
        least one token for logits: match ``token_ids[:-1]`` when that matters.
        """
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        node, _, parts = self._walk(tokens, len(tokens) - len(tokens) % self.page_size)
        return MatchResult(torch.cat(parts) if parts else self._empty(), node)

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what ``evict`` could free)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes (prefixes of running requests)."""
        return self._protected

    def total_cached_tokens(self) -> int:
        return self._evictable + self._protected

    # --------------------------------------------------------------------------- updates
    def insert(self, token_ids: Sequence[int], indices: torch.Tensor) -> int:
        """Cache the page-aligned part of ``token_ids`` with KV slots ``indices``.

        Returns how many leading tokens were already cached. Ownership afterwards (module
        docstring): the tree takes ``indices[dup:L]``; the caller keeps ``indices[:dup]`` (frees
        those that are not the tree's own) and ``indices[L:]``.
        """
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        end = len(tokens) - len(tokens) % self.page_size
        if indices.numel() < end:
            raise ValueError(f"{indices.numel()} indices for {end} page-aligned tokens")
        node, pos, _ = self._walk(tokens, end)
        if pos < end:
            # clone: the caller's indices are often a view of req_to_token, reused later.
            leaf = TreeNode(tokens[pos:end], indices[pos:end].clone(), node)
            leaf.last_access = self._clock
            node.children[self._child_key(tokens, pos)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += len(leaf.key)
        return pos

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node against eviction; returns the tokens that became protected."""
        self._check_attached(node)
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # attached: parents up to the root
        self._evictable -= delta
        self._protected += delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the tokens that became evictable."""
        self._check_attached(node)
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref without a matching inc_lock_ref on {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
            node = node.parent  # type: ignore[assignment]
        self._evictable += delta
        self._protected -= delta
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` are freed or none is left.

        Whole nodes are evicted, so it may free more than asked. Returns the tokens freed.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, victims = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            victims.append(node.value)
            freed += len(node.key)
            self._detach_leaf(node)
            # A parent is touched whenever its child is, so it is never older than the child
            # just popped: pushing it keeps the pop order oldest-first.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if victims:
            self.allocator.free(torch.cat(victims))
        return freed

    def reset(self) -> None:
        """Free every cached slot through the allocator and empty the tree.

        Only when no request holds a lock (raises ``RuntimeError`` otherwise). Call it before
        ``allocator.clear()``, or instead of it: after a clear its frees would be double frees.
        """
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tokens (requests still running)")
        values = []
        for node in self._iter_nodes():
            values.append(node.value)
            node.parent = None  # old nodes are detached: locking one now raises
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ------------------------------------------------------------- request-level helpers
    def cache_finished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> None:
        """Hand a finished request's KV to the cache; afterwards the request owns no slots.

        ``kv_indices``: every slot the request holds, by position (it may run past
        ``token_ids``: those slots are freed too). ``prefix_len`` / ``last_node``: what its
        ``match_prefix`` (or last ``cache_unfinished_request``) returned and it locked.
        """
        end = self._insert_request(token_ids, kv_indices, prefix_len)
        self.allocator.free(kv_indices[end:])
        self.dec_lock_ref(last_node)

    def cache_unfinished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> MatchResult:
        """Cache the computed page-aligned prefix of a request that keeps running (chunked prefill).

        ``token_ids`` / ``kv_indices``: the tokens whose KV is computed and their slots. Returns
        the new prefix, already locked (the old ``last_node`` is unlocked): the caller writes
        ``result.indices`` into ``req_to_token[row, :result.prefix_len]`` (some slots changed to
        the tree's), and keeps owning ``kv_indices[result.prefix_len:]``.
        """
        end = self._insert_request(token_ids, kv_indices, prefix_len)
        result = self.match_prefix(token_ids[:end])
        # Lock the new path before unlocking the old so the shared part never turns evictable.
        self.inc_lock_ref(result.last_node)
        self.dec_lock_ref(last_node)
        return result

    def _insert_request(self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int) -> int:
        """Insert a request's page-aligned KV, free its duplicates; returns the aligned length."""
        end = len(token_ids) - len(token_ids) % self.page_size
        dup = self.insert(token_ids[:end], kv_indices[:end])
        if dup < prefix_len:
            raise RuntimeError(f"cached prefix shrank to {dup} < {prefix_len}: was it locked?")
        # [0, prefix_len) are the tree's own slots; [prefix_len, dup) duplicate what it keeps.
        self.allocator.free(kv_indices[prefix_len:dup])
        return end

    # --------------------------------------------------------------------------- debug
    def format_tree(self) -> str:
        """The tree as indented text: one line per node with its tokens, lock_ref and access time."""
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]
        stack = [(child, 1) for child in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            shown = " ".join(map(str, node.key[:16])) + (" ..." if len(node.key) > 16 else "")
            lines.append(
                f"{'  ' * depth}- [{shown}] len={len(node.key)} lock_ref={node.lock_ref} "
                f"t={node.last_access} slots={node.value[:4].tolist()}"
            )
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)

    def pretty_print(self) -> None:
        print(self.format_tree())

    # ------------------------------------------------------------------------ internal
    def _walk(self, tokens: list[int], end: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``tokens[:end]`` down the tree, refreshing access times (one clock tick) and
        splitting the node where the match ends inside one. Returns the deepest matched node,
        the matched length (whole pages) and the values along the path.
        """
        self._clock += 1
        node, pos, parts = self.root, 0, []
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = _common_pages_len(child.key, tokens, pos, end, self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            parts.append(child.value)
            node, pos = child, pos + n
        return node, pos, parts

    def _child_key(self, tokens: list[int], start: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens (a page multiple); returns the new upper node.

        ``child`` stays the lower part, so a request holding it as ``last_node`` still holds the
        deepest node of its prefix. The upper part inherits lock_ref: every locked path through
        the child runs through both halves.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key) and n % self.page_size == 0
        upper = TreeNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _detach_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None
        self._leaves.discard(node)
        self._evictable -= len(node.key)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"{node} was evicted or reset away; match_prefix again and lock that")

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
