"""A scheduler interpreter started before the config is resolved.

A spawned scheduler process spends most of a server's start importing torch and transformers
(seconds on a small machine), and the HTTP process spends its first seconds resolving the config
(which imports torch too, through the plugins). Neither needs the other for that, so ``plugserve
serve`` spawns the first scheduler process at once: it imports the heavy modules, then waits on a
pipe for the function and arguments the launcher hands it once the config is known. The two
processes' imports then overlap on two cores instead of running one after the other.

The warm process imports modules only: plugins load, and the config is read, after the hand-over,
exactly as in a scheduler spawned late. If the server never hands it over (a config error, a busy
port, a follower node), :meth:`PrestartedProcess.cancel` stops it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

WARM_MODULES = (
    "torch",
    "transformers",
    "framework.config.loader",
    "framework.executor.model_runner",
    "framework.scheduler.scheduler",
    "framework.server.scheduler_process",
)
"""What a scheduler imports before its first step, heaviest first (transformers' tokenizer
classes load lazily, on ``AutoTokenizer``'s first use, so they are named below)."""


def _warm_then_run(conn: Connection) -> None:
    """The spawned process: import, then run what the parent sends (or exit if it sends nothing)."""
    # Ctrl-C in a terminal reaches the whole process group; the HTTP process decides when a
    # scheduler stops (the scheduler ignores SIGINT too, once it runs).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in WARM_MODULES:
        importlib.import_module(name)
    from transformers import AutoTokenizer  # noqa: F401  # the lazy tokenizer classes

    try:
        target, args = conn.recv()
    except EOFError:  # cancelled, or the parent died while resolving its config
        return
    finally:
        conn.close()
    target(*args)


class PrestartedProcess:
    """One spawned interpreter importing :data:`WARM_MODULES` until :meth:`run` hands it a target.

    The same :class:`multiprocessing.Process` then runs the target, so its pid, sentinel and exit
    code are what the launcher watches, as for a process it spawned itself.
    """

    def __init__(self, name: str = "plugserve-scheduler") -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, self._conn = ctx.Pipe(duplex=False)
        # daemon: multiprocessing's exit handler terminates it even on an unexpected exit path
        self.process: BaseProcess | None = ctx.Process(target=_warm_then_run, args=(reader,), name=name, daemon=True)
        self.process.start()
        reader.close()

    def run(self, target: Callable[..., Any], args: tuple[Any, ...]) -> BaseProcess:
        """Hand over ``target(*args)`` (both picklable) and return the process now running it."""
        proc = self.process
        if proc is None:
            raise RuntimeError("this prestarted process was already handed over or cancelled")
        self.process = None
        self._conn.send((target, args))
        self._conn.close()
        return proc

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop the process if it was not handed over (a no-op after :meth:`run`)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        self._conn.close()
        proc.terminate()  # its imports are of no use now: no need to let them finish
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout)
