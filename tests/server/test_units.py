"""Server pieces without a server: chat templates in a sandbox, the IPC codec, the scheduler loop's
failure isolation (with a fake scheduler), and error shapes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from framework.scheduler.admission import AdmissionError, QueueFullError
from framework.scheduler.outputs import RequestOutput
from framework.server import ipc
from framework.server.chat_template import render_chat, render_in_sandbox, transformers_sandboxes
from framework.server.errors import APIError, from_validation_error
from framework.server.protocol import CompletionRequest
from framework.server.scheduler_process import SchedulerLoop
from framework.testing.tiny_models import build_tokenizer

ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
MESSAGES = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_transformers_renders_chat_templates_in_a_sandbox() -> None:
    assert transformers_sandboxes()


def test_own_sandbox_renders_like_transformers(tokenizer) -> None:
    ours = render_in_sandbox(tokenizer.chat_template, MESSAGES, True, {"bos_token": tokenizer.bos_token})
    theirs = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == theirs == "<|system|>\nBe kind.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("sandboxed_transformers", [True, False])
def test_template_escape_is_a_400(tokenizer, monkeypatch, sandboxed_transformers: bool) -> None:
    import framework.server.chat_template as ct

    monkeypatch.setattr(ct, "transformers_sandboxes", lambda: sandboxed_transformers)
    monkeypatch.setattr(tokenizer, "chat_template", ESCAPE)
    with pytest.raises(APIError) as info:
        render_chat(tokenizer, MESSAGES)
    assert info.value.status == 400 and info.value.param == "messages"
    monkeypatch.setattr(tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError, match="roles must alternate"):
        render_chat(tokenizer, MESSAGES)


def test_ipc_round_trip() -> None:
    out = RequestOutput(rid="a", new_token_ids=[1, 2], prompt_tokens=3, completion_tokens=2, cached_tokens=0,
                        new_top_logprobs=[[(1, -0.5), (2, -1.0)]], input_logprobs=[None, -2.0])
    msg = ipc.Outputs(outputs=[out], load={"num_running": 1})
    assert ipc.decode_from_scheduler(ipc.encode(msg)) == msg
    batch = ipc.GenerateBatch(reqs=[ipc.GenerateReq(rid="r", input_ids=[1], sampling_params={"n": 1})])
    assert ipc.decode_to_scheduler(ipc.encode(batch)) == batch
    with pytest.raises(msgspec.DecodeError):
        ipc.decode_to_scheduler(b"\x93not-a-message")


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", 1]})
    # Not "prompt.list[str].1": union tags are dropped; the member that got deepest names the element.
    assert from_validation_error(info.value).param == "prompt.1"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": [1, 2**63]})
    err = from_validation_error(info.value)  # token ids: the broken bound, not "not a string"
    assert err.param == "prompt.1" and "less than or equal" in err.message
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "a", "bogus": 1})
    err = from_validation_error(info.value)
    assert err.param == "bogus" and err.code == "unknown_parameter"


# -- the scheduler loop, with a fake scheduler -----------------------------------------------------


class FakeChannel:
    """The scheduler's end of its channel, driven by the test: ``queue`` holds the messages that
    have "arrived" (queued beforehand: nothing arrives later), ``sent`` what the loop sent."""

    def __init__(self, *incoming: Any) -> None:
        self.queue = [ipc.encode(m) for m in incoming]
        self.sent: list[Any] = []

    def send(self, data: bytes) -> None:
        self.sent.append(ipc.decode_from_scheduler(data))

    def poll(self, timeout_ms: float) -> bool:
        return bool(self.queue)

    def recv(self) -> bytes | None:
        return self.queue.pop(0) if self.queue else None


class FakeReq:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class FakeScheduler:
    """Admits requests; its step raises while ``poisoned``; abort records what it aborted."""

    def __init__(self, queue_limit: int = 10) -> None:
        self.requests: dict[str, FakeReq] = {}
        self.waiting: list[FakeReq] = []
        self.aborted: list[tuple[str, str | None]] = []
        self.queue_limit = queue_limit
        self.poisoned = False

    def add_request(self, req: Any) -> None:
        if req.input_ids == [666]:
            raise AdmissionError("bad prompt")
        if len(self.waiting) >= self.queue_limit:
            raise QueueFullError("the waiting queue is full")
        fake = FakeReq(req.rid)
        self.requests[req.rid] = fake
        self.waiting.append(fake)

    def abort(self, rid: str, message: str | None = None) -> bool:
        req = self.requests.pop(rid, None)
        if req in self.waiting:
            self.waiting.remove(req)
        self.aborted.append((rid, message))
        return req is not None

    def step(self) -> list:
        if self.poisoned:
            raise RuntimeError("boom")
        return []

    def has_work(self) -> bool:
        return bool(self.requests)


def _batch(*rids: str, ids: list[int] | None = None) -> bytes:
    reqs = [ipc.GenerateReq(rid=r, input_ids=ids or [1, 2], sampling_params={"max_new_tokens": 2}) for r in rids]
    return ipc.encode(ipc.GenerateBatch(reqs=reqs))


def make_loop(scheduler: FakeScheduler) -> tuple[SchedulerLoop, FakeChannel]:
    channel = FakeChannel()
    return SchedulerLoop(scheduler, None, [0], channel, parent_pid=0), channel  # type: ignore[arg-type]


def test_loop_rejects_a_batch_all_or_nothing() -> None:
    sched = FakeScheduler(queue_limit=2)
    loop, send = make_loop(sched)
    loop._handle(_batch("a", "b", "c"))
    assert send.sent == [ipc.Rejected(rids=["a", "b", "c"], message="the waiting queue is full", status=503)]
    assert [r for r, _ in sched.aborted] == ["a", "b"] and not sched.requests
    loop._handle(_batch("d", ids=[666]))
    assert send.sent[-1].status == 400 and send.sent[-1].message == "bad prompt"
    bogus = ipc.GenerateReq(rid="f", input_ids=[1], sampling_params={"bogus": 1})
    loop._handle(ipc.encode(ipc.GenerateBatch(reqs=[bogus])))
    assert send.sent[-1].status == 400 and "bogus" in send.sent[-1].message


def test_a_failing_step_fails_only_the_requests_in_flight() -> None:
    sched = FakeScheduler()
    loop, send = make_loop(sched)
    loop._handle(_batch("running", "queued"))
    sched.waiting.remove(sched.requests["running"])  # "running" left the queue: it is in the batch
    sched.poisoned = True
    assert loop._step() == []
    assert [r for r, _ in sched.aborted] == ["running"]
    assert "boom" in sched.aborted[0][1]
    assert "queued" in sched.requests  # the waiting request is untouched
    sched.poisoned = False
    assert loop._step() == []  # and the loop goes on


def test_loop_answers_control_calls_and_survives_garbage() -> None:
    sched = FakeScheduler()
    loop, send = make_loop(sched)
    loop._handle(b"garbage")
    loop._handle(ipc.encode(ipc.Control(call_id=7, kind="nonsense")))
    reply = send.sent[-1]
    assert reply.call_id == 7 and reply.ok is False and "nonsense" in reply.data["error"]
    loop._handle(ipc.encode(ipc.Shutdown()))
    assert loop.stopping


def test_listening_socket_gives_connections_tcp_nodelay() -> None:
    """The socket ``plugserve serve`` binds before loading the model makes asyncio (and so uvicorn,
    which serves on it) switch Nagle off on every accepted connection; without that a keep-alive
    client waited ~40 ms (its delayed ACK) for each streamed response's second write."""
    import asyncio
    import socket

    from framework.server.launcher import _bind

    sock = _bind("127.0.0.1", 0)

    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value

    assert asyncio.run(main()) != 0
