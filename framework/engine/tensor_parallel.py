"""Starting a tensor-parallel group: rank 0 in this process, one process per follower rank.

Rank 0 is whoever serves requests (the server's scheduler process, or the process of an
in-process :class:`~framework.engine.engine.Engine`). It picks the rendezvous (``parallel.
dist_init_addr``, else 127.0.0.1 and a free port), starts this host's other ranks as spawned
processes running :func:`follower_main`, joins the group, and wraps its scheduler in
:class:`~framework.scheduler.replicated.ReplicatedScheduler`. Followers build the same model
runner and scheduler from the same config (each loads only its shards) and replay rank 0's calls.
On hosts other than node 0, ``plugserve serve parallel.node_rank=N`` runs
:func:`run_node_followers` instead of a server.

Death: :class:`FollowerProcesses.check` tells rank 0 when a follower has exited (rank 0 then stops
with an error naming the rank); a follower whose rank 0 is gone fails its next broadcast and exits,
and it also watches its parent's pid, so no rank outlives the group.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
"""How often a follower checks that its parent (rank 0, or the node launcher) still lives."""


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone; the group cannot compute any more."""


def load_tokenizer(settings: Any) -> Any:
    """The model's tokenizer (None with ``model.skip_tokenizer_init``)."""
    from transformers import AutoTokenizer

    model = settings.model
    if getattr(model, "skip_tokenizer_init", False):
        return None
    return AutoTokenizer.from_pretrained(model.tokenizer_path or model.path)


def rendezvous(settings: Any) -> tuple[str, int]:
    """``parallel.dist_init_addr`` as (host, port), or 127.0.0.1 and a free port on one host."""
    addr = settings.parallel.dist_init_addr
    if addr:
        host, _, port = addr.rpartition(":")
        return host, int(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", s.getsockname()[1]


def local_ranks(settings: Any) -> list[int]:
    """The ranks this host runs (``tp_size / nnodes`` consecutive ones)."""
    per = settings.parallel.tp_size // settings.parallel.nnodes
    first = settings.parallel.node_rank * per
    return list(range(first, first + per))


def join_group(settings: Any, rank: int, host: str, port: int) -> Any:
    """This process's communicator (the configured plugin), made this process's tensor-parallel group."""
    import torch

    from framework.distributed.state import TensorParallel, set_tensor_parallel
    from framework.plugins import get_registry

    comp = get_registry().get("communicator", settings.parallel.communicator, key="parallel.communicator")
    comm = comp.factory(host, port, rank, settings.parallel.tp_size, torch.device(settings.device.device.value),
                        settings.parallel.dist_timeout_s, comp.make_options(settings.parallel.communicator_options))
    set_tensor_parallel(TensorParallel(rank, settings.parallel.tp_size, comm))
    return comm


class FollowerProcesses:
    """This host's follower ranks (spawned processes) and their liveness."""

    def __init__(self, procs: dict[int, Any]) -> None:
        self.procs = procs

    def check(self) -> None:
        """Raise :class:`RankDiedError` if a follower has exited."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                raise RankDiedError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for the followers to leave (after a close), then terminate any still there
        (``timeout=0``: at once)."""
        for proc in self.procs.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def write_config(settings: Any) -> str:
    """The resolved config as YAML for the followers (they resolve it again with their plugins)."""
    fd, path = tempfile.mkstemp(prefix="plugserve-tp-", suffix=".yaml")
    os.close(fd)
    OmegaConf.save(OmegaConf.structured(settings), path)
    return path


class RankProcess:
    """One follower rank's process (a fresh interpreter, like multiprocessing's spawn, but started
    with subprocess: the server's scheduler process is a daemon, and daemons may not use
    multiprocessing children)."""

    def __init__(self, args: list[str]) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "framework.engine.tensor_parallel", *args])
        self.pid = self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()


def spawn_followers(settings: Any, config_path: str, host: str, port: int, ranks: list[int]) -> FollowerProcesses:
    """Start one process per rank in ``ranks`` (never rank 0's own)."""
    log_level = getattr(settings.server, "log_level", "warning")
    procs = {rank: RankProcess([config_path, str(rank), host, str(port), str(os.getpid()), log_level])
             for rank in ranks}
    return FollowerProcesses(procs)


class LeaderStart:
    """Rank 0's side of starting the group, in two halves so rank 0 can work while its followers
    start: construction spawns this host's followers (a fresh interpreter each, seconds of imports
    before they can join), :meth:`join` joins the group (blocks until all joined) and returns rank
    0's communicator. Rank 0 loads its tokenizer in between. Use it through :func:`leader_start`.
    """

    def __init__(self, settings: Any, config_path: str | None = None) -> None:
        self.settings = settings
        self.host, self.port = rendezvous(settings)
        config_path = config_path or write_config(settings)
        self.followers = spawn_followers(settings, config_path, self.host, self.port,
                                         [r for r in local_ranks(settings) if r != 0])
        self.comm: Any = None

    def join(self) -> Any:
        """Join the group as rank 0; this process's communicator."""
        self.comm = join_group(self.settings, 0, self.host, self.port)
        return self.comm

    def abandon(self) -> None:
        """Terminate the followers (a follower waits in the rendezvous, or in rank 0's first
        broadcast, until its timeout otherwise) and drop the group, if joined."""
        self.followers.stop(timeout=0)
        if self.comm is not None:
            from framework.distributed.state import set_tensor_parallel

            self.comm.close()
            self.comm = None
            set_tensor_parallel(None)


@contextmanager
def leader_start(settings: Any, config_path: str | None = None) -> Iterator[LeaderStart | None]:
    """Spawn the followers when ``parallel.tp_size`` > 1 (None otherwise) for the block that builds
    rank 0; anything the block raises abandons them (:meth:`LeaderStart.abandon`) first."""
    leader = LeaderStart(settings, config_path) if settings.parallel.tp_size > 1 else None
    try:
        yield leader
    except BaseException:
        if leader is not None:
            leader.abandon()
        raise


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (SIGKILL'd rank 0 never says goodbye)."""
    while True:
        threading.Event().wait(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def follower_main(config_path: str, rank: int, host: str, port: int, parent_pid: int, log_level: str) -> None:
    """A follower rank's process: join the group, build the same runner and scheduler, replay."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [tp{rank}] %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not a multiprocessing semaphore, which os._exit would leak
    code = 0
    try:
        from framework.config.loader import resolve_config, to_settings
        from framework.disaggregation.factory import make_pd_side
        from framework.executor.model_runner import ModelRunner
        from framework.memory.gc_freeze import freeze_startup_objects
        from framework.memory.heap import claim_process
        from framework.scheduler.replicated import follow
        from framework.scheduler.scheduler import Scheduler

        claim_process()
        settings = to_settings(resolve_config(config_path, preset=None))
        comm = join_group(settings, rank, host, port)
        runner = ModelRunner(settings, progress=False)
        # The tokenizer too: stop strings and grammars decide when requests finish, on every rank.
        scheduler = Scheduler(settings, runner, load_tokenizer(settings), pd_side=make_pd_side)
        freeze_startup_objects(f"tensor-parallel rank {rank}")  # a rank's full collection stalls every rank
        follow(scheduler, comm)
    except Exception:
        logger.error("tensor-parallel rank %d stopped:\n%s", rank, traceback.format_exc())
        code = 1
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def run_node_followers(settings: Any, config_path: str) -> int:
    """``plugserve serve`` on a host with ``parallel.node_rank > 0``: run its ranks until they end."""
    host, port = rendezvous(settings)
    followers = spawn_followers(settings, config_path, host, port, local_ranks(settings))
    codes = []
    for proc in followers.procs.values():
        proc.join()
        codes.append(proc.exitcode)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    _config, _rank, _host, _port, _parent, _level = sys.argv[1:7]
    follower_main(_config, int(_rank), _host, int(_port), int(_parent), _level)
