"""The scheduler's bounded wait for a first token to be written (``server.first_token_wait_ms``).

Both halves without a model: the scheduler loop with a fake scheduler and a channel fed by the
test, and the HTTP process's tokenizer manager on a real channel (``framework.server.channel``),
with the test playing the scheduler's end. The served path runs it in ``test_ops`` (every streamed request on the test server).
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import pytest

from framework.sampling.params import SamplingParams
from framework.scheduler.outputs import RequestOutput
from framework.server import ipc
from framework.server.channel import SocketChannel
from framework.server.data_parallel import listen_replicas
from framework.server.metrics import ServerMetrics
from framework.server.request_group import SubRequest
from framework.server.scheduler_process import LOAD_REPORT_INTERVAL_S, SchedulerLoop
from framework.server.tokenizer_manager import TokenizerManager
from framework.testing.tiny_models import build_tokenizer
from tests.server.test_units import FakeChannel

# -- the scheduler's side ------------------------------------------------------------------------


class OneStepScheduler:
    """Its step returns ``outputs``; ``more`` says whether another step is due after it."""

    def __init__(self, outputs: list[RequestOutput], more: bool = True) -> None:
        self.outputs = outputs
        self.more = more
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.requests: dict[str, Any] = {}
        self.waiting: list[Any] = []

    def step(self) -> list[RequestOutput]:
        return self.outputs

    def has_work(self) -> bool:
        return self.more

    def add_request(self, req: Any) -> None:
        self.added.append(req.rid)

    def abort(self, rid: str, message: str | None = None) -> bool:
        self.aborted.append(rid)
        return True

    def load(self) -> dict[str, Any]:
        return {"num_running": 1}

    cache_hit_tokens = 0
    prompt_tokens_seen = 0


def first(rid: str = "a") -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=[5], prompt_tokens=3, completion_tokens=1, cached_tokens=0)


def later(rid: str = "a") -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=[7], prompt_tokens=3, completion_tokens=2, cached_tokens=0)


def make_loop(sched: OneStepScheduler, channel: FakeChannel, wait_s: float = 5.0) -> tuple[SchedulerLoop, FakeChannel]:
    """The loop and its channel (both what the test fed it and what it sent)."""
    loop = SchedulerLoop(sched, None, [0], channel, parent_pid=0, first_token_wait_s=wait_s)  # type: ignore[arg-type]
    return loop, channel


def batch(rid: str) -> ipc.GenerateBatch:
    return ipc.GenerateBatch(reqs=[ipc.GenerateReq(rid=rid, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})])


def test_a_first_token_makes_the_loop_wait_for_its_delivery_and_handle_what_comes_meanwhile() -> None:
    recv = FakeChannel(batch("x"), ipc.Delivered(ack_id=99), ipc.Delivered(ack_id=1), ipc.Abort(rids=["y"]))
    sched = OneStepScheduler([later("b"), first("a")])
    loop, send = make_loop(sched, recv)
    loop._send_outputs(loop._step())
    assert send.sent[0].ack_id == 1 and [o.rid for o in send.sent[0].outputs] == ["b", "a"]
    assert sched.added == ["x"]  # a request that came during the wait was admitted
    assert loop.first_token_waits == {"delivered": 1, "timed_out": 0, "late": 1}  # 99: an old wait's
    assert len(recv.queue) == 1 and not sched.aborted  # the wait ended at its Delivered
    loop._receive(block=False)
    assert sched.aborted == ["y"]


@pytest.mark.parametrize(("outputs", "more", "wait_s"), [
    ([later()], True, 5.0),  # no first token
    ([first()], False, 5.0),  # nothing runs next: the loop blocks on its socket anyway
    ([first()], True, 0.0),  # server.first_token_wait_ms=0
])
def test_no_wait_without_a_first_token_a_next_step_or_a_bound(outputs, more, wait_s) -> None:
    recv = FakeChannel(ipc.Delivered(ack_id=1))
    loop, send = make_loop(OneStepScheduler(outputs, more), recv, wait_s)
    loop._send_outputs(loop._step())
    assert send.sent[0].ack_id == 0
    assert len(recv.queue) == 1 and loop.first_token_waits["delivered"] == 0


def test_the_wait_is_bounded() -> None:
    loop, send = make_loop(OneStepScheduler([first()]), FakeChannel(), wait_s=0.05)
    loop._send_outputs(loop._step())
    assert send.sent[0].ack_id == 1
    assert loop.first_token_waits == {"delivered": 0, "timed_out": 1, "late": 0}
    loop._handle(ipc.encode(ipc.Delivered(ack_id=1)))  # it comes after all
    assert loop.first_token_waits["late"] == 1


def test_the_load_rides_along_at_intervals_and_before_the_scheduler_goes_idle() -> None:
    sched = OneStepScheduler([later()])
    loop, send = make_loop(sched, FakeChannel())
    loop._send_outputs(loop._step())
    loop._send_outputs(loop._step())
    assert send.sent[0].load == {"num_running": 1, "cache_hit_tokens": 0, "prompt_tokens_seen": 0,
                                 "prefix_cache_hit_rate": 0.0, "dp_rank": 0}
    assert send.sent[1].load is None  # within LOAD_REPORT_INTERVAL_S of the last one
    loop._load_sent_at -= LOAD_REPORT_INTERVAL_S
    loop._send_outputs(loop._step())
    assert send.sent[2].load is not None
    sched.more = False
    loop._send_outputs(loop._step())
    assert send.sent[3].load is not None  # the last message before idling carries the final load


# -- the HTTP process's side -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class FakeSchedulerEnd:
    """The scheduler process's end of the channel, driven by the test."""

    def __init__(self, path: str) -> None:
        self.channel = SocketChannel.connect(path)

    def send(self, msg: Any) -> None:
        self.channel.send(ipc.encode(msg))

    async def next_message(self, timeout_s: float = 10.0) -> Any:
        """The next message from the manager (the event loop runs meanwhile)."""
        await until(lambda: self.channel.poll(0), timeout_s)
        return ipc.decode_to_scheduler(self.channel.recv())

    async def nothing_sent(self) -> bool:
        """Let the event loop run a while; whether the manager sent nothing in it."""
        await asyncio.sleep(0.1)
        return not self.channel.poll(0)

    def close(self) -> None:
        self.channel.close()


def run_manager(tokenizer: Any, scenario: Any) -> None:
    async def main() -> None:
        # A short directory: a Unix socket's path is limited to ~107 bytes, and pytest's
        # tmp_path with a long test name can pass that.
        with tempfile.TemporaryDirectory(prefix="ps-") as run_dir:
            path = f"{run_dir}/scheduler_0"
            manager = TokenizerManager(tokenizer, ServerMetrics(), listen_replicas([path]))
            end = FakeSchedulerEnd(path)
            await manager.replicas[0].channel.accept()  # what wait_ready does first
            manager.start()
            try:
                await scenario(manager, end)
            finally:
                await manager.close()
                end.close()

    asyncio.run(main())


async def submit(manager: TokenizerManager, end: FakeSchedulerEnd, rid: str) -> Any:
    sub = SubRequest(rid=rid, input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=4))
    group = await manager.submit(rid, [sub])
    assert isinstance(await end.next_message(), ipc.GenerateBatch)
    return group


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    """Let the event loop run (the manager reads its socket there) until ``predicate()``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_delivered_goes_out_once_the_response_asks_for_the_next_event(tokenizer) -> None:
    async def scenario(manager: TokenizerManager, end: FakeSchedulerEnd) -> None:
        group = await submit(manager, end, "a")
        end.send(ipc.Outputs(outputs=[first("a")], ack_id=3))
        event = await asyncio.wait_for(group.next(), 10)  # the response took the first token...
        assert event.index == 0 and not event.finished
        assert await end.nothing_sent()  # ...but has not written it yet
        nxt = asyncio.ensure_future(group.next())  # it has, and waits for more
        assert await end.next_message() == ipc.Delivered(ack_id=3)
        end.send(ipc.Outputs(outputs=[later("a")]))
        await asyncio.wait_for(nxt, 10)

    run_manager(tokenizer, scenario)


def test_delivered_goes_out_when_the_request_is_gone_or_was_not_waited_for(tokenizer) -> None:
    async def scenario(manager: TokenizerManager, end: FakeSchedulerEnd) -> None:
        group = await submit(manager, end, "a")
        end.send(ipc.Outputs(outputs=[first("a")], ack_id=4))
        await until(lambda: not group.queue.empty())
        assert await end.nothing_sent()
        await manager.close_group(group)  # the client went away before the token was written
        assert await end.next_message() == ipc.Delivered(ack_id=4)
        assert await end.next_message() == ipc.Abort(rids=["a"])
        end.send(ipc.Outputs(outputs=[later("a"), first("unknown")], ack_id=5))  # no first token of ours
        assert await end.next_message() == ipc.Delivered(ack_id=5)

    run_manager(tokenizer, scenario)


def test_one_delivered_for_several_first_tokens(tokenizer) -> None:
    async def scenario(manager: TokenizerManager, end: FakeSchedulerEnd) -> None:
        a, b = await submit(manager, end, "a"), await submit(manager, end, "b")
        end.send(ipc.Outputs(outputs=[first("a"), first("b")], ack_id=6))
        await asyncio.wait_for(a.next(), 10)
        waiting_a = asyncio.ensure_future(a.next())
        assert await end.nothing_sent()  # b's token is not written yet
        await asyncio.wait_for(b.next(), 10)
        waiting_b = asyncio.ensure_future(b.next())
        assert await end.next_message() == ipc.Delivered(ack_id=6)
        waiting_a.cancel()
        waiting_b.cancel()

    run_manager(tokenizer, scenario)
