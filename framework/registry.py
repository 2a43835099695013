"""The component registry: every named thing a config can select, and who registered it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from framework.errors import ConfigError, PluginError, did_you_mean

#: Component kind -> the registration hook that fills it.
KIND_HOOKS: dict[str, str] = {
    "attention_backend": "register_attention_backends",
    "memory_pool": "register_memory_pools",
    "transfer_backend": "register_transfer_backends",
    "model": "register_models",
    "schedule_policy": "register_schedule_policies",
    "grammar_backend": "register_grammar_backends",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "memory_saver": "register_memory_savers",
    "communicator": "register_communicators",
    "logit_processor": "register_logit_processors",
    "mm_processor": "register_mm_processors",
}


@dataclass(frozen=True)
class Capabilities:
    """What a component declares about itself when it registers
    (``register(name, factory, config=..., capabilities=Capabilities(...))``). The core reads these
    instead of probing factories or naming built-ins: ``auto`` choices, device checks and
    feature checks all come from here, so a third-party component takes part on equal terms."""

    devices: tuple[str, ...] = ("cpu", "cuda")
    """Device types it runs on; choosing it explicitly elsewhere fails at config resolution."""
    auto_priority: Mapping[str, int] = field(default_factory=dict)
    """Device type -> priority under ``auto`` (``attention.backend``, ``memory_pool.name``): the
    highest usable one is chosen. A device missing here: never chosen automatically there."""
    cuda_graph: bool = False
    """Attention backends: the decode forward can be captured and replayed as a CUDA graph."""
    preallocation: bool = False
    """Memory pools: reserves rows beyond the running cap for requests whose KV is in flight
    (a :class:`~framework.memory.request_pool.PreallocatingRequestPool`); PD decode needs it."""
    unavailable_reason: Callable[[], str | None] | None = None
    """A cheap check (imports nothing heavy) of why it cannot run in this process (a package or
    compiler missing), or None when it can; ``auto`` skips a component that cannot run."""

    def usable(self) -> bool:
        return self.unavailable_reason is None or self.unavailable_reason() is None


@dataclass(frozen=True)
class Component:
    """One registered component: its factory, its options schema, its declared capabilities and
    where it came from."""

    kind: str
    name: str
    factory: Callable[..., Any]
    options_cls: type | None
    plugin: str
    distribution: str | None
    version: str | None
    capabilities: Capabilities = field(default_factory=Capabilities)

    @property
    def module(self) -> str:
        return getattr(self.factory, "__module__", "?")

    def make_options(self, values: Any = None) -> Any:
        """Build the options dataclass from an already-validated mapping (or defaults)."""
        if self.options_cls is None:
            return None
        if values is None:
            return self.options_cls()
        if isinstance(values, self.options_cls):
            return values
        return self.options_cls(**dict(values))


class Registry:
    """Components by kind and name. Names are unique per kind across all plugins."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in KIND_HOOKS}

    def add(self, component: Component) -> None:
        if component.kind not in self._components:
            raise PluginError(f"unknown component kind {component.kind!r}")
        if not isinstance(component.capabilities, Capabilities):
            raise PluginError(
                f"plugin {component.plugin!r} registered {component.kind} {component.name!r} with "
                f"capabilities={component.capabilities!r}: expected framework.registry.Capabilities"
            )
        if component.options_cls is not None and not dataclasses.is_dataclass(component.options_cls):
            raise PluginError(
                f"plugin {component.plugin!r} registered {component.kind} {component.name!r} with "
                f"config={component.options_cls!r}, which is not a dataclass"
            )
        existing = self._components[component.kind].get(component.name)
        if existing is not None:
            raise PluginError(
                f"{component.kind} {component.name!r} is registered twice: by plugin "
                f"{existing.plugin!r} (distribution {existing.distribution or 'unknown'}) and by "
                f"plugin {component.plugin!r} (distribution {component.distribution or 'unknown'})"
            )
        self._components[component.kind][component.name] = component

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def all(self) -> list[Component]:
        return [c for kind in self._components.values() for c in kind.values()]

    def has(self, kind: str, name: str) -> bool:
        return name in self._components[kind]

    def auto_choice(self, kind: str, device: str, accept: Callable[[Component], bool] = lambda c: True) -> str | None:
        """The component of ``kind`` that ``auto`` picks on ``device``: the highest
        ``auto_priority`` there among those ``accept`` allows and that can run here (ties by name)."""
        candidates = [
            c for c in self._components[kind].values()
            if device in c.capabilities.auto_priority and accept(c) and c.capabilities.usable()
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda c: (c.capabilities.auto_priority[device], c.name)).name

    def get(self, kind: str, name: str, key: str | None = None) -> Component:
        """Look a component up; an unknown name raises a ConfigError listing the installed ones."""
        try:
            return self._components[kind][name]
        except KeyError:
            installed = self.names(kind)
            where = f"{key}: " if key else ""
            raise ConfigError(
                f"{where}unknown {kind.replace('_', ' ')} {name!r}.{did_you_mean(name, installed)} "
                f"Installed: {', '.join(installed) or '(none)'}"
            ) from None
