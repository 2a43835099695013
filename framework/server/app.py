"""The Starlette application: core routes, routes from ``extend_http_routes`` plugins, errors."""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.routing import BaseRoute

from framework.errors import PluginError
from framework.plugins import get_plugins
from framework.server import generate_routes, openai_routes, ops_routes, rollout_routes, tokenize_routes
from framework.server.errors import EXCEPTION_HANDLERS
from framework.server.state import ServerState

logger = logging.getLogger("plugserve.server")


def core_routes() -> list[BaseRoute]:
    return [*generate_routes.ROUTES, *openai_routes.ROUTES, *ops_routes.ROUTES, *tokenize_routes.ROUTES,
            *rollout_routes.ROUTES]


def plugin_routes(config: Any, taken: set[str]) -> list[BaseRoute]:
    """Routes each plugin contributes; one that would shadow another route fails the start,
    naming the plugin (a silently shadowed route is much harder to debug)."""
    hook = get_plugins().hook.extend_http_routes
    routes: list[BaseRoute] = []
    for impl in reversed(hook.get_hookimpls()):  # registration order
        kwargs = {"config": config} if "config" in impl.argnames else {}
        for route in impl.function(**kwargs) or []:
            path = getattr(route, "path", None)
            if path in taken:
                raise PluginError(f"plugin {impl.plugin_name!r} adds route {path}, which is already served")
            taken.add(path)  # type: ignore[arg-type]
            routes.append(route)
            logger.debug("plugin %s mounts %s", impl.plugin_name, path)
    return routes


def build_app(server: ServerState) -> Starlette:
    """The ASGI app serving ``server`` (kept on ``app.state.server`` for the routes)."""
    routes = core_routes()
    routes += plugin_routes(server.cfg, {getattr(r, "path", "") for r in routes})
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = server
    return app
