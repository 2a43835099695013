"""``plugserve``: plugins, config show, serve, router, bench.

Sub-commands that need heavy imports (torch, the server) import them lazily, so ``plugserve
plugins`` and ``plugserve config show`` stay quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from framework.errors import PlugserveError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML merged over the default preset")
    parser.add_argument(
        "--preset",
        default="serve.yaml",
        help="preset from conf/ merged first (default: serve.yaml; 'none' for schema defaults)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, merged last"
    )


def _resolve(args: argparse.Namespace):  # -> DictConfig
    from framework.config.loader import resolve_config

    preset = None if args.preset in ("none", "") else args.preset
    return resolve_config(args.config, args.overrides, preset=preset)


def cmd_plugins(args: argparse.Namespace) -> int:
    from framework.plugins import get_plugins

    plugins = get_plugins()
    rows = []
    registry_error = None
    try:
        components = plugins.registry.all()
    except PlugserveError as exc:  # e.g. two plugins registering one name
        components, registry_error = [], str(exc)
    by_plugin: dict[str, list] = {}
    for comp in components:
        by_plugin.setdefault(comp.plugin, []).append(comp)
    for name, info in sorted(plugins.infos.items()):
        comps = by_plugin.get(name, [])
        rows.append(
            {
                "plugin": name,
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "builtin": info.builtin,
                "error": info.error,
                "hooks": plugins.hook_names(name),
                "registered": [
                    {"kind": c.kind, "name": c.name, "module": c.module,
                     "options": c.options_cls.__name__ if c.options_cls else None}
                    for c in sorted(comps, key=lambda c: (c.kind, c.name))
                ],
            }
        )
    if args.json:
        print(json.dumps({"plugins": rows, "registry_error": registry_error}, indent=2))
    else:
        for row in rows:
            origin = f"{row['distribution'] or '?'} {row['version'] or ''}".strip()
            status = f"  ERROR: {row['error']}" if row["error"] else ""
            print(f"{row['plugin']}  ({origin}; {row['module']}){status}")
            if row["hooks"]:
                print(f"    hooks: {', '.join(row['hooks'])}")
            for comp in row["registered"]:
                opts = f" [options: {comp['options']}]" if comp["options"] else ""
                print(f"    {comp['kind']:<18} {comp['name']:<22} {comp['module']}{opts}")
        if registry_error:
            print(f"ERROR: {registry_error}")
    return 1 if registry_error else 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from framework.config.loader import to_yaml

    print(to_yaml(_resolve(args)), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from framework.plugins import get_plugins
    from framework.server.prestart import PrestartedProcess

    # The first scheduler's interpreter imports torch while this one resolves the config.
    scheduler = PrestartedProcess()
    try:
        cfg = _resolve(args)
        get_plugins().raise_for_errors()
        from framework.server.launcher import serve

        return serve(cfg, scheduler)
    finally:
        scheduler.cancel()  # a no-op once the launcher handed it its work


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed plugins and what they registered")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="inspect the configuration")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved configuration as YAML")
    _add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    p = sub.add_parser("serve", help="start the HTTP server")
    _add_config_args(p)
    p.set_defaults(func=cmd_serve)

    from framework.bench.cli import add_bench_commands

    add_bench_commands(sub)
    from framework.router.cli import add_router_command

    add_router_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlugserveError as exc:
        print(f"plugserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> int:
    """The ``plugserve`` command: :func:`main` in a process of plugserve's own, where
    ``device.cpu_keep_freed_memory``'s auto applies (``main`` alone leaves a caller's process, e.g. a
    test run, as it is)."""
    from framework.memory.heap import claim_process

    claim_process()
    return main()


if __name__ == "__main__":
    sys.exit(run())
