"""``plugserve serve``: bind the port, start the scheduler process, serve HTTP, stop cleanly.

Process layout::

    HTTP process (this one)                     scheduler process (spawned)
      uvicorn + Starlette, asyncio                ModelRunner + Scheduler
      TokenizerManager  --PUSH ipc://.../in-->    PULL: GenerateBatch / Abort / Control / Shutdown
                        <--PULL ipc://.../out--   PUSH: Ready / Outputs / Rejected / ControlReply

Shutdown: SIGINT/SIGTERM make uvicorn stop accepting and let open requests finish (up to
``server.shutdown_timeout_s``), then the scheduler gets Shutdown, then SIGTERM, then SIGKILL. If
the scheduler process dies, pending requests fail at once, /health answers 503, and the server
exits with status 1. The scheduler also exits by itself if this process disappears.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from omegaconf import DictConfig, OmegaConf

from framework.config.loader import public_config, to_settings
from framework.config.schema import PlugserveConfig
from framework.server import scheduler_process

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from framework.server.metrics import ServerMetrics
    from framework.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("plugserve.server")

EXIT_OK, EXIT_FAILED = 0, 1
DEAD_SCHEDULER_GRACE_S = 1.0
"""After the scheduler process died, /health keeps answering 503 this long before the server
exits, so that probes and load balancers see the failure rather than a refused connection."""


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a busy port fails in a second, not after the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _write_child_config(cfg: DictConfig, run_dir: str) -> str:
    """The resolved config for the scheduler process, as YAML it resolves again (and so
    validates again, with the plugins it loads itself); keys are left out: it never needs them."""
    child = public_config(cfg, replacement=None)
    path = Path(run_dir) / "scheduler.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(child)))
    return str(path)


def serve(cfg: DictConfig) -> int:
    """Run the server until SIGINT/SIGTERM (exit status 0) or a failure (1)."""
    settings = to_settings(cfg)
    level = settings.server.log_level.upper()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s [http] %(levelname)s %(name)s: %(message)s")
    try:
        sock = _bind(settings.server.host, settings.server.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%s: %s", settings.server.host, settings.server.port, exc)
        return EXIT_FAILED
    with sock, tempfile.TemporaryDirectory(prefix="plugserve-") as run_dir:
        return asyncio.run(_serve(cfg, settings, sock, run_dir))


async def _serve(cfg: DictConfig, settings: PlugserveConfig, sock: socket.socket, run_dir: str) -> int:
    from transformers import AutoTokenizer

    from framework.models.loader import load_generation_config
    from framework.server.metrics import ServerMetrics
    from framework.server.tokenizer_manager import SchedulerStartError, TokenizerManager

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    model = settings.model
    try:
        tokenizer = None if model.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            model.tokenizer_path or model.path)
    except Exception as exc:  # a wrong path is a user error: one line, not a traceback
        logger.error("cannot load the tokenizer of %s: %s", model.tokenizer_path or model.path, exc)
        return EXIT_FAILED
    from framework.server.state import served_model_name

    metrics = ServerMetrics(served_model_name(settings), settings.server.sglang_metric_names)
    to_addr, from_addr = f"ipc://{run_dir}/to_scheduler", f"ipc://{run_dir}/from_scheduler"
    manager = TokenizerManager(tokenizer, metrics, to_addr, from_addr)
    proc = multiprocessing.get_context("spawn").Process(
        target=scheduler_process.main,
        args=(_write_child_config(cfg, run_dir), to_addr, from_addr, os.getpid(), settings.server.log_level),
        name="plugserve-scheduler",
        daemon=True,  # multiprocessing's exit handler terminates it even on an unexpected exit path
    )
    proc.start()
    exited = asyncio.Event()
    loop.add_reader(proc.sentinel, exited.set)
    try:
        try:
            info = await _wait_ready(manager, proc, stop, exited, settings.server.scheduler_start_timeout_s)
        except SchedulerStartError as exc:
            logger.error("the scheduler process failed to start: %s", exc)
            return EXIT_FAILED
        if info is None:
            return EXIT_OK if stop.is_set() else EXIT_FAILED
        manager.start()
        app = _make_app(cfg, settings, tokenizer, manager, metrics, info, load_generation_config(model.path))
        server = _http_server(app, settings, manager)
        watch = loop.create_task(_watch(server, manager, proc, stop, exited))
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%s (scheduler pid %s)", model.path, host, port, proc.pid)
        await server.serve(sockets=[sock])
        watch.cancel()
        return EXIT_FAILED if manager.dead is not None else EXIT_OK
    finally:
        loop.remove_reader(proc.sentinel)
        await _stop_scheduler(manager, proc, settings.server.shutdown_timeout_s)
        await manager.close()


def _http_server(app: Starlette, settings: PlugserveConfig, manager: TokenizerManager) -> uvicorn.Server:
    """uvicorn over the guarded app and connection protocol, with plugserve's graceful drain."""
    from framework.server.connection import ConnectionLimits, protocol_class
    from framework.server.graceful import GracefulServer, uvicorn_timeout
    from framework.server.request_guard import (
        GuardLimits,
        Lifecycle,
        RequestGuard,
        bearer_matches,
        shutting_down_error,
    )

    opts = settings.server
    lifecycle = Lifecycle()
    limits = GuardLimits(
        opts.max_body_bytes, opts.body_read_timeout_s,
        large_bodies={"/update_weights_from_tensor": (opts.max_weight_update_bytes, "server.max_weight_update_bytes")},
        large_body_allowed=bearer_matches(opts.admin_key or opts.api_key),
    )
    guarded = RequestGuard(app, limits, lifecycle)
    config = uvicorn.Config(
        guarded, log_level=opts.log_level, access_log=opts.log_requests, lifespan="off",
        http=protocol_class(ConnectionLimits(opts.max_connections, opts.header_read_timeout_s)),
        timeout_keep_alive=opts.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn takes float seconds
        timeout_graceful_shutdown=uvicorn_timeout(opts.shutdown_timeout_s),
    )
    return GracefulServer(config, lifecycle, opts.shutdown_timeout_s,
                          lambda: manager.fail_all(shutting_down_error()))


def _make_app(cfg: DictConfig, settings: PlugserveConfig, tokenizer: Any, manager: TokenizerManager,
              metrics: ServerMetrics, info: dict[str, Any], generation_defaults: dict[str, Any]) -> Starlette:
    from framework.server.app import build_app
    from framework.server.openai_format import TokenText
    from framework.server.request_builder import RequestBuilder
    from framework.server.state import ServerState, served_model_name
    from framework.server.structured import load_output_plugins

    builder = RequestBuilder(tokenizer, generation_defaults, info, settings.server)
    builder.grammar, tool_parser, reasoning_parser = load_output_plugins(settings, tokenizer, int(info["vocab_size"]))
    state = ServerState(cfg=cfg, settings=settings, tokenizer=tokenizer, manager=manager, builder=builder,
                        metrics=metrics, model_info=info, token_text=TokenText(tokenizer),
                        model_name=served_model_name(settings), tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser)
    return build_app(state)


async def _wait_ready(manager: TokenizerManager, proc: BaseProcess, stop: asyncio.Event, exited: asyncio.Event,
                      timeout: float) -> dict[str, Any] | None:
    """The scheduler's Ready info; None if we were stopped, it died, or it took too long."""
    ready = asyncio.ensure_future(manager.wait_ready())
    others = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(exited.wait())]
    start = time.monotonic()
    done, pending = await asyncio.wait([ready, *others], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if ready in done:
        return ready.result()  # raises SchedulerStartError
    if stop.is_set():
        logger.info("stopped while the model was loading")
    elif exited.is_set():
        proc.join(1.0)  # the sentinel closes a moment before the exit status is ready
        logger.error("the scheduler process exited during start (exit code %s)", proc.exitcode)
    else:
        logger.error("the scheduler was not ready after %.0fs (server.scheduler_start_timeout_s)",
                     time.monotonic() - start)
    return None


async def _watch(server: uvicorn.Server, manager: TokenizerManager, proc: BaseProcess, stop: asyncio.Event,
                 exited: asyncio.Event) -> None:
    """Stop serving on a signal that reached our own handler, or when the scheduler dies."""
    stop_wait = asyncio.ensure_future(stop.wait())
    exit_wait = asyncio.ensure_future(exited.wait())
    try:
        await asyncio.wait([stop_wait, exit_wait], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        exit_wait.cancel()
    if exited.is_set():
        proc.join(1.0)  # the sentinel closes a moment before the exit status is ready
        logger.error("the scheduler process died (exit code %s); failing pending requests", proc.exitcode)
        manager.on_scheduler_death(f"exit code {proc.exitcode}")
        await asyncio.sleep(DEAD_SCHEDULER_GRACE_S)
    server.should_exit = True


async def _stop_scheduler(manager: TokenizerManager, proc: BaseProcess, grace_s: float) -> None:
    """Shutdown message, then SIGTERM, then SIGKILL; returns once the process is gone."""
    if proc.is_alive():
        try:
            await asyncio.wait_for(manager.shutdown_scheduler(), 1.0)
        except Exception:  # the socket may be gone already; escalate below
            pass
    for action in (None, proc.terminate, proc.kill):
        if action is not None and proc.is_alive():
            action()
        deadline = time.monotonic() + grace_s
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not proc.is_alive():
            break
    proc.join(1.0)
