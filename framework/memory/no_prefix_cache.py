"""The prefix-cache interface with caching turned off (``radix_cache.enabled: false``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from framework.memory.kv_allocator import PagedKVAllocator
from framework.memory.radix_cache import MatchResult, TreeNode


class NoPrefixCache:
    """The prefix-cache interface with caching turned off: nothing is ever stored or shared.

    ``match_prefix`` returns an empty prefix; ``insert`` stores nothing and returns 0, and the
    caller keeps (so must free) every slot it passed. ``cache_finished_request`` frees all of the
    request's slots; ``cache_unfinished_request`` leaves them all with the request.
    """

    def __init__(self, allocator: PagedKVAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=self.device), None)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(self.root.value, self.root)

    def insert(self, token_ids: Sequence[int], indices: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_cached_tokens(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def cache_finished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> None:
        self.allocator.free(kv_indices[prefix_len:])

    def cache_unfinished_request(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> MatchResult:
        return MatchResult(kv_indices[:prefix_len], last_node)

    def format_tree(self) -> str:
        return "root (prefix cache disabled)"

    def pretty_print(self) -> None:
        print(self.format_tree())
