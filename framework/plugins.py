"""Plugin loading: entry points of the ``plugserve`` group, once per process, into one registry.

Built-in plugins come through the same entry-point group as third-party ones (they are declared in
plugserve's own pyproject.toml), so the core never imports ``plugins.*`` by name.

``PLUGSERVE_PLUGINS`` restricts which third-party entry points load: unset loads all, an empty
value loads none beyond the built-ins, ``a,b`` loads only those (matched against the entry-point
name or the distribution name). A plugin that fails to import, or that implements a hook that does
not exist (a misspelt hookimpl), is recorded with its error instead of stopping the process; the
``plugserve plugins`` command shows it and ``serve`` refuses to start until it is fixed or excluded.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from framework import hookspecs
from framework.errors import PluginError, did_you_mean
from framework.registry import KIND_HOOKS, Capabilities, Component, Registry

ENTRY_POINT_GROUP = "plugserve"
PLUGINS_ENV = "PLUGSERVE_PLUGINS"
BUILTIN_DISTRIBUTION = "plugserve"


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    builtin: bool
    error: str | None = None


def _allowed_third_party() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


class PluginSet:
    """The plugin manager of this process, the plugins it loaded, and the registry they fill."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._registry: Registry | None = None
        self._registry_key: tuple[str, ...] = ()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # -- loading ---------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every entry point of the group that ``PLUGSERVE_PLUGINS`` allows."""
        allowed = _allowed_third_party()
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            builtin = dist is not None and dist.lower() == BUILTIN_DISTRIBUTION
            if not builtin and allowed is not None and ep.name not in allowed and dist not in allowed:
                continue
            if ep.name in self.infos:
                continue
            info = PluginInfo(ep.name, dist, version, ep.value, builtin)
            self.infos[ep.name] = info
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not stop the process
                info.error = f"import failed: {type(exc).__name__}: {exc}"
                info.error_traceback = traceback.format_exc()  # type: ignore[attr-defined]
                continue
            try:
                self._register_checked(obj, ep.name)
            except PluginError as exc:
                info.error = str(exc)

    def register(self, plugin: Any, name: str | None = None, distribution: str | None = None) -> str:
        """Register a plugin object directly (tests, embedding). Returns its name.

        Raises PluginError for a hookimpl that matches no hookspec, so typos fail loudly.
        """
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        self._register_checked(plugin, name)
        self.infos[name] = PluginInfo(
            name, distribution, None, getattr(plugin, "__module__", None) or name, False
        )
        return name

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.infos.pop(name, None)

    def spec_names(self) -> set[str]:
        """Names of the hooks plugserve specifies (pluggy also creates callers for unknown ones)."""
        return {
            n for n in dir(self.pm.hook)
            if not n.startswith("_") and getattr(self.pm.hook, n).spec is not None
        }

    def hook_names(self, name: str) -> list[str]:
        """Names of the hooks a registered plugin implements (empty if it is not registered)."""
        plugin = self.pm.get_plugin(name)
        return sorted(self._hookimpl_names(plugin)) if plugin is not None else []

    def _register_checked(self, plugin: Any, name: str) -> None:
        specs = self.spec_names()
        self.pm.register(plugin, name=name)
        for impl_name in self._hookimpl_names(plugin):
            if impl_name not in specs:
                self.pm.unregister(name=name)
                raise PluginError(
                    f"plugin {name!r} implements hook {impl_name!r}, which is not a plugserve "
                    f"hookspec.{did_you_mean(impl_name, specs)}"
                )

    def _hookimpl_names(self, plugin: Any) -> list[str]:
        names = []
        for attr in dir(plugin):
            opts = self.pm.parse_hookimpl_opts(plugin, attr)
            if opts is not None:
                names.append(opts.get("specname") or attr)
        return names

    # -- registry ----------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """Components registered by the current plugins (rebuilt when plugins change)."""
        key = tuple(sorted(name for name, _ in self.pm.list_name_plugin()))
        if self._registry is None or key != self._registry_key:
            self._registry = self._build_registry()
            self._registry_key = key
        return self._registry

    def _build_registry(self) -> Registry:
        registry = Registry()
        for kind, hook_name in KIND_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                info = self.infos.get(impl.plugin_name)
                dist = info.distribution if info else None
                version = info.version if info else None

                def register(
                    name: str,
                    factory: Any,
                    config: type | None = None,
                    capabilities: Capabilities | None = None,
                    *,
                    _kind: str = kind,
                    _plugin: str = impl.plugin_name,
                    _dist: str | None = dist,
                    _version: str | None = version,
                ) -> None:
                    registry.add(Component(_kind, name, factory, config, _plugin, _dist, _version,
                                           capabilities if capabilities is not None else Capabilities()))

                impl.function(register=register)
        return registry

    def errors(self) -> dict[str, str]:
        return {name: info.error for name, info in self.infos.items() if info.error}

    def raise_for_errors(self) -> None:
        """Fail (for commands that serve) when any plugin failed to load."""
        errors = self.errors()
        if errors:
            lines = "\n".join(f"  {name}: {err}" for name, err in errors.items())
            raise PluginError(
                f"these plugins failed to load:\n{lines}\nFix or uninstall them, or exclude them "
                f"with {PLUGINS_ENV}=<comma-separated plugins to load>."
            )


_plugins: PluginSet | None = None
_lock = threading.Lock()


def get_plugins() -> PluginSet:
    """The process-wide plugin set, loading entry points on first use (once per process)."""
    global _plugins
    with _lock:
        if _plugins is None:
            plugins = PluginSet()
            plugins.load_entry_points()
            _plugins = plugins
        return _plugins


def reset_plugins() -> None:
    """Forget the loaded plugins (tests that change ``PLUGSERVE_PLUGINS`` use this)."""
    global _plugins
    with _lock:
        _plugins = None


def get_registry() -> Registry:
    return get_plugins().registry


def lookup(kind: str, name: str, key: str | None = None) -> Component:
    return get_registry().get(kind, name, key)
