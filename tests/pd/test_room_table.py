"""``RoomTableBackend``: the per-room bookkeeping the transfer plugins share."""

from __future__ import annotations

import pytest
import torch

from framework.disaggregation.base import KVLayout, RoomTableBackend, TransferState
from framework.memory.kv_cache import KVCache


class _Recorder(RoomTableBackend):
    """Only the abstract transport methods, recording what ``release`` tells it to forget."""

    def __init__(self) -> None:
        cache = KVCache(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=4,
                        dtype=torch.float32, device="cpu")
        super().__init__("decode", KVLayout.from_cache(cache), None)
        self.forgotten: list[int] = []

    def endpoint(self):
        return {}

    def connect(self, peer) -> None:
        pass

    def send(self, room, src_pages, dst_pages, metadata) -> None:
        raise NotImplementedError

    def expect(self, room, dst_pages) -> None:
        self.add_room(room)

    def forget_room(self, room: int) -> None:
        assert self._lock.locked(), "forget_room runs under the table's lock"
        self.forgotten.append(room)


def test_rooms_poll_carry_metadata_and_release() -> None:
    b = _Recorder()
    b.expect(7, [1])
    task = b.poll(7)
    assert task.state is TransferState.waiting_for_input and b.metadata(7) is None
    with b._lock:
        task.advance(TransferState.transferring)
        b._metadata[7] = b"first-token"
        task.advance(TransferState.success)
    assert b.poll(7).state is TransferState.success and b.metadata(7) == b"first-token"
    b.release(7)
    assert b.forgotten == [7] and b.metadata(7) is None
    with pytest.raises(KeyError, match="unknown room 7"):
        b.poll(7)
    b.release(7)  # releasing an unknown room is a no-op for the table, the transport still hears of it
    assert b.forgotten == [7, 7]


def test_release_fails_a_pending_task_so_queued_work_skips_it() -> None:
    b = _Recorder()
    b.expect(3, [2])
    task = b.poll(3)
    b.release(3)
    assert task.state is TransferState.failed and task.error == "released"


def test_busy_room_is_not_quiescent_even_after_release() -> None:
    b = _Recorder()
    b.expect(5, [1])
    b.expect(6, [2])
    with b._lock:
        b._busy_room = 5  # the transport's worker is on room 5's pages
    b.release(5)
    assert not b.quiescent(5) and b.quiescent(6)
    with b._lock:
        b._busy_room = None
    assert b.quiescent(5)
