"""The scheduler process: model runner + scheduler, driven by messages from the HTTP process.

It is started with multiprocessing's ``spawn`` (a fresh interpreter: no inherited locks, CUDA
state or event loop) and loads plugins itself, like every plugserve process. The loop receives
requests, aborts and control calls, runs ``scheduler.step()`` while there is work, blocks on the
socket while idle, and sends each step's output deltas back.

One bad request must not kill the server: admission errors are answered per HTTP request, a
control call that fails answers ``ok=False``, and a step that raises fails only the requests that
were in flight (running or being prefilled) while the waiting ones stay queued.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from framework.server import ipc
from framework.server.channel import ChannelClosed, SocketChannel

logger = logging.getLogger("plugserve.scheduler_process")

LOAD_REPORT_INTERVAL_S = 0.1
"""How often a step's :class:`~framework.server.ipc.Outputs` carries the scheduler's load (the
/metrics gauges' fallback when a fresh report does not come in time); building and decoding it
every step is work on the path of every token."""

PARENT_CHECK_INTERVAL_MS = 1000
"""While idle, the loop wakes this often to check that the HTTP process is still alive, so the
scheduler never outlives a parent that was killed with SIGKILL."""


class SchedulerLoop:
    """Owns the scheduler and its channel to the HTTP process; :meth:`run` returns when told to
    stop or when the HTTP process is gone."""

    def __init__(self, scheduler: Any, runner: Any, eos_token_ids: list[int], channel: SocketChannel,
                 parent_pid: int, dp_rank: int = 0, first_token_wait_s: float = 0.0) -> None:
        self.scheduler = scheduler
        self.first_token_wait_s = first_token_wait_s
        """``server.first_token_wait_ms``: the longest wait for a :class:`~framework.server.ipc.Delivered`."""
        self._ack_ids = itertools.count(1)
        self._load_sent_at = float("-inf")
        self.first_token_waits = {"delivered": 0, "timed_out": 0, "late": 0}
        """How the waits for a Delivered ended (in /server_info): in time, past the bound, and
        how many Delivered came after their wait had ended."""
        self.dp_rank = dp_rank
        """This replica's data-parallel rank (reported in every load, for /get_load)."""
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.channel = channel
        self.parent_pid = parent_pid
        self.stopping = False
        self._deferred: list[ipc.Control] = []
        """Exclusive rollout calls waiting for the model to be free (see framework.scheduler.rollout)."""

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except ChannelClosed as exc:
            logger.warning("the HTTP process is gone (%s); the scheduler exits", exc)

    def _run(self) -> None:
        while not self.stopping:
            self._receive(block=not self.scheduler.has_work())
            if self.stopping:
                break
            self._run_deferred()
            self._check_ranks()
            if self.scheduler.has_work():
                outputs = self._step()
                if outputs:
                    self._send_outputs(outputs)
            if os.getppid() != self.parent_pid:
                logger.warning("the HTTP process is gone; the scheduler exits")
                break

    def _send_outputs(self, outputs: list) -> None:
        """Send a step's outputs; if one is a first token and another step is due, wait (bounded)
        until the HTTP process has written it.

        Why: on a machine with as many compute threads as cores, the next step's threads take
        every core the moment it starts, and the token still has to reach the HTTP process's
        event loop, which waits for a core. On 2 cores a trace once measured 5-6 ms
        for that hop; another day its median was ~0 either way and the wait cut its 90th
        percentile from 4-6 ms to 1-3.6 (docs/benchmarks.md). While the scheduler waits here its
        main thread sleeps and the HTTP process runs at once.
        """
        more = self.scheduler.has_work()
        ack_id = 0
        if more and self.first_token_wait_s > 0 and any(_is_first_token(o) for o in outputs):
            ack_id = next(self._ack_ids)
        load = None
        now = time.monotonic()
        if not more or now - self._load_sent_at >= LOAD_REPORT_INTERVAL_S:
            load, self._load_sent_at = self.load(), now
        self.channel.send(ipc.encode(ipc.Outputs(outputs=outputs, load=load, ack_id=ack_id)))
        if ack_id:
            self._wait_delivered(ack_id)

    def _wait_delivered(self, ack_id: int) -> None:
        """Handle messages until the :class:`~framework.server.ipc.Delivered` for ``ack_id``
        arrives or ``first_token_wait_s`` has passed (a late one is only counted)."""
        deadline = time.monotonic() + self.first_token_wait_s
        while not self.stopping:
            remaining_ms = (deadline - time.monotonic()) * 1e3
            if remaining_ms <= 0 or not self.channel.poll(remaining_ms):
                self.first_token_waits["timed_out"] += 1
                return
            data = self.channel.recv()
            if data is None:
                continue
            msg = self._decode(data)
            if isinstance(msg, ipc.Delivered) and msg.ack_id == ack_id:
                self.first_token_waits["delivered"] += 1
                return
            if msg is not None:
                self._handle_message(msg)

    def _receive(self, block: bool) -> None:
        """Handle every message already queued; while idle, first wait for one."""
        if block and not self.channel.poll(PARENT_CHECK_INTERVAL_MS):
            return
        while not self.stopping:
            data = self.channel.recv()
            if data is None:
                return
            self._handle(data)

    @staticmethod
    def _decode(data: bytes) -> ipc.ToScheduler | None:
        try:
            return ipc.decode_to_scheduler(data)
        except Exception as exc:  # a malformed message is a bug in the HTTP process, not fatal
            logger.error("dropping an undecodable message: %s", exc)
            return None

    def _handle(self, data: bytes) -> None:
        msg = self._decode(data)
        if msg is not None:
            self._handle_message(msg)

    def _handle_message(self, msg: ipc.ToScheduler) -> None:
        if isinstance(msg, ipc.GenerateBatch):
            self._add(msg)
        elif isinstance(msg, ipc.Abort):
            for rid in msg.rids:
                self.scheduler.abort(rid)
        elif isinstance(msg, ipc.Control):
            from framework.scheduler.rollout import EXCLUSIVE_CALLS

            if msg.kind in EXCLUSIVE_CALLS:
                self._deferred.append(msg)
                self.scheduler.hold_admission = True  # running requests finish; waiting ones wait
            else:
                self._control(msg)
        elif isinstance(msg, ipc.Shutdown):
            self.stopping = True
        elif isinstance(msg, ipc.Delivered):  # its wait timed out: nothing to do but count it
            self.first_token_waits["late"] += 1

    def _add(self, batch: ipc.GenerateBatch) -> None:
        from framework.multimodal.inputs import MultimodalInputs
        from framework.sampling.params import SamplingParams
        from framework.scheduler.admission import AdmissionError, UnavailableError
        from framework.scheduler.request import Req

        added: list[str] = []
        group = batch.reqs[0].rid if len(batch.reqs) > 1 else None  # unique while any of them lives
        try:
            for g in batch.reqs:
                req = Req(
                    rid=g.rid,
                    input_ids=g.input_ids,
                    sampling_params=SamplingParams.from_dict(g.sampling_params),
                    eos_token_ids=self.eos_token_ids,
                    return_logprob=g.return_logprob,
                    top_logprobs_num=g.top_logprobs_num,
                    logprob_start_len=g.logprob_start_len,
                    bootstrap_host=g.bootstrap_host,
                    bootstrap_port=g.bootstrap_port,
                    bootstrap_room=g.bootstrap_room,
                    group=group,
                    priority=g.priority,
                    token_ids_logprob=g.token_ids_logprob,
                    mm_inputs=MultimodalInputs.from_wire(g.mm_inputs) if g.mm_inputs is not None else None,
                )
                self.scheduler.add_request(req)
                added.append(g.rid)
            return
        except UnavailableError as exc:  # queue full, memory released
            status, message = 503, str(exc)
        except (AdmissionError, ValueError, TypeError) as exc:
            status, message = 400, str(exc)
        except Exception as exc:  # never let one request take the loop down
            logger.exception("admitting a request failed")
            status, message = 400, f"the request could not be admitted: {exc}"
        for rid in added:  # all or nothing: withdraw the siblings admitted before the failure
            self.scheduler.abort(rid)
        rids = [g.rid for g in batch.reqs]
        self.channel.send(ipc.encode(ipc.Rejected(rids=rids, message=message, status=status)))

    def _run_deferred(self) -> None:
        """Run the exclusive calls that waited, once the model is free."""
        while self._deferred and self.scheduler.rollout.ready():
            self._control(self._deferred.pop(0))
        self.scheduler.hold_admission = bool(self._deferred)

    def _control(self, msg: ipc.Control) -> None:
        from framework.scheduler.rollout import RolloutError

        try:
            ok, data = True, self._control_data(msg.kind, msg.args)
        except RolloutError as exc:
            ok, data = False, {"error": exc.message, "status": exc.status, "param": exc.param}
        except Exception as exc:
            logger.exception("control call %s failed", msg.kind)
            ok, data = False, {"error": f"{type(exc).__name__}: {exc}"}
        if msg.kind == "flush_cache" and ok:
            ok = bool(data["flushed"])
        self.channel.send(ipc.encode(ipc.ControlReply(call_id=msg.call_id, ok=ok, data=data)))

    def _control_data(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        from framework.server.rollout_calls import dispatch

        if kind in ipc.ROLLOUT_KINDS:
            return dispatch(self.scheduler.rollout, kind, args)
        if kind == "flush_cache":
            return {"flushed": self.scheduler.flush_cache()}
        if kind == "get_load":
            return self.load()
        if kind == "server_info":
            return {
                "load": self.load(),
                "leak_report": self.scheduler.leak_report(),
                "model": self.runner.describe(),
                "num_requests": len(self.scheduler.requests),
                "scheduler_pid": os.getpid(),
                "tp_ranks": self._tp_ranks(),
                "gc_frozen_objects": gc.get_freeze_count(),
                "first_token_waits": dict(self.first_token_waits),
            }
        raise ValueError(f"unknown control call {kind!r}; known: {', '.join(ipc.CONTROL_KINDS)}")

    # -- one step, isolated ------------------------------------------------------------------

    def _tp_ranks(self) -> dict[str, int]:
        """Tensor-parallel rank -> pid on this host (rank 0 is this process)."""
        followers = getattr(self.scheduler, "followers", None)
        ranks = {"0": os.getpid()}
        if followers is not None:
            ranks.update({str(rank): proc.pid for rank, proc in followers.procs.items()})
        return ranks

    def _check_ranks(self) -> None:
        """With tensor parallelism: raise (and so stop the process) when a follower rank is gone."""
        followers = getattr(self.scheduler, "followers", None)
        if followers is not None:
            followers.check()

    def _step(self) -> list:
        try:
            return self.scheduler.step()
        except Exception as exc:
            self._check_ranks()  # a collective that failed because a rank died is fatal, not a bad batch
            logger.exception("a scheduler step failed; failing the requests that were in flight")
            self._fail_in_flight(f"internal error while running the batch: {type(exc).__name__}: {exc}")
            return []  # the aborts' outputs are pending: the next step() returns them

    def _fail_in_flight(self, message: str) -> None:
        """Abort every request that had left the waiting queue: the failed batch was among them.

        An abort that raises means the scheduler's state is broken: the process exits (non-zero)
        and the HTTP process reports the death instead of serving from a corrupt cache.
        """
        waiting = {id(r) for r in self.scheduler.waiting}
        victims = [rid for rid, r in list(self.scheduler.requests.items()) if id(r) not in waiting]
        for rid in victims:
            self.scheduler.abort(rid, message=message)

    def load(self) -> dict[str, Any]:
        s = self.scheduler
        load = s.load()
        seen = s.prompt_tokens_seen
        load["cache_hit_tokens"] = s.cache_hit_tokens
        load["prompt_tokens_seen"] = seen
        load["prefix_cache_hit_rate"] = s.cache_hit_tokens / seen if seen else 0.0
        load["dp_rank"] = self.dp_rank
        return load


def _is_first_token(out: Any) -> bool:
    """The output carries the request's first generated token(s)."""
    return bool(out.new_token_ids) and out.completion_tokens == len(out.new_token_ids)


def _build(config_path: str) -> tuple[Any, Any, list[int], dict[str, Any]]:
    """Resolve the config (plugins load here, in this process), build runner and scheduler."""
    from transformers import AutoTokenizer

    from framework.config.loader import resolve_config, to_settings
    from framework.disaggregation.factory import make_pd_side
    from framework.engine.engine import eos_token_ids
    from framework.engine.tensor_parallel import leader_start
    from framework.executor.model_runner import ModelRunner
    from framework.models.loader import load_generation_config
    from framework.plugins import get_plugins
    from framework.scheduler.scheduler import Scheduler

    cfg = resolve_config(config_path, preset=None)
    get_plugins().raise_for_errors()
    settings = to_settings(cfg)
    model_cfg = settings.model
    with leader_start(settings, config_path) as leader:  # rank 0: the other ranks start first
        tokenizer = None if model_cfg.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            model_cfg.tokenizer_path or model_cfg.path)
        comm = None if leader is None else leader.join()
        runner = ModelRunner(settings, progress=False)
        scheduler = Scheduler(settings, runner, tokenizer, pd_side=make_pd_side)
    if leader is not None:
        from framework.scheduler.replicated import ReplicatedScheduler

        scheduler = ReplicatedScheduler(scheduler, comm, leader.followers)
    eos = eos_token_ids(load_generation_config(model_cfg.path), tokenizer)
    info = {**runner.describe(), "context_length": scheduler.context_len,
            "max_running_requests": scheduler.max_running, "scheduler_pid": os.getpid(),
            "eos_token_ids": eos, "priority_scheduling": bool(getattr(scheduler.policy, "uses_priority", False)),
            "skip_tokenizer_init": model_cfg.skip_tokenizer_init}
    return scheduler, runner, eos, info


def _serve(config_path: str, channel: SocketChannel, parent_pid: int, dp_rank: int) -> int:
    """Build, announce readiness (or the start failure), and run the loop; the exit code."""
    try:
        scheduler, runner, eos, info = _build(config_path)
    except Exception as exc:
        logger.error("scheduler start failed:\n%s", traceback.format_exc())
        channel.send(ipc.encode(ipc.StartupFailed(message=f"{type(exc).__name__}: {exc}")))
        return 1
    from framework.memory.gc_freeze import freeze_startup_objects

    info["gc_frozen_objects"] = freeze_startup_objects("scheduler")
    channel.send(ipc.encode(ipc.Ready(info={**info, "dp_rank": dp_rank})))
    try:
        wait_s = scheduler.settings.server.first_token_wait_ms / 1e3
        SchedulerLoop(scheduler, runner, eos, channel, parent_pid, dp_rank, first_token_wait_s=wait_s).run()
    finally:
        followers = getattr(scheduler, "followers", None)
        if followers is not None:  # tell the other tensor-parallel ranks to stop, and wait for them
            scheduler.close()
            followers.stop(timeout=10)
    return 0


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(config_path: str, channel_path: str, parent_pid: int, log_level: str, dp_rank: int = 0) -> None:
    """Entry point of the spawned process (arguments are plain strings and ints: nothing is
    unpickled beyond them). ``channel_path``: the HTTP process's listening socket for this
    scheduler (``framework.server.channel``); ``dp_rank``: which data-parallel replica this is
    (0 without dp)."""
    # Ctrl-C in a terminal reaches the whole process group: the HTTP process decides when the
    # scheduler stops (it sends Shutdown), so the scheduler ignores SIGINT itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from framework.memory.heap import claim_process

    claim_process()
    # tqdm (weight loading) otherwise creates a multiprocessing lock: a named semaphore that the
    # resource tracker reports as leaked after the fast exit below. A thread lock is all we need.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s [scheduler{f' dp{dp_rank}' if dp_rank else ''}] %(levelname)s %(name)s: %(message)s",
    )
    # What was sent before the close below is still delivered: the kernel holds it for the peer.
    channel = SocketChannel.connect(channel_path)
    code = 0
    try:
        code = _serve(config_path, channel, parent_pid, dp_rank)
    except SystemExit:
        pass
    except ChannelClosed as exc:
        logger.warning("the HTTP process is gone (%s); the scheduler exits", exc)
    except BaseException:
        logger.critical("the scheduler loop died:\n%s", traceback.format_exc())
        code = 1
    finally:
        channel.close()
    # Everything is closed and flushed below; skipping the interpreter's teardown (seconds with
    # torch loaded on a busy machine) lets the HTTP process finish its shutdown sooner.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
