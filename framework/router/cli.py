"""The ``plugserve router`` command: PD pairs (``--prefill`` / ``--decode``) or unified servers
(``--worker-urls``)."""

from __future__ import annotations

import argparse

DEFAULT_BOOTSTRAP_PORT = 8998
"""A prefill server's bootstrap port when ``--prefill`` gives none (disaggregation.bootstrap_port)."""


def add_router_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="load balancer: unified servers (--worker-urls), or prefill + decode pairs")
    p.add_argument("--worker-urls", nargs="+", metavar="URL",
                   help="unified servers to balance over (instead of --prefill / --decode)")
    p.add_argument("--policy", choices=("round_robin", "shortest_queue"), default="round_robin",
                   help="with --worker-urls: how a worker is picked (shortest_queue: fewest requests open on it)")
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]",
                   help="a prefill server and its bootstrap port (repeat for more servers)")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode server (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout towards the servers")
    p.add_argument("--eject-s", type=float, default=2.0,
                   help="how long a server that refused a connection is tried last")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from framework.router.app import RouterConfig, build_app, parse_prefill_args
    from framework.router.unified import WorkerRouterConfig, build_worker_app

    pd = bool(args.prefill or args.decode)
    if bool(args.worker_urls) == pd:
        raise SystemExit("plugserve router: give either --worker-urls (unified servers) "
                         "or --prefill and --decode (PD), not both and not neither")
    if args.worker_urls:
        app = build_worker_app(WorkerRouterConfig([u.rstrip("/") for u in args.worker_urls], args.policy,
                                                  args.timeout_s, args.eject_s))
    else:
        if not (args.prefill and args.decode):
            raise SystemExit("plugserve router: PD mode needs at least one --prefill and one --decode")
        app = build_app(RouterConfig(parse_prefill_args(args.prefill, DEFAULT_BOOTSTRAP_PORT),
                                     [d.rstrip("/") for d in args.decode], args.timeout_s, args.eject_s))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
