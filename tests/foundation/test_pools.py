"""The two built-in request pools, built through the registry as the engine builds them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from framework.config.loader import validate_options
from framework.plugins import get_registry


def make_pool(name: str, size: int, max_len: int = 8, **options):
    comp = get_registry().get("memory_pool", name)
    opts = comp.make_options(validate_options(comp, options, "memory_pool.options"))
    return comp.factory(size, max_len, "cpu", opts)


@pytest.mark.parametrize("name", ["standard", "decode_prealloc"])
def test_table_shape_and_dtype(name):
    pool = make_pool(name, 4, max_len=16)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token.shape == (pool.num_rows, 16)


def test_standard_exhaustion_free_realloc():
    pool = make_pool("standard", 4)
    rows = pool.alloc(3)
    assert rows is not None and len(set(rows)) == 3
    assert pool.alloc(2) is None  # not enough: nothing taken
    assert pool.available_size() == 1
    last = pool.alloc(1)
    assert last is not None and last[0] not in rows
    assert pool.alloc(1) is None
    pool.free(rows[0])
    again = pool.alloc(1)
    assert again == [rows[0]]
    with pytest.raises(ValueError, match="twice"):
        pool.free([rows[0], rows[0]])
    pool.free([*rows, *last])
    assert pool.available_size() == 4


def test_write_goes_to_the_table():
    pool = make_pool("standard", 2, max_len=6)
    (row,) = pool.alloc(1)
    pool.write((row, slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[row, :3].tolist() == [7, 8, 9]


def test_standard_extra_rows_option():
    pool = make_pool("standard", 2, extra_rows=3)
    assert pool.size == 2 and pool.num_rows == 5 and pool.available_size() == 5


def test_decode_prealloc_rows_beyond_running_cap():
    pool = make_pool("decode_prealloc", 4, pre_alloc_size=3)
    assert pool.num_rows == 7
    rows = pool.alloc(7)  # every row can be reserved for in-flight KV
    assert rows is not None and len(set(rows)) == 7
    assert pool.alloc(1) is None
    activated = [r for r in rows if pool.activate(r)]
    assert len(activated) == 4  # the running batch stays capped at size
    assert pool.running_count() == 4 and pool.running_capacity_left() == 0
    pool.free(activated[0])  # a running request finished
    assert pool.activate(rows[4])  # a pre-allocated one may now run
    assert pool.running_count() == 4


def test_decode_prealloc_ratio_default_and_option():
    assert make_pool("decode_prealloc", 8).num_rows == 16  # default ratio 1.0
    assert make_pool("decode_prealloc", 8, pre_alloc_ratio=0.5).num_rows == 12
    assert make_pool("decode_prealloc", 8, pre_alloc_size=1, pre_alloc_ratio=3.0).num_rows == 9
    with pytest.raises(ValueError, match="pre_alloc_ratio must be >= 0"):
        make_pool("decode_prealloc", 8, pre_alloc_ratio=-1.0)


def test_activate_requires_reservation():
    pool = make_pool("decode_prealloc", 2, pre_alloc_size=1)
    with pytest.raises(ValueError, match="not reserved"):
        pool.activate(0)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["standard", "decode_prealloc"]), st.lists(st.integers(-3, 4), max_size=60))
def test_random_alloc_free_sequences(name, ops):
    pool = make_pool(name, 5)
    held: list[int] = []
    for op in ops:
        if op > 0:
            rows = pool.alloc(op)
            if rows is None:
                assert op > pool.available_size()
            else:
                assert not set(rows) & set(held), "a slot was handed out twice"
                held += rows
        elif held:
            k = min(-op + 1, len(held))
            pool.free(held[:k])
            held = held[k:]
        assert pool.available_size() + len(held) == pool.num_rows


class DecodePoolMachine(RuleBasedStateMachine):
    """Reserve/activate/deactivate/free in any order: the cap and conservation always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool("decode_prealloc", 3, pre_alloc_size=2)
        self.reserved: set[int] = set()
        self.running: set[int] = set()

    @rule(n=st.integers(1, 3))
    def reserve(self, n):
        rows = self.pool.alloc(n)
        if rows is None:
            assert n > self.pool.available_size()
        else:
            assert not set(rows) & self.reserved
            self.reserved |= set(rows)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def activate(self, data):
        row = data.draw(st.sampled_from(sorted(self.reserved)))
        ok = self.pool.activate(row)
        assert ok == (row in self.running or len(self.running) < 3)
        if ok:
            self.running.add(row)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def free(self, data):
        row = data.draw(st.sampled_from(sorted(self.reserved)))
        self.pool.free(row)
        self.reserved.discard(row)
        self.running.discard(row)

    @invariant()
    def conservation(self):
        assert self.pool.available_size() + len(self.reserved) == self.pool.num_rows
        assert self.pool.running_count() == len(self.running) <= self.pool.size


TestDecodePoolMachine = DecodePoolMachine.TestCase
TestDecodePoolMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
