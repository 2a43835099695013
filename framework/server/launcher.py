"""``plugserve serve``: bind the port, start the scheduler process, serve HTTP, stop cleanly.

Process layout::

    HTTP process (this one)                     scheduler process (spawned)
      uvicorn + Starlette, asyncio                ModelRunner + Scheduler
      TokenizerManager  --> GenerateBatch / Abort / Control / Shutdown / Delivered -->  SchedulerLoop
                        <-- Ready / Outputs / Rejected / ControlReply <--
                        (one Unix socket, .../scheduler_<rank>: framework.server.channel)

With ``parallel.dp_size`` = N there are N scheduler processes (``dp_rank`` 0..N-1), each with
its own channel path; the TokenizerManager load-balances requests over them
(``framework.server.data_parallel``).

Shutdown: SIGINT/SIGTERM make uvicorn stop accepting and let open requests finish (up to
``server.shutdown_timeout_s``), then every scheduler gets Shutdown, then SIGTERM, then SIGKILL. If
any scheduler process dies, pending requests fail at once, /health answers 503, the others are
stopped and the server exits with status 1. A scheduler also exits by itself if this process
disappears.
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
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from omegaconf import DictConfig, OmegaConf

from framework.config.loader import public_config, to_settings
from framework.config.schema import PlugserveConfig
from framework.memory.gc_freeze import freeze_startup_objects
from framework.server import scheduler_process
from framework.server.data_parallel import Replica, listen_replicas
from framework.server.http_stack import resolve_event_loop, resolve_http_parser
from framework.server.http_stack import run as run_loop

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from framework.server.image_inputs import ImageFrontend
    from framework.server.metrics import ServerMetrics
    from framework.server.prestart import PrestartedProcess
    from framework.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("plugserve.server")

EXIT_OK, EXIT_FAILED = 0, 1
DEAD_SCHEDULER_GRACE_S = 1.0
"""After the scheduler process died, /health keeps answering 503 this long before the server
exits, so that probes and load balancers see the failure rather than a refused connection."""


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a busy port fails in a second, not after the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says
    # TCP. Without it every keep-alive response's second small write (the first SSE event, [DONE])
    # waited for the client's delayed ACK: +40 ms per streamed request, seen at one stream.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def serve(cfg: DictConfig, prestarted: PrestartedProcess | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (exit status 0) or a failure (1). ``prestarted``
    becomes the first scheduler process (the caller cancels it if it is not used)."""
    settings = to_settings(cfg)
    level = settings.server.log_level.upper()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s [http] %(levelname)s %(name)s: %(message)s")
    problem = _model_path_problem(settings.model.path)
    if problem:
        logger.error("model.path: %s", problem)
        return EXIT_FAILED
    if settings.parallel.node_rank > 0:
        return _serve_follower_node(cfg, settings)
    try:
        loop = resolve_event_loop(settings.server.event_loop)
        parser = resolve_http_parser(settings.server.http_parser)
    except (ImportError, ValueError) as exc:
        logger.error("%s", exc)
        return EXIT_FAILED
    try:
        sock = _bind(settings.server.host, settings.server.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%s: %s", settings.server.host, settings.server.port, exc)
        return EXIT_FAILED
    logger.info("HTTP: %s event loop, %s protocol", loop, parser)
    with sock, tempfile.TemporaryDirectory(prefix="plugserve-") as run_dir:
        return run_loop(_serve(cfg, settings, sock, run_dir, prestarted, parser), loop)


def _model_path_problem(path: str) -> str | None:
    """Why ``model.path`` cannot be a checkpoint, or None. Checked before any scheduler runs (the
    prestarted one waits for work), so a mistyped path is one line, not also its traceback."""
    if not Path(path).is_dir():
        return f"{path} is not a directory (plugserve loads a local Hugging Face checkpoint)"
    if not (Path(path) / "config.json").is_file():
        return f"{path} has no config.json (not a Hugging Face checkpoint)"
    return None


def _serve_follower_node(cfg: DictConfig, settings: PlugserveConfig) -> int:
    """``parallel.node_rank > 0``: no HTTP server here, only this host's tensor-parallel ranks,
    which join node 0's group at ``parallel.dist_init_addr`` and follow its rank 0."""
    from framework.engine.tensor_parallel import run_node_followers

    logger.info("node %d of %d: running tensor-parallel ranks for %s", settings.parallel.node_rank,
                settings.parallel.nnodes, settings.parallel.dist_init_addr)
    with tempfile.TemporaryDirectory(prefix="plugserve-node-") as run_dir:
        return run_node_followers(settings, _write_child_config(cfg, run_dir))


async def _serve(cfg: DictConfig, settings: PlugserveConfig, sock: socket.socket, run_dir: str,
                 prestarted: PrestartedProcess | None, parser: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dp_size = settings.parallel.dp_size
    channel_paths = [f"{run_dir}/scheduler_{r}" for r in range(dp_size)]
    config_path = _write_child_config(cfg, run_dir)
    procs: list[BaseProcess] = []
    exited = asyncio.Event()
    manager: TokenizerManager | None = None
    replicas: list[Replica] = []
    try:
        # The schedulers start first: their imports and model load (seconds) then overlap this
        # process's own imports and tokenizer load on the other core. Each connects to its
        # channel's path, listening from here on; the kernel holds the connection (and the
        # scheduler's first messages) until the manager accepts it.
        replicas = listen_replicas(channel_paths)
        for rank, path in enumerate(channel_paths):
            args = (config_path, path, os.getpid(), settings.server.log_level, rank)
            procs.append(_start_scheduler(args, f"plugserve-scheduler-dp{rank}" if dp_size > 1 else
                                          "plugserve-scheduler", prestarted if rank == 0 else None))
            loop.add_reader(procs[-1].sentinel, exited.set)
        loaded = _load_tokenizer(settings)
        if loaded is None:
            return EXIT_FAILED
        tokenizer, generation_defaults = loaded
        from framework.server.metrics import ServerMetrics
        from framework.server.state import served_model_name
        from framework.server.tokenizer_manager import SchedulerStartError, TokenizerManager

        metrics = ServerMetrics(served_model_name(settings), settings.server.sglang_metric_names)
        manager = TokenizerManager(tokenizer, metrics, replicas, settings.parallel.load_balance_method.value)
        try:
            info = await _wait_ready(manager, procs, stop, exited, settings.server.scheduler_start_timeout_s)
        except SchedulerStartError as exc:
            logger.error("the scheduler process failed to start: %s", exc)
            return EXIT_FAILED
        if info is None:
            return EXIT_OK if stop.is_set() else EXIT_FAILED
        manager.start()
        http_stack = {"event_loop": "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio",
                      "http_parser": parser}
        app = _make_app(cfg, settings, tokenizer, manager, metrics, info, generation_defaults, http_stack)
        server = _http_server(app, settings, manager, parser)
        freeze_startup_objects("HTTP server")
        watch = loop.create_task(_watch(server, manager, procs, stop, exited))
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%s (scheduler pid %s)", settings.model.path, host, port,
                    ", ".join(str(p.pid) for p in procs))
        await server.serve(sockets=[sock])
        watch.cancel()
        return EXIT_FAILED if manager.dead is not None else EXIT_OK
    finally:
        for proc in procs:
            if proc.pid is not None:  # started (an unstarted one has no sentinel)
                loop.remove_reader(proc.sentinel)
        await _stop_schedulers(manager, procs, settings.server.shutdown_timeout_s)
        if manager is not None:
            await manager.close()
        for replica in replicas:  # no manager (a failed start): the listeners are still open
            replica.channel.close()


def _start_scheduler(args: tuple[Any, ...], name: str, prestarted: PrestartedProcess | None) -> BaseProcess:
    """A scheduler process running ``scheduler_process.main(*args)``: the prestarted one if
    given, else a fresh spawn."""
    if prestarted is not None:
        proc = prestarted.run(scheduler_process.main, args)
        proc.name = name
        return proc
    proc = multiprocessing.get_context("spawn").Process(
        target=scheduler_process.main, args=args, name=name,
        daemon=True,  # multiprocessing's exit handler terminates it even on an unexpected exit path
    )
    proc.start()
    return proc


def _load_tokenizer(settings: PlugserveConfig) -> tuple[Any, dict[str, Any]] | None:
    """The tokenizer (None with ``model.skip_tokenizer_init``) and the model's generation
    defaults; None after logging why the tokenizer cannot load (a wrong path is a user error:
    one line, not a traceback)."""
    from transformers import AutoTokenizer

    from framework.models.loader import load_generation_config

    model = settings.model
    try:
        tokenizer = None if model.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            model.tokenizer_path or model.path)
    except Exception as exc:
        logger.error("cannot load the tokenizer of %s: %s", model.tokenizer_path or model.path, exc)
        return None
    return tokenizer, load_generation_config(model.path)


def _http_server(app: Starlette, settings: PlugserveConfig, manager: TokenizerManager,
                 parser: str) -> uvicorn.Server:
    """uvicorn over the guarded app and connection protocol (``parser``: httptools or h11), with
    plugserve's graceful drain."""
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
        http=protocol_class(ConnectionLimits(opts.max_connections, opts.header_read_timeout_s), parser),
        timeout_keep_alive=opts.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn takes float seconds
        timeout_graceful_shutdown=uvicorn_timeout(opts.shutdown_timeout_s),
    )
    return GracefulServer(config, lifecycle, opts.shutdown_timeout_s,
                          lambda: manager.fail_all(shutting_down_error()))


def _make_app(cfg: DictConfig, settings: PlugserveConfig, tokenizer: Any, manager: TokenizerManager,
              metrics: ServerMetrics, info: dict[str, Any], generation_defaults: dict[str, Any],
              http_stack: dict[str, str]) -> Starlette:
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
                        reasoning_parser=reasoning_parser, images=_image_frontend(settings, tokenizer),
                        http_stack=http_stack)
    return build_app(state)


def _image_frontend(settings: PlugserveConfig, tokenizer: Any) -> ImageFrontend:
    """The model's multimodal processor (None for a text-only model) behind the image limits; it
    runs here, in the HTTP process, so the scheduler never decodes an image."""
    from framework.models.loader import load_hf_config
    from framework.multimodal.factory import build_processor
    from framework.server.image_inputs import ImageFrontend
    from framework.server.images import ImageLoader

    model = settings.model
    hf_config = load_hf_config(model.path)
    processor = None if tokenizer is None else build_processor(os.fspath(model.path), hf_config, tokenizer,
                                                               model.architecture)
    arch = model.architecture or (getattr(hf_config, "architectures", None) or [""])[0]
    decode = settings.disaggregation.mode is not None and settings.disaggregation.mode.value == "decode"
    return ImageFrontend(processor, ImageLoader(settings.server), arch, send_inputs=not decode)


def _dead(procs: list[BaseProcess]) -> str:
    """Which scheduler processes exited, and how (``dp rank 1: exit code -9``)."""
    started = [p for p in procs if p.pid is not None]
    closed = set(wait_sentinels([p.sentinel for p in started], timeout=0))
    for proc in started:
        if proc.sentinel in closed:
            proc.join(1.0)  # the sentinel closes a moment before the exit status is ready
    dead = [(rank, p) for rank, p in enumerate(procs) if p.pid is not None and p.exitcode is not None]
    if len(procs) == 1:
        return ", ".join(f"exit code {p.exitcode}" for _, p in dead)
    return ", ".join(f"dp rank {rank}: exit code {p.exitcode}" for rank, p in dead)


async def _wait_ready(manager: TokenizerManager, procs: list[BaseProcess], stop: asyncio.Event,
                      exited: asyncio.Event, timeout: float) -> dict[str, Any] | None:
    """Replica 0's Ready info once every scheduler is ready; None if we were stopped, one died,
    or they took too long."""
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
        logger.error("the scheduler process exited during start (%s)", _dead(procs))
    else:
        logger.error("the scheduler was not ready after %.0fs (server.scheduler_start_timeout_s)",
                     time.monotonic() - start)
    return None


async def _watch(server: uvicorn.Server, manager: TokenizerManager, procs: list[BaseProcess],
                 stop: asyncio.Event, exited: asyncio.Event) -> None:
    """Stop serving on a signal that reached our own handler, or when any scheduler dies (one
    dead replica takes the whole server down: a half-capacity server that looks healthy to a
    load balancer is worse than a restart)."""
    stop_wait = asyncio.ensure_future(stop.wait())
    exit_wait = asyncio.ensure_future(exited.wait())
    try:
        await asyncio.wait([stop_wait, exit_wait], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        exit_wait.cancel()
    if exited.is_set():
        reason = _dead(procs)
        logger.error("the scheduler process died (%s); failing pending requests", reason)
        manager.on_scheduler_death(reason)
        await asyncio.sleep(DEAD_SCHEDULER_GRACE_S)
    server.should_exit = True


async def _stop_schedulers(manager: TokenizerManager | None, procs: list[BaseProcess], grace_s: float) -> None:
    """Shutdown message (when the manager was made), then SIGTERM, then SIGKILL, to all at once;
    returns once all are gone."""
    procs = [p for p in procs if p.pid is not None]  # a failed start may leave some unstarted
    if manager is not None and any(p.is_alive() for p in procs):
        try:
            await asyncio.wait_for(manager.shutdown_scheduler(), 1.0)
        except Exception:  # the socket may be gone already; escalate below
            pass
    for signal_name in (None, "terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        for p in alive if signal_name else []:
            getattr(p, signal_name)()
        deadline = time.monotonic() + grace_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    for p in procs:
        p.join(1.0)
