"""Page addresses, run merging and the per-request transfer state machine."""

from __future__ import annotations

import pytest
import torch

from framework.disaggregation.addressing import (
    PageRun,
    TransferSpan,
    merge_page_runs,
    page_address,
    pages_of_slots,
    transfer_spans,
)
from framework.disaggregation.base import KVLayout, TransferState, TransferStateError, TransferTask
from framework.memory.kv_cache import KVCache


def test_page_address_is_base_plus_index_times_bytes_per_page():
    assert page_address(1000, 0, 64) == 1000
    assert page_address(1000, 3, 64) == 1192
    with pytest.raises(ValueError):
        page_address(1000, -1, 64)


def test_layout_from_kv_cache_matches_tensor_addresses():
    cache = KVCache(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float32, device="cpu")
    layout = KVLayout.from_cache(cache)
    assert layout.bytes_per_page == 4 * 2 * 8 * 4
    assert layout.num_pages == 6  # page 0 (padding) + 5
    assert layout.ptrs == (cache.k_buffers[0].data_ptr(), cache.v_buffers[0].data_ptr(),
                           cache.k_buffers[1].data_ptr(), cache.v_buffers[1].data_ptr())
    # the address of page 3 of layer 1's V is where slot 3 * page_size of that tensor lives
    assert page_address(layout.ptrs[3], 3, layout.bytes_per_page) == cache.v_buffers[1][12].data_ptr()
    assert layout.buffers[3].data_ptr() == layout.ptrs[3]
    assert layout.buffers[3].numel() == layout.buffer_bytes
    assert KVLayout.from_json(layout.to_json()) == layout


def test_pages_of_slots():
    # page_size 4: slots 8..13 are pages 2 and 3; then a page elsewhere
    assert pages_of_slots([8, 9, 10, 11, 12, 13], 4) == [2, 3]
    assert pages_of_slots([20, 21, 22, 23, 4, 5], 4) == [5, 1]
    assert pages_of_slots([7, 3, 9], 1) == [7, 3, 9]


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([], [], []),
        ([5], [9], [PageRun(5, 9, 1)]),
        ([1, 2, 3], [7, 8, 9], [PageRun(1, 7, 3)]),
        # contiguous on the source but not on the destination: split
        ([1, 2, 3], [7, 8, 2], [PageRun(1, 7, 2), PageRun(3, 2, 1)]),
        # contiguous on the destination but not on the source: split
        ([1, 5, 6], [3, 4, 5], [PageRun(1, 3, 1), PageRun(5, 4, 2)]),
        # descending pages are never merged
        ([4, 3], [8, 7], [PageRun(4, 8, 1), PageRun(3, 7, 1)]),
        ([1, 2, 10, 11, 12, 4], [1, 2, 3, 4, 5, 6], [PageRun(1, 1, 2), PageRun(10, 3, 3), PageRun(4, 6, 1)]),
    ],
)
def test_merge_page_runs(src, dst, runs):
    assert merge_page_runs(src, dst) == runs
    # the runs cover every pair exactly once, in order
    pairs = [(r.src_page + i, r.dst_page + i) for r in runs for i in range(r.num_pages)]
    assert pairs == list(zip(src, dst, strict=True))


def test_merge_page_runs_rejects_length_mismatch():
    with pytest.raises(ValueError, match="2 source pages but 1"):
        merge_page_runs([1, 2], [1])


def test_transfer_spans_per_layer_k_then_v():
    src = KVLayout(ptrs=(1000, 2000, 3000, 4000), bytes_per_page=16, num_pages=10)
    dst = KVLayout(ptrs=(50000, 60000, 70000, 80000), bytes_per_page=16, num_pages=10)
    spans = transfer_spans(src, dst, [PageRun(2, 5, 3), PageRun(9, 1, 1)])
    assert spans == [
        TransferSpan(0, 1000 + 32, 50000 + 80, 48), TransferSpan(0, 1000 + 144, 50000 + 16, 16),
        TransferSpan(1, 2000 + 32, 60000 + 80, 48), TransferSpan(1, 2000 + 144, 60000 + 16, 16),
        TransferSpan(2, 3000 + 32, 70000 + 80, 48), TransferSpan(2, 3000 + 144, 70000 + 16, 16),
        TransferSpan(3, 4000 + 32, 80000 + 80, 48), TransferSpan(3, 4000 + 144, 80000 + 16, 16),
    ]


def test_transfer_spans_validate_layouts_and_pages():
    a = KVLayout(ptrs=(0, 100), bytes_per_page=16, num_pages=4)
    with pytest.raises(ValueError, match="incompatible"):
        transfer_spans(a, KVLayout(ptrs=(0, 100), bytes_per_page=32, num_pages=4), [])
    with pytest.raises(ValueError, match="incompatible"):
        transfer_spans(a, KVLayout(ptrs=(0,), bytes_per_page=16, num_pages=4), [])
    with pytest.raises(ValueError, match="destination page 4"):
        transfer_spans(a, a, [PageRun(1, 3, 2)])
    with pytest.raises(ValueError, match="source page 0"):
        transfer_spans(a, a, [PageRun(0, 1, 1)])


def test_task_state_machine_and_timeouts():
    t = TransferTask(room=7)
    assert t.state is TransferState.bootstrapping
    with pytest.raises(TransferStateError):
        t.advance(TransferState.success)
    t.advance(TransferState.waiting_for_input)
    t.advance(TransferState.transferring)
    # within the transfer timeout: still transferring
    assert not t.check_timeout(1.0, 5.0, now=t.since + 2.0)
    assert t.check_timeout(1.0, 5.0, now=t.since + 6.0)
    assert t.state is TransferState.failed and "timed out" in t.error
    t.fail("late")  # final states stay
    assert "timed out" in t.error
    with pytest.raises(TransferStateError):
        t.advance(TransferState.transferring)

    b = TransferTask(room=8)
    assert b.check_timeout(1.0, 100.0, now=b.since + 1.5)
    assert "bootstrap timed out" in b.error

    ok = TransferTask(room=9, state=TransferState.transferring)
    ok.advance(TransferState.success)
    assert not ok.check_timeout(0.0, 0.0, now=ok.since + 100)
