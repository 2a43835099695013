"""PagedKVAllocator: exhaustion, uniqueness, partial-page filling, guards, and a random-op state machine.

The expected slots are computed here token by token (the slow, obvious way) and compared with the
allocator's vectorized result.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from framework.memory.kv_allocator import PagedKVAllocator


def expected_slots(prefix: int, seq: int, last_loc: int, new_pages: list[int], ps: int) -> list[int]:
    """Token-by-token reference for one request of alloc_extend."""
    out, loc, pages = [], last_loc, list(new_pages)
    for pos in range(prefix, seq):
        if pos % ps == 0:
            loc = pages.pop(0) * ps
        else:
            loc += 1
        out.append(loc)
    assert not pages, "reference consumed fewer pages than the allocator took"
    return out


def pages_of(slots: torch.Tensor, ps: int) -> set[int]:
    return set((slots // ps).tolist())


def test_sizes_and_initial_order() -> None:
    a = PagedKVAllocator(num_pages=5, page_size=4)
    assert (a.total_size(), a.available_size(), a.num_free_pages()) == (20, 20, 5)
    assert a.free_page_ids().tolist() == [1, 2, 3, 4, 5]
    assert a.alloc_pages(2).tolist() == [1, 2]
    assert a.available_size() == 12


@pytest.mark.parametrize("page_size", [1, 16])
def test_exhaustion_returns_none_and_takes_nothing(page_size: int) -> None:
    a = PagedKVAllocator(num_pages=4, page_size=page_size, debug=True)
    assert a.alloc_pages(5) is None
    assert a.num_free_pages() == 4
    before = a.free_page_ids().tolist()
    # 4 pages hold 4 * page_size tokens; ask for one token more across two requests.
    assert a.alloc_extend([0, 0], [2 * page_size, 2 * page_size + 1], [-1, -1]) is None
    assert a.free_page_ids().tolist() == before
    got = a.alloc_extend([0, 0], [2 * page_size, 2 * page_size], [-1, -1])
    assert got is not None and got.numel() == 4 * page_size
    assert a.available_size() == 0
    assert a.alloc_decode([1], [-1]) is None
    assert a.alloc_pages(1) is None
    assert a.alloc_pages(0).numel() == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_and_realloc_never_duplicates(page_size: int) -> None:
    a = PagedKVAllocator(num_pages=8, page_size=page_size, debug=True)
    held: dict[int, torch.Tensor] = {}
    for i in range(4):
        held[i] = a.alloc_extend([0], [2 * page_size], [-1])
    a.free(held.pop(1))
    a.free(held.pop(3))
    for i in range(4, 6):
        held[i] = a.alloc_extend([0], [2 * page_size], [-1])
    all_slots = torch.cat(list(held.values()))
    assert torch.unique(all_slots).numel() == all_slots.numel()
    assert a.available_size() == 0
    for t in held.values():
        a.free(t)
    assert a.available_size() == a.total_size()


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_extend_fills_partial_page_first(page_size: int) -> None:
    ps = page_size
    a = PagedKVAllocator(num_pages=20, page_size=ps, debug=True)
    first = a.alloc_extend([0, 0, 0], [ps + 3, 1, 2 * ps], [-1, -1, -1])
    lens = [ps + 3, 1, 2 * ps]
    reqs = list(torch.split(first, lens))
    # Second chunk: continue each request from where it stopped (one ends exactly on a page).
    prefix, seq = lens, [lens[0] + ps, 5 + ps, 2 * ps + 3]
    last = [int(r[-1]) for r in reqs]
    free_before = a.free_page_ids().tolist()
    second = a.alloc_extend(prefix, seq, last)
    assert second is not None
    new_pages_per_req = [(s + ps - 1) // ps - (p + ps - 1) // ps for p, s in zip(prefix, seq, strict=True)]
    taken, out = iter(free_before), []
    for p, s, loc, k in zip(prefix, seq, last, new_pages_per_req, strict=True):
        out += expected_slots(p, s, loc, [next(taken) for _ in range(k)], ps)
    assert second.tolist() == out
    # Within a request, slots of one page are consecutive and belong to the same page.
    for r, more in zip(reqs, torch.split(second, [s - p for p, s in zip(prefix, seq, strict=True)]), strict=True):
        whole = torch.cat([r, more])
        for start in range(0, whole.numel(), ps):
            page = whole[start : start + ps]
            assert page.tolist() == list(range(int(page[0]), int(page[0]) + page.numel()))
            assert int(page[0]) % ps == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_decode_matches_alloc_extend(page_size: int) -> None:
    ps = page_size
    a, b = PagedKVAllocator(60, ps, debug=True), PagedKVAllocator(60, ps, debug=True)
    lens = [1, 3, 4, 7, 8]
    sa = a.alloc_extend([0] * 5, lens, [-1] * 5)
    sb = b.alloc_extend([0] * 5, lens, [-1] * 5)
    assert sa.tolist() == sb.tolist()
    last = [int(t[-1]) for t in torch.split(sa, lens)]
    for _ in range(6):
        seq = [n + 1 for n in lens]
        da = a.alloc_decode(seq, last)
        db = b.alloc_extend(lens, seq, last)
        assert da.tolist() == db.tolist()
        lens, last = seq, da.tolist()


def test_free_guards() -> None:
    a = PagedKVAllocator(num_pages=4, page_size=4)
    s = a.alloc_extend([0], [6], [-1])
    with pytest.raises(ValueError, match="reserved"):
        a.free(torch.tensor([0, 1, 2, 3]))  # page 0
    with pytest.raises(ValueError, match="reserved"):
        a.free(torch.tensor([100]))  # beyond the last page
    with pytest.raises(ValueError, match="double free"):
        a.free(torch.tensor([12]))  # page 3: never allocated
    a.free(s[:1])  # frees the whole first page
    with pytest.raises(ValueError, match="double free"):
        a.free(s[1:2])  # another slot of the same, already freed page
    assert a.num_free_pages() == 3
    a.free(s[4:])
    assert a.num_free_pages() == 4
    a.free(torch.empty(0, dtype=torch.int64))


def test_debug_checks_bad_last_loc() -> None:
    a = PagedKVAllocator(num_pages=4, page_size=4, debug=True)
    s = a.alloc_extend([0], [2], [-1])
    with pytest.raises(ValueError):
        a.alloc_extend([2], [3], [int(s[0])])  # last_loc offset does not match prefix_len
    with pytest.raises(ValueError):
        a.alloc_extend([2], [3], [4 * 4 + 1])  # a slot in a page that is not allocated
    with pytest.raises(ValueError):
        a.alloc_extend([3], [2], [int(s[1])])  # seq shorter than prefix


def test_free_list_wraps_around_in_fifo_order() -> None:
    a = PagedKVAllocator(num_pages=4, page_size=2, debug=True)
    first = a.alloc_pages(3)
    a.free(torch.tensor([5, 2]))  # pages 2 then 1: freed pages queue up in the order given
    assert a.free_page_ids().tolist() == [4, 2, 1]
    assert a.alloc_pages(3).tolist() == [4, 2, 1]  # the ring wraps past its end
    a.free(torch.tensor([6, 7]))  # page 3 (both its slots)
    a.free(torch.tensor([8, 2]))  # pages 4 and 1: this write to the ring wraps past its end
    assert a.free_page_ids().tolist() == [3, 4, 1]
    assert first.tolist() == [1, 2, 3]


def test_free_dedupes_pages_given_in_any_order() -> None:
    a = PagedKVAllocator(num_pages=4, page_size=2, debug=True)
    a.alloc_pages(4)
    a.free(torch.tensor([4, 2, 5, 3]))  # pages 2, 1, 2, 1: not adjacent, still freed once each
    assert a.free_page_ids().tolist() == [1, 2]
    a.free(torch.tensor([9, 9, 8]))  # page 4 three times in a row
    assert a.num_free_pages() == 3
    b = PagedKVAllocator(num_pages=4, page_size=1, debug=True)
    b.alloc_pages(4)
    b.free(torch.tensor([3, 1, 3]))
    assert b.free_page_ids().tolist() == [1, 3]
    with pytest.raises(ValueError, match="double free"):
        b.free(torch.tensor([2, 3]))
    assert b.num_free_pages() == 2  # nothing freed by the failed call


def test_clear_and_determinism() -> None:
    def run() -> list[list[int]]:
        a = PagedKVAllocator(num_pages=6, page_size=2)
        x = a.alloc_extend([0, 0], [3, 4], [-1, -1])
        a.free(x[:2])
        y = a.alloc_extend([0], [5], [-1])
        return [x.tolist(), y.tolist(), a.free_page_ids().tolist()]

    assert run() == run()
    a = PagedKVAllocator(num_pages=6, page_size=2)
    a.alloc_pages(4)
    a.clear()
    assert a.free_page_ids().tolist() == [1, 2, 3, 4, 5, 6]


class AllocatorMachine(RuleBasedStateMachine):
    """Random requests grow, decode and finish; checks every page is free xor held by one request."""

    page_size = 4
    num_pages = 12

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PagedKVAllocator(self.num_pages, self.page_size, debug=True)
        self.reqs: dict[int, list[int]] = {}  # request id -> its slots by position
        self.next_id = 0

    def _held_pages(self) -> list[int]:
        return [p for slots in self.reqs.values() for p in sorted({s // self.page_size for s in slots})]

    @rule(lens=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), min_size=1, max_size=4), data=st.data())
    def extend(self, lens: list[tuple[bool, int]], data: st.DataObject) -> None:
        """Each entry: grow an existing request (if True and any) or start a new one."""
        ids, prefix, seq, last = [], [], [], []
        for grow, n in lens:
            pool = [r for r in self.reqs if r not in ids]
            rid = data.draw(st.sampled_from(pool)) if grow and pool else None
            if rid is None:
                rid, self.next_id = self.next_id, self.next_id + 1
                self.reqs[rid] = []
            slots = self.reqs[rid]
            ids.append(rid)
            prefix.append(len(slots))
            seq.append(len(slots) + n)
            last.append(slots[-1] if slots else -1)
        ps = self.page_size
        need = sum((s + ps - 1) // ps - (p + ps - 1) // ps for p, s in zip(prefix, seq, strict=True))
        free_before = self.alloc.free_page_ids().tolist()
        out = self.alloc.alloc_extend(prefix, seq, last)
        if need > len(free_before):
            assert out is None
            assert self.alloc.free_page_ids().tolist() == free_before
            return
        assert out is not None and out.dtype == torch.int64
        taken, expect = iter(free_before), []
        for p, s, loc in zip(prefix, seq, last, strict=True):
            k = (s + ps - 1) // ps - (p + ps - 1) // ps
            expect += expected_slots(p, s, loc, [next(taken) for _ in range(k)], ps)
        assert out.tolist() == expect
        for rid, chunk in zip(ids, torch.split(out, [s - p for p, s in zip(prefix, seq, strict=True)]), strict=True):
            self.reqs[rid] += chunk.tolist()

    @precondition(lambda self: any(self.reqs.values()))
    @rule()
    def decode(self) -> None:
        ids = [r for r, s in self.reqs.items() if s]
        seq = [len(self.reqs[r]) + 1 for r in ids]
        last = [self.reqs[r][-1] for r in ids]
        free_before = self.alloc.free_page_ids().tolist()
        out = self.alloc.alloc_decode(seq, last)
        if sum((n - 1) % self.page_size == 0 for n in seq) > len(free_before):
            assert out is None
            assert self.alloc.free_page_ids().tolist() == free_before
            return
        assert out is not None
        taken = iter(free_before)
        for r, n, loc, got in zip(ids, seq, last, out.tolist(), strict=True):
            assert got == (next(taken) * self.page_size if (n - 1) % self.page_size == 0 else loc + 1)
            self.reqs[r].append(got)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.alloc.free(torch.tensor(self.reqs.pop(rid), dtype=torch.int64))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def double_free_is_caught(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs.pop(rid)
        if not slots:
            return
        self.alloc.free(torch.tensor(slots))
        free_before = self.alloc.free_page_ids().tolist()
        try:
            self.alloc.free(torch.tensor(slots[-1:]))
            raise AssertionError("double free was not caught")
        except ValueError:
            pass
        assert self.alloc.free_page_ids().tolist() == free_before

    @invariant()
    def conservation(self) -> None:
        held = self._held_pages()
        assert len(held) == len(set(held)), "a page is held by two requests"
        free = self.alloc.free_page_ids().tolist()
        assert not set(free) & set(held), "a held page is also free"
        assert len(free) + len(held) == self.num_pages
        assert self.alloc.available_size() + len(held) * self.page_size == self.alloc.total_size()
        assert all(1 <= p <= self.num_pages for p in held)


class AllocatorMachinePage1(AllocatorMachine):
    page_size = 1
    num_pages = 40


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestAllocatorMachinePage1 = AllocatorMachinePage1.TestCase
TestAllocatorMachinePage1.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
