"""The ``plugserve router`` command."""

from __future__ import annotations

import argparse

DEFAULT_BOOTSTRAP_PORT = 8998
"""A prefill server's bootstrap port when ``--prefill`` gives none (disaggregation.bootstrap_port)."""


def add_router_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="PD router: pair a prefill and a decode server per request")
    p.add_argument("--prefill", nargs="+", action="append", required=True, metavar="URL [BOOTSTRAP_PORT]",
                   help="a prefill server and its bootstrap port (repeat for more servers)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode server (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout towards the servers")
    p.add_argument("--eject-s", type=float, default=2.0,
                   help="how long a decode server that refused a connection is tried last")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from framework.router.app import RouterConfig, build_app, parse_prefill_args

    cfg = RouterConfig(parse_prefill_args(args.prefill, DEFAULT_BOOTSTRAP_PORT),
                       [d.rstrip("/") for d in args.decode], args.timeout_s, args.eject_s)
    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0
