"""Tensor parallelism at the scheduler: every rank runs the same scheduler on the same inputs.

Rank 0 (the one the HTTP process or the Engine talks to) wraps its scheduler in
:class:`ReplicatedScheduler`: each call that changes scheduler state (a request admitted or
aborted, a step, a flush, an RL call, the admission hold) is first broadcast to the other ranks
as a small msgpack message, then run here. The other ranks run :func:`follow`, which replays the
messages on their own scheduler. As in SGLang, the scheduler is deterministic given its inputs,
so every rank forms the same batches in the same order: the collectives inside the forward line
up, and since the logits are gathered before sampling (same seeds, same RNG use) every rank
samples the same tokens. Only rank 0 reports outputs. Broadcasting the inputs rather than each
step's decisions keeps the followers' code the scheduler's own code (no second path to keep in
step), at the cost of one broadcast per call (a few hundred bytes; measured in docs/benchmarks.md).

What would break determinism is kept out: a request's arrival time is rank 0's; compiled grammars
are awaited before admission when tp_size > 1 (``framework.scheduler.grammar_steps.admit_compiled``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from framework.distributed.communicator import Communicator
from framework.multimodal.inputs import MultimodalInputs
from framework.sampling.params import SamplingParams
from framework.scheduler.request import Req
from framework.scheduler.rollout import tensors_from_bytes, tensors_to_bytes

if TYPE_CHECKING:
    from framework.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_REQ_FIELDS = ("rid", "input_ids", "eos_token_ids", "return_logprob", "top_logprobs_num", "logprob_start_len",
               "arrival_time", "group", "priority", "token_ids_logprob", "bootstrap_host", "bootstrap_port",
               "bootstrap_room")
#: Rollout calls that change state on every rank (the others are reads, answered by rank 0).
_MIRRORED_ROLLOUT = ("pause", "continue_generation", "release_memory", "resume_memory", "update_from_disk",
                     "update_from_tensors", "init_group", "destroy_group", "update_from_distributed")

_encoder = msgspec.msgpack.Encoder()


def req_to_wire(req: Req) -> dict[str, Any]:
    """What another rank needs to build the same :class:`Req` (plain msgpack types)."""
    out = {name: getattr(req, name) for name in _REQ_FIELDS}
    out["sampling_params"] = req.sampling_params.to_dict()
    if req.mm_inputs is not None:  # every rank's model places the images itself
        out["mm_inputs"] = req.mm_inputs.to_wire()
    return out


def req_from_wire(data: dict[str, Any]) -> Req:
    fields = {k: v for k, v in data.items() if k not in ("sampling_params", "mm_inputs")}
    mm = data.get("mm_inputs")
    return Req(sampling_params=SamplingParams.from_dict(data["sampling_params"]),
               mm_inputs=None if mm is None else MultimodalInputs.from_wire(mm), **fields)


class _RolloutProxy:
    """``scheduler.rollout`` on rank 0: state-changing calls reach every rank."""

    def __init__(self, owner: ReplicatedScheduler) -> None:
        self._owner = owner
        self._rollout = owner.inner.rollout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._rollout, name)
        if name not in _MIRRORED_ROLLOUT:
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            wire_args = list(args)
            if name == "update_from_tensors":
                wire_args[0] = tensors_to_bytes(list(args[0]))
            self._owner.send(["rollout", name, wire_args, kwargs])
            return attr(*args, **kwargs)

        return mirrored


class ReplicatedScheduler:
    """Rank 0's scheduler: reads go to it directly, state changes reach every rank first."""

    def __init__(self, scheduler: Scheduler, comm: Communicator, followers: Any = None) -> None:
        object.__setattr__(self, "inner", scheduler)
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "followers", followers)
        """This host's follower processes (``check()`` raises naming a dead rank), or None."""
        object.__setattr__(self, "rollout", _RolloutProxy(self))

    def _raise_if_a_rank_died(self) -> None:
        """A collective failed: if it is because a rank died, say which (raises); else return."""
        if self.followers is not None:
            self.followers.check()

    def send(self, op: list[Any]) -> None:
        """Broadcast one operation to the follower ranks."""
        try:
            self.comm.broadcast_bytes(_encoder.encode(op), src=0)
        except Exception:
            self._raise_if_a_rank_died()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "hold_admission":
            self.send(["set", name, bool(value)])
        setattr(self.inner, name, value)

    def add_request(self, req: Req) -> None:
        self.send(["add", req_to_wire(req)])
        self.inner.add_request(req)

    def abort(self, rid: str, message: str | None = None) -> bool:
        self.send(["abort", rid, message])
        return self.inner.abort(rid, message)

    def step(self) -> list:
        self.send(["step"])
        try:
            return self.inner.step()
        except Exception:  # the forward's collectives fail when a rank dies mid-step
            self._raise_if_a_rank_died()
            raise

    def flush_cache(self) -> bool:
        self.send(["flush"])
        return self.inner.flush_cache()

    def leak_report(self) -> dict[str, Any]:
        """Rank 0's KV report, with every follower's own under ``tp_ranks`` (each rank holds its
        own KV pages: a leak on one rank alone would not show in rank 0's figures)."""
        self.send(["leak"])
        report: dict[str, Any] = dict(self.inner.leak_report())
        report["tp_ranks"] = [msgspec.msgpack.decode(self.comm.broadcast_bytes(None, src=r))
                              for r in range(1, self.comm.size)]
        return report

    def close(self) -> None:
        """Stop the followers (they leave :func:`follow`) and this scheduler."""
        try:
            self.send(["close"])
        except Exception as exc:  # a follower already gone: nothing to tell
            logger.warning("could not tell the tensor-parallel followers to stop: %s", exc)
        self.inner.close()


def follow(scheduler: Scheduler, comm: Communicator) -> None:
    """A follower rank's loop: replay rank 0's operations until it closes (a broadcast that fails
    because rank 0 is gone raises, and the process exits)."""
    decoder = msgspec.msgpack.Decoder()
    while True:
        op = decoder.decode(comm.broadcast_bytes(None, src=0))
        kind = op[0]
        if kind == "close":
            scheduler.close()
            return
        try:
            _apply(scheduler, comm, kind, op)
        except Exception as exc:
            # Rank 0 ran the same call on the same state and met the same error; it decides what
            # follows (an abort, a 400), and those decisions arrive here as further operations.
            logger.debug("replayed %s raised %s: %s", kind, type(exc).__name__, exc)


def _apply(scheduler: Scheduler, comm: Communicator, kind: str, op: list[Any]) -> None:
    if kind == "step":
        scheduler.step()  # the outputs are rank 0's to report
    elif kind == "add":
        scheduler.add_request(req_from_wire(op[1]))
    elif kind == "abort":
        scheduler.abort(op[1], op[2])
    elif kind == "flush":
        scheduler.flush_cache()
    elif kind == "leak":  # each follower answers in rank order (a broadcast from it)
        for r in range(1, comm.size):
            mine = _encoder.encode(scheduler.leak_report()) if r == comm.rank else None
            comm.broadcast_bytes(mine, src=r)
    elif kind == "set":
        setattr(scheduler, op[1], op[2])
    elif kind == "rollout":
        name, args, kwargs = op[1], list(op[2]), dict(op[3])
        if name == "update_from_tensors":
            args[0] = tensors_from_bytes(args[0])
        if name == "init_group":  # each rank joins the trainer's group as its own rank
            args[2] = int(args[2]) + comm.rank
        getattr(scheduler.rollout, name)(*args, **kwargs)
    else:
        raise ValueError(f"unknown replicated operation {kind!r}")
