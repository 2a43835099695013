"""The HTTP process <-> scheduler channel (``framework.server.channel``): frames split and joined
back byte for byte, both ends on real Unix sockets, a peer in another process, and what each end
does when the other one is gone."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

from framework.server.channel import (
    MAX_PATH,
    AsyncChannel,
    ChannelClosed,
    FrameReader,
    SocketChannel,
    frame,
    header,
    listen,
)


def framed(*bodies: bytes) -> bytes:
    return b"".join(piece for b in bodies for piece in frame(b))


@pytest.fixture
def run_dir() -> Iterator[str]:
    # Short: a Unix socket's path is limited to 107 bytes, which pytest's tmp_path can pass.
    with tempfile.TemporaryDirectory(prefix="ps-ch-") as d:
        yield d


@contextlib.asynccontextmanager
async def connected(run_dir: str) -> AsyncIterator[tuple[AsyncChannel, SocketChannel]]:
    """Both ends of one channel in this process: the HTTP process's and the scheduler's."""
    path = os.path.join(run_dir, "scheduler_0")
    channel = AsyncChannel(listen(path))
    end = SocketChannel.connect(path)
    try:
        await channel.accept()
        yield channel, end
    finally:
        end.close()
        channel.close()


def test_frames_come_back_whole_however_the_stream_is_cut() -> None:
    rng = random.Random(0)
    bodies = [rng.randbytes(n) for n in (0, 1, 3, 4, 5, 100, 70_000, 2, 300_000, 0, 9)]
    stream = framed(*bodies)
    for trial in range(30):
        reader, got, pos = FrameReader(), [], 0
        while pos < len(stream):  # cut into pieces of 1 byte to 100 kB, headers split too
            step = rng.choice((1, 2, 3, 5, 64, 4096, 100_000))
            got += [bytes(f) for f in reader.feed(stream[pos:pos + step])]
            pos += step
        assert got == bodies, f"trial {trial}"
    assert [bytes(f) for f in FrameReader().feed(stream)] == bodies  # all in one read


def test_a_partial_frame_waits_for_its_bytes() -> None:
    reader = FrameReader()
    stream = framed(b"abcdef", b"gh")
    assert reader.feed(stream[:2]) == []  # half a header
    assert reader.feed(stream[2:7]) == []  # header and part of the body
    assert [bytes(f) for f in reader.feed(stream[7:])] == [b"abcdef", b"gh"]


def test_a_header_refuses_a_body_over_the_limit() -> None:
    with pytest.raises(ValueError, match="over the channel's limit"):
        header(1 << 32)


def test_listen_names_the_fix_for_a_path_too_long(run_dir: str) -> None:
    path = os.path.join(run_dir, "x" * MAX_PATH)
    with pytest.raises(ValueError, match="TMPDIR"):
        listen(path)


def _echo_peer(path: str, count: int) -> None:
    """Another process's scheduler end: sends ``count`` messages, then echoes every message it
    receives with its bytes reversed until it receives b"stop"."""
    channel = SocketChannel.connect(path)
    for i in range(count):
        channel.send(f"hello {i}".encode() * (1 + i * 5000))
    while True:
        assert channel.poll(10_000)
        data = channel.recv()
        assert data is not None
        if bytes(data) == b"stop":
            break
        channel.send(bytes(data)[::-1])
    channel.close()


def test_messages_cross_between_processes_in_order_and_byte_exact(run_dir: str) -> None:
    path = os.path.join(run_dir, "scheduler_0")
    rng = random.Random(1)
    payloads = [rng.randbytes(n) for n in (1, 10, 65_535, 65_536, 1_000_000, 7)]

    async def main() -> None:
        channel = AsyncChannel(listen(path))
        peer = multiprocessing.get_context("spawn").Process(target=_echo_peer, args=(path, 3))
        peer.start()
        try:
            await asyncio.wait_for(channel.accept(), 60)
            assert not os.path.exists(path)  # one peer per channel: the path is gone once taken
            for i in range(3):  # sent before the handler: queued for receive()
                assert bytes(await asyncio.wait_for(channel.receive(), 60)) == f"hello {i}".encode() * (1 + i * 5000)
            echoed: list[bytes] = []
            done = asyncio.get_running_loop().create_future()

            def on_message(data: memoryview) -> None:
                echoed.append(bytes(data))
                if len(echoed) == len(payloads) and not done.done():
                    done.set_result(None)

            channel.deliver_to(on_message)
            for p in payloads:
                channel.send(p)
            await asyncio.wait_for(done, 60)
            assert echoed == [p[::-1] for p in payloads]
            channel.send(b"stop")
            await asyncio.get_running_loop().run_in_executor(None, peer.join, 60)
            assert peer.exitcode == 0
            # The peer closed its end: the channel says so, and sending is refused.
            for _ in range(200):
                if channel.lost is not None:
                    break
                await asyncio.sleep(0.01)
            assert isinstance(channel.lost, ChannelClosed) and not channel.connected
            with pytest.raises(ChannelClosed):
                channel.send(b"late")
        finally:
            channel.close()
            if peer.is_alive():
                peer.kill()

    asyncio.run(main())


def test_the_scheduler_end_sees_the_http_end_go(run_dir: str) -> None:
    path = os.path.join(run_dir, "scheduler_0")

    async def main() -> SocketChannel:
        channel = AsyncChannel(listen(path))
        end = SocketChannel.connect(path)
        await channel.accept()
        channel.send(b"last words")
        channel.close()  # what is buffered still goes out first
        await asyncio.sleep(0.05)
        return end

    end = asyncio.run(main())
    try:
        assert end.poll(1000) and bytes(end.recv() or b"") == b"last words"
        with pytest.raises(ChannelClosed):
            end.poll(1000)
        with pytest.raises(ChannelClosed):
            for _ in range(100):  # the first write after a close can still succeed
                end.send(b"x" * 100_000)
    finally:
        end.close()


def test_poll_times_out_and_recv_never_blocks(run_dir: str) -> None:
    async def main() -> None:
        async with connected(run_dir) as (channel, end):
            assert end.recv() is None
            assert not end.poll(0)
            assert not end.poll(20)
            channel.send(b"a")
            channel.send(b"b")
            await asyncio.sleep(0.05)
            assert end.poll(0)
            assert [bytes(end.recv() or b""), bytes(end.recv() or b"")] == [b"a", b"b"]
            assert end.recv() is None

    asyncio.run(main())


def test_receive_reports_a_peer_that_closed_before_saying_anything(run_dir: str) -> None:
    path = os.path.join(run_dir, "scheduler_0")

    async def main() -> None:
        channel = AsyncChannel(listen(path))
        SocketChannel.connect(path).close()
        try:
            await channel.accept()
            with pytest.raises(ChannelClosed):
                await asyncio.wait_for(channel.receive(), 10)
        finally:
            channel.close()

    asyncio.run(main())


def test_a_large_message_already_in_the_socket_is_taken_in_one_recv(run_dir: str) -> None:
    """Between two steps the scheduler calls recv() once: a weight update of megabytes must not
    take one step per 256 kB read."""
    payload = random.Random(2).randbytes(3_000_000)

    async def main() -> None:
        async with connected(run_dir) as (channel, end):
            channel.send(payload)
            transport = channel._transport
            assert transport is not None
            for _ in range(100):  # until the kernel holds all of it
                if transport.get_write_buffer_size() == 0:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.skip("this kernel's socket buffers are smaller than the message (net.core.wmem_max)")
            data = end.recv()
            assert data is not None and bytes(data) == payload

    asyncio.run(main())


def test_the_manager_answers_503_once_the_scheduler_channel_is_gone(run_dir: str) -> None:
    """A request, a control call and an abort towards a scheduler whose channel closed (it died;
    the launcher's process watch has not told the manager yet)."""
    from framework.sampling.params import SamplingParams
    from framework.server.data_parallel import listen_replicas
    from framework.server.errors import APIError
    from framework.server.metrics import ServerMetrics
    from framework.server.request_group import SubRequest
    from framework.server.tokenizer_manager import TokenizerManager
    from framework.testing.tiny_models import build_tokenizer

    path = os.path.join(run_dir, "scheduler_0")

    async def main() -> None:
        manager = TokenizerManager(build_tokenizer(), ServerMetrics(), listen_replicas([path]))
        end = SocketChannel.connect(path)
        try:
            await manager.replicas[0].channel.accept()
            manager.start()
            end.close()
            for _ in range(200):
                if not manager.replicas[0].channel.connected:
                    break
                await asyncio.sleep(0.01)
            sub = SubRequest(rid="r1", input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=4))
            with pytest.raises(APIError) as err:
                await manager.submit("r1", [sub])
            assert err.value.status == 503 and "not running" in str(err.value)
            assert not manager._groups and not manager._routes  # nothing left behind
            assert manager.replicas[0].in_flight == 0
            with pytest.raises(APIError) as err:
                await manager.control("get_load", timeout=5)
            assert err.value.status == 503 and not manager._calls
            await manager._send_aborts({0: ["r0"]})  # dropped quietly: the scheduler took its requests with it
        finally:
            await manager.close()

    asyncio.run(main())
