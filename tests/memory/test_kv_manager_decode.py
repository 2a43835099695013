"""KVManager.alloc_decode writes each request's new slot into ``req_to_token``: through a numpy
view of the host table when the pool's ``write`` is the plain assignment, through the pool's own
``write`` otherwise. Both must leave the same table as a torch ``index_put`` of the same slots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework.memory.kv_allocator import PagedKVAllocator
from framework.scheduler.kv_manager import KVManager
from plugins.pools.standard.pool import StandardRequestPool


class RecordingPool(StandardRequestPool):
    """A pool plugin with its own ``write`` (it must still see every write)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple] = []

    def write(self, index, values) -> None:
        self.writes.append((index, values))
        super().write(index, values)


def _manager(pool_cls: type, page_size: int) -> KVManager:
    pool = pool_cls(size=8, max_context_len=64, device="cpu")
    return KVManager(pool, PagedKVAllocator(num_pages=80, page_size=page_size), radix_enabled=True)


def _requests(kv: KVManager, kv_lens: list[int]) -> list[SimpleNamespace]:
    """Requests holding ``kv_len`` tokens each (their earlier slots allocated and written)."""
    reqs = []
    for n in kv_lens:
        r = SimpleNamespace(req_pool_idx=kv.req_pool.alloc(1)[0], kv_len=0, extend_len=n)
        reqs.append(r)
    kv.alloc_extend(reqs)
    for r in reqs:
        r.kv_len, r.extend_len = r.extend_len, 0
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_slots_land_where_a_torch_index_put_puts_them(page_size: int) -> None:
    kv = _manager(StandardRequestPool, page_size)
    assert kv._numpy_table
    reqs = _requests(kv, [3, 8, 1, 5])
    before = kv.req_to_token.clone()
    for _ in range(6):  # crosses page boundaries for page_size 4
        slots = kv.alloc_decode(reqs)
        expected = before.clone()
        rows = torch.tensor([r.req_pool_idx for r in reqs])
        cols = torch.tensor([r.kv_len for r in reqs])
        expected[rows, cols] = slots.to(torch.int32)
        assert torch.equal(kv.req_to_token, expected)
        assert len(set(slots.tolist())) == len(reqs)
        for r in reqs:
            r.kv_len += 1
        before = kv.req_to_token.clone()
    kv.allocator.check_invariants()


def test_a_pool_with_its_own_write_gets_the_decode_writes() -> None:
    kv = _manager(RecordingPool, 1)
    assert not kv._numpy_table
    reqs = _requests(kv, [2, 4])
    kv.req_pool.writes.clear()
    slots = kv.alloc_decode(reqs)
    [(index, values)] = kv.req_pool.writes
    rows, cols = index
    assert rows.tolist() == [r.req_pool_idx for r in reqs] and cols.tolist() == [2, 4]
    assert values.tolist() == slots.tolist()
    assert kv.req_to_token[rows, cols].tolist() == slots.tolist()


def test_taken_pages_are_marked_used_in_the_shared_flags() -> None:
    """``_take`` works on numpy views: the torch ring and flags must see the same change."""
    alloc = PagedKVAllocator(num_pages=10, page_size=1)
    pages = alloc._take(4)
    assert pages.tolist() == [1, 2, 3, 4]
    assert not alloc._page_free[pages].any() and alloc._page_free[5:].all()
    alloc.free(pages[:2])
    wrapped = alloc._take(8)  # the ring wraps: 5..10, then the two freed pages
    assert wrapped.tolist() == [5, 6, 7, 8, 9, 10, 1, 2]
    alloc.check_invariants()
    assert alloc._take(1) is None
