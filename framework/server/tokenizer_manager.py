"""The HTTP process's side of the scheduler: send requests, route output deltas, detokenize.

Everything here runs on the asyncio event loop and never waits on the model: requests go out on
the scheduler's channel (``framework.server.channel``), and the channel hands each message the
scheduler sends to :meth:`TokenizerManager._on_message` from the event loop, which turns each output delta
into text with a :class:`~framework.engine.request_state.RequestState` (the same class the
in-process Engine uses, so both produce identical text). The deltas of all the scheduler requests
that make up one HTTP request (a batch, ``n`` choices) arrive on one :class:`RequestGroup` queue.

With data parallelism (``parallel.dp_size`` > 1) there is one channel per
replica (``framework.server.data_parallel``); each group lives on the replica the load balancer
picked for it, and its aborts go there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from framework.engine.request_state import RequestState
from framework.server import ipc
from framework.server.channel import ChannelClosed
from framework.server.data_parallel import LoadBalancer, Replica, combined_load
from framework.server.errors import APIError
from framework.server.metrics import ServerMetrics
from framework.server.request_group import Event, RequestGroup, SubRequest

logger = logging.getLogger("plugserve.server")

QUEUE_FULL_RETRY_AFTER_S = 1
"""Retry-After (seconds) sent with a 503 when the scheduler's waiting queue is full."""
LOAD_REFRESH_TIMEOUT_S = 2.0
"""/metrics waits this long for fresh scheduler gauges before rendering the last known ones."""


class SchedulerStartError(RuntimeError):
    """The scheduler process reported that it could not start."""


class TokenizerManager:
    """Sends requests to the scheduler processes (one per data-parallel replica) and routes their
    outputs back to request groups.

    ``replicas`` holds one :class:`Replica` per scheduler process, in ``dp_rank`` order, its
    channel listening (``data_parallel.listen_replicas``, before the scheduler was spawned);
    :meth:`wait_ready` takes their connections. ``balance`` is ``parallel.load_balance_method``.
    """

    def __init__(self, tokenizer: Any, metrics: ServerMetrics, replicas: Sequence[Replica],
                 balance: str = "round_robin") -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.replicas: list[Replica] = list(replicas)
        self.balancer = LoadBalancer(balance, self.replicas)
        self.info: dict[str, Any] = {}
        """Replica 0's Ready info (each replica's is on ``replicas[i].info``)."""
        self.dead: str | None = None
        self.last_load: dict[str, Any] = {}
        self._routes: dict[str, tuple[RequestGroup, int]] = {}
        self._groups: dict[str, RequestGroup] = {}
        self._calls: dict[int, asyncio.Future[tuple[bool, dict[str, Any]]]] = {}
        self._call_ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------

    async def wait_ready(self) -> dict[str, Any]:
        """Wait for every replica's Ready message (returns replica 0's info); raises
        SchedulerStartError if one failed."""
        waits = [asyncio.ensure_future(self._wait_replica_ready(r)) for r in self.replicas]
        try:
            await asyncio.gather(*waits)
        finally:  # one replica failed (or the launcher gave up): stop waiting for the others
            for wait in waits:
                wait.cancel()
        self.info = self.replicas[0].info
        return self.info

    async def _wait_replica_ready(self, replica: Replica) -> None:
        await replica.channel.accept()
        while True:
            try:
                data = await replica.channel.receive()
            except ChannelClosed as exc:
                raise SchedulerStartError(f"dp rank {replica.dp_rank}: {exc}") from exc
            msg = ipc.decode_from_scheduler(data)
            if isinstance(msg, ipc.Ready):
                replica.info = msg.info
                return
            if isinstance(msg, ipc.StartupFailed):
                where = f"dp rank {replica.dp_rank}: " if len(self.replicas) > 1 else ""
                raise SchedulerStartError(where + msg.message)

    def start(self) -> None:
        """Deliver the scheduler's messages from now on: each channel calls :meth:`_on_message`
        from the event loop for every message it reads (no task, future or queue per message: one
        arrives per step and stream, and on 2 cores every microsecond here is taken from the
        model's threads)."""
        for replica in self.replicas:
            replica.channel.deliver_to(lambda data, replica=replica: self._on_message(data, replica))

    async def close(self) -> None:
        for replica in self.replicas:
            replica.channel.close()

    async def shutdown_scheduler(self) -> None:
        """Ask every scheduler loop to exit (the launcher escalates if one does not)."""
        if self.dead is None:
            for replica in self.replicas:
                if replica.channel.connected:
                    replica.channel.send(ipc.encode(ipc.Shutdown()))

    def on_scheduler_death(self, reason: str) -> None:
        """Fail everything in flight at once; /health answers 503 from now on."""
        self.dead = reason
        error = APIError(503, f"the scheduler process died ({reason}); the server is shutting down",
                         code="scheduler_dead")
        self._end_all(error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()

    async def fail_all(self, error: APIError) -> int:
        """End every open request now (the shutdown grace period is over): each unfinished one
        finishes with reason abort, its client gets ``error`` (a 503, or in a stream the last
        chunks, an error event and ``[DONE]``), and the scheduler frees its KV. Returns how many."""
        ended = self._end_all(error)
        if self.dead is None:
            await self._send_aborts(ended)
        return sum(len(rids) for rids in ended.values())

    def _end_all(self, error: APIError) -> dict[int, list[str]]:
        """End every open group; the ids that were still running, by replica."""
        ended: dict[int, list[str]] = {}
        for group in list(self._groups.values()):
            for index, state in enumerate(group.states):
                if not state.finished:
                    state.abort(error.message)
                    self.metrics.finished("abort", state.prompt_tokens, state.completion_tokens,
                                          state.cached_tokens, state.created, state.first_token_at)
                    group.queue.put_nowait(Event(index, "", True))
                    ended.setdefault(group.dp_rank, []).append(state.rid)
            group.fail(error)  # (which also ends the group's delivery waits)
            group.closed = True  # nothing is left for close_group to abort
        self._groups.clear()
        self._routes.clear()
        for replica in self.replicas:
            replica.in_flight = 0
        return ended

    async def _send_aborts(self, rids_by_rank: dict[int, list[str]]) -> None:
        for rank, rids in rids_by_rank.items():
            if rids:
                try:
                    self.replicas[rank].channel.send(ipc.encode(ipc.Abort(rids=rids)))
                except ChannelClosed:  # the scheduler is gone, and its requests with it
                    logger.debug("dp rank %s is gone; %d aborts not sent", rank, len(rids))

    # -- requests ----------------------------------------------------------------------------

    async def submit(self, group_rid: str, subs: list[SubRequest], dp_rank: int | None = None) -> RequestGroup:
        """Send the scheduler requests of one HTTP request (to replica ``dp_rank``, or the one the
        balancer picks); their deltas arrive on the group."""
        self._check_alive()
        if dp_rank is not None and not 0 <= dp_rank < len(self.replicas):
            raise APIError(400, f"data_parallel_rank {dp_rank} is out of range: this server runs "
                           f"{len(self.replicas)} replica(s), 0..{len(self.replicas) - 1}", param="data_parallel_rank")
        for rid in [group_rid, *(s.rid for s in subs)]:
            if rid in self._groups or rid in self._routes:
                raise APIError(400, f"request id {rid!r} is already in use", param="rid", code="duplicate_rid")
        # Everything that can fail happens before the group is registered: a request that never
        # reached the scheduler must not stay in the tables (its rid would be refused forever).
        message = ipc.encode(ipc.GenerateBatch(reqs=[s.to_ipc() for s in subs]))
        states = [RequestState(s.rid, self.tokenizer, s.input_ids, s.params, s.return_logprob,
                               s.token_ids_logprob) for s in subs]
        replica = self.balancer.pick(dp_rank)
        group = RequestGroup(group_rid, subs, states, replica.dp_rank)
        self._groups[group_rid] = group
        for i, s in enumerate(subs):
            self._routes[s.rid] = (group, i)
        replica.in_flight += len(subs)
        try:
            replica.channel.send(message)
        except ChannelClosed as exc:
            self._forget(group)
            raise APIError(503, f"the scheduler process is not running ({exc})", code="scheduler_dead") from exc
        except BaseException:
            self._forget(group)
            raise
        return group

    async def close_group(self, group: RequestGroup) -> None:
        """The client is gone or done: abort what still runs (freeing its KV) and forget it."""
        if group.closed:
            return
        group.closed = True
        unfinished = [s for s in group.states if not s.finished]
        self._forget(group)
        if not unfinished or self.dead is not None:
            return
        if group.error is None:  # a failed group was already counted
            for s in unfinished:
                self.metrics.finished("abort", s.prompt_tokens, s.completion_tokens, s.cached_tokens,
                                      s.created, s.first_token_at)
        # Also for a failed group: aborting an id the scheduler refused or finished is a no-op.
        await self._send_aborts({group.dp_rank: [s.rid for s in unfinished]})

    async def abort(self, rid: str | None, abort_all: bool = False) -> list[str]:
        """/abort_request: abort by group or scheduler request id (or everything); the clients
        of those requests still receive their final, aborted, outputs. Returns the aborted ids."""
        self._check_alive()
        by_rank: dict[int, list[str]] = {}
        if abort_all:
            for sub_rid, (group, _) in self._routes.items():
                by_rank.setdefault(group.dp_rank, []).append(sub_rid)
        elif rid in self._groups:
            group = self._groups[rid]
            by_rank[group.dp_rank] = [s.rid for s in group.states if not s.finished]
        elif rid in self._routes:
            by_rank[self._routes[rid][0].dp_rank] = [rid]
        await self._send_aborts(by_rank)
        return [r for rids in by_rank.values() for r in rids]

    async def control(self, kind: str, timeout: float, args: dict[str, Any] | None = None,
                      dp_rank: int = 0) -> tuple[bool, dict[str, Any]]:
        """A control call to one replica's scheduler (one of :data:`framework.server.ipc.CONTROL_KINDS`)."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut: asyncio.Future[tuple[bool, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        control = ipc.Control(call_id=call_id, kind=kind, args=args or {})
        try:
            self.replicas[dp_rank].channel.send(ipc.encode(control))
        except ChannelClosed as exc:
            self._calls.pop(call_id, None)
            raise APIError(503, f"the scheduler process is not running ({exc})", code="scheduler_dead") from exc
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            where = f" (dp rank {dp_rank})" if len(self.replicas) > 1 else ""
            raise APIError(503, f"the scheduler{where} did not answer {kind} within {timeout:g}s") from None
        finally:
            self._calls.pop(call_id, None)

    async def control_all(self, kind: str, timeout: float,
                          args: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                          ) -> list[tuple[bool, dict[str, Any]]]:
        """The same control call to every replica at once (``args``: one dict for all, or one per
        replica); their answers in ``dp_rank`` order."""
        per_rank = [args] * len(self.replicas) if args is None or isinstance(args, dict) else list(args)
        calls = [self.control(kind, timeout, per_rank[r.dp_rank], r.dp_rank) for r in self.replicas]
        return list(await asyncio.gather(*calls))

    async def refresh_load(self) -> None:
        try:
            results = await self.control_all("get_load", LOAD_REFRESH_TIMEOUT_S)
        except APIError:  # /metrics still renders, with the last known gauges
            self.refresh_gauges()
            return
        for replica, (ok, load) in zip(self.replicas, results, strict=True):
            if ok:
                replica.last_load = load
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """The /metrics load gauges from the replicas' last reports, summed over replicas."""
        self.last_load = combined_load([r.last_load for r in self.replicas])
        self.metrics.update_load(self.last_load)

    def num_active(self) -> int:
        return len(self._routes)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise APIError(503, f"the scheduler process is not running ({self.dead})", code="scheduler_dead")

    def _forget(self, group: RequestGroup) -> None:
        group.end_waits()
        self._groups.pop(group.rid, None)
        for rid in group.rids:
            if self._routes.get(rid, (None,))[0] is group:
                self._drop_route(rid)

    def _drop_route(self, rid: str) -> None:
        group = self._routes.pop(rid)[0]
        self.replicas[group.dp_rank].in_flight -= 1

    # -- receiving ---------------------------------------------------------------------------

    def _on_message(self, data: memoryview, replica: Replica) -> None:
        try:
            self._dispatch(ipc.decode_from_scheduler(data), replica)
        except Exception:  # one bad message must not stop the delivery of all others
            logger.exception("failed to handle a message from the scheduler (dp rank %s)", replica.dp_rank)

    def _dispatch(self, msg: ipc.FromScheduler, replica: Replica) -> None:
        if isinstance(msg, ipc.Outputs):
            # The /metrics gauges are computed from this when they are read (refresh_load), not
            # per message: a message arrives per step.
            if msg.load is not None:
                replica.last_load = msg.load
            firsts: dict[str, RequestGroup] = {}
            for out in msg.outputs:
                group = self._on_output(out, replica.dp_rank)
                if group is not None:
                    firsts[group.rid] = group
            if msg.ack_id:
                self._ack_when_delivered(replica, msg.ack_id, list(firsts.values()))
        elif isinstance(msg, ipc.Rejected):
            self._on_rejected(msg, replica.dp_rank)
        elif isinstance(msg, ipc.ControlReply):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result((msg.ok, msg.data))

    def _ack_when_delivered(self, replica: Replica, ack_id: int, groups: list[RequestGroup]) -> None:
        """Answer the scheduler's wait (``server.first_token_wait_ms``) once every group that got
        its first token in this message has consumed it: a stream has written it to its client."""
        left = [len(groups)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._send_soon(replica, ipc.Delivered(ack_id=ack_id))

        if not groups:
            self._send_soon(replica, ipc.Delivered(ack_id=ack_id))
        for group in groups:
            group.when_drained(one_done)

    def _send_soon(self, replica: Replica, msg: ipc.ToScheduler) -> None:
        """Send from a callback; a failure is logged (the scheduler's death is handled elsewhere)."""
        if self.dead is not None:
            return
        try:
            replica.channel.send(ipc.encode(msg))
        except ChannelClosed as exc:
            logger.warning("could not send %s to dp rank %s: %s", type(msg).__name__, replica.dp_rank, exc)

    def _on_output(self, out: Any, dp_rank: int) -> RequestGroup | None:
        """Apply one output delta to its request; the group if this was the request's first token."""
        route = self._routes.get(out.rid)
        if route is None or route[0].dp_rank != dp_rank:
            return None  # an aborted request's last delta (its id may be in use again elsewhere), a rejected sibling
        group, index = route
        state = group.states[index]
        had_first = state.first_token_at is not None
        previous_at = state.last_token_at
        try:
            delta = state.apply(out)
        except Exception as exc:  # a detokenizer bug fails its own request, which must not hang
            logger.exception("failed to apply the output of request %s", out.rid)
            group.fail(APIError(500, f"internal error while detokenizing: {type(exc).__name__}", type="server_error"))
            return None
        first = not had_first and state.first_token_at is not None
        if first:
            self.metrics.first_token(state.first_token_at - state.created)
        if out.new_token_ids and state.last_token_at is not None:
            self.metrics.tokens(len(out.new_token_ids), previous_at, state.last_token_at)
        if state.finished:
            self._drop_route(out.rid)
            reason = (state.finish_reason or {}).get("type", "abort")
            self.metrics.finished(reason, state.prompt_tokens, state.completion_tokens, state.cached_tokens,
                                  state.created, state.first_token_at)
        group.queue.put_nowait(Event(index, delta, state.finished))
        if group.finished:
            self._groups.pop(group.rid, None)
        return group if first else None

    def _on_rejected(self, msg: ipc.Rejected, dp_rank: int) -> None:
        route = self._routes.get(msg.rids[0]) if msg.rids else None
        if route is None or route[0].dp_rank != dp_rank:
            return
        group = route[0]
        headers = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)} if msg.status == 503 else None
        code = "queue_full" if msg.status == 503 else "invalid_request"
        self.metrics.rejected()
        self._forget(group)
        group.fail(APIError(msg.status, msg.message, headers=headers, code=code))
