"""``auto`` settings resolved to what will really run, and the checks that span sections.

Every choice comes from what components declared when they registered
(:class:`~framework.registry.Capabilities`): the devices they run on, their priority under
``auto``, CUDA-graph support, row pre-allocation. No built-in is named here, so a third-party
backend or pool takes part on equal terms. All of this runs at config resolution, before any
weight is loaded, so a combination that cannot work fails in a second, naming the key.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import Device
from framework.errors import ConfigError

AUTO_MAX_PREFILL_TOKENS = {"cuda": 16384}
"""``scheduler.max_prefill_tokens: null`` per device; on CPU it stays null here and the scheduler
resolves it by the dtype the weights are served in (:func:`cpu_max_prefill_tokens`), which is
known only once the checkpoint's config is read."""
CPU_MAX_PREFILL_TOKENS = {"bfloat16": 2048}
"""``scheduler.max_prefill_tokens: null`` on a CPU with AMX tiles per served dtype; any other dtype,
or a CPU without AMX, gets 1024 (see the schema's docstring for both)."""
AUTO_MIXED_CHUNK = {"cuda": False, "cpu": True}
"""``scheduler.mixed_chunk: null`` per device, where mixed steps can run at all."""
AUTO_MIXED_MIN_RUNNING = {"cuda": 1, "cpu": 32}
"""``scheduler.mixed_chunk_min_running: null`` per device."""
AUTO_MIXED_MAX_TOKENS = {"cpu": 1792}
"""``scheduler.mixed_chunk_max_tokens: null`` per device; elsewhere ``max_prefill_tokens``."""

#: (name key, registry kind) of the components whose declared devices are checked.
DEVICE_CHECKED = (("attention.backend", "attention_backend"), ("memory_pool.name", "memory_pool"),
                  ("memory_saver.name", "memory_saver"), ("parallel.communicator", "communicator"))


def _mode(cfg: DictConfig) -> str | None:
    return None if cfg.disaggregation.mode is None else cfg.disaggregation.mode.value


def resolve_auto(cfg: DictConfig) -> None:
    """Replace ``auto`` device, attention backend, memory pool, prefill budget and CUDA-graph
    switch by what will really run."""
    import torch

    from framework.plugins import get_registry

    registry = get_registry()
    if cfg.device.device.value == "auto":
        cfg.device.device = Device.cuda if torch.cuda.is_available() else Device.cpu
    device = cfg.device.device.value
    resolve_scheduler_budgets(cfg, device)
    if cfg.attention.backend == "auto":
        cfg.attention.backend = _auto(registry, "attention_backend", device, "attention.backend")
    if cfg.memory_pool.name == "auto":
        # A PD decode server reserves rows for requests whose KV is still in flight.
        needs = (lambda c: c.capabilities.preallocation) if _mode(cfg) == "decode" else (lambda c: True)
        cfg.memory_pool.name = _auto(registry, "memory_pool", device, "memory_pool.name", needs)
    if cfg.grammar.backend == "auto":
        cfg.grammar.backend = _auto(registry, "grammar_backend", device, "grammar.backend")
    if cfg.parallel.communicator == "auto":
        cfg.parallel.communicator = _auto(registry, "communicator", device, "parallel.communicator")
    if cfg.memory_saver.name == "auto":
        cfg.memory_saver.name = _auto(registry, "memory_saver", device, "memory_saver.name")
    supports = None
    if registry.has("attention_backend", cfg.attention.backend):
        supports = registry.get("attention_backend", cfg.attention.backend).capabilities.cuda_graph
    enabled = cfg.cuda_graph.enabled
    if enabled is None and _mode(cfg) == "prefill":
        enabled = False  # a prefill server never decodes: capturing would only cost start time and memory
    # An unknown backend is reported by the component check; the device check still applies.
    enabled = resolve_cuda_graph_enabled(enabled, device, cfg.attention.backend, supports is not False)
    if supports is not None:
        cfg.cuda_graph.enabled = enabled


def mixed_steps_possible(cfg: DictConfig) -> bool:
    """Mixed steps run only in the synchronous loop of a unified server."""
    return not cfg.scheduler.overlap and _mode(cfg) is None


def resolve_scheduler_budgets(cfg: DictConfig, device: str) -> None:
    """``null`` prefill budget and mixed-step settings resolved per device."""
    sched = cfg.scheduler
    if sched.max_prefill_tokens is None and device in AUTO_MAX_PREFILL_TOKENS:
        sched.max_prefill_tokens = AUTO_MAX_PREFILL_TOKENS[device]
    if sched.mixed_chunk is None:
        sched.mixed_chunk = AUTO_MIXED_CHUNK[device] and mixed_steps_possible(cfg)
    if sched.mixed_chunk_min_running is None:
        sched.mixed_chunk_min_running = AUTO_MIXED_MIN_RUNNING[device]
    if sched.mixed_chunk_max_tokens is None:
        sched.mixed_chunk_max_tokens = AUTO_MIXED_MAX_TOKENS.get(device, sched.max_prefill_tokens)


def cpu_max_prefill_tokens(dtype: Any, amx: bool) -> int:
    """``scheduler.max_prefill_tokens: null`` on CPU for weights served in ``dtype`` (a torch dtype
    or its name), ``amx`` whether oneDNN multiplies on AMX tiles here (the larger bf16 budget was
    measured there only)."""
    return CPU_MAX_PREFILL_TOKENS.get(str(dtype).removeprefix("torch."), 1024) if amx else 1024


def _auto(registry: Any, kind: str, device: str, key: str, accept: Any = lambda c: True) -> str:
    name = registry.auto_choice(kind, device, accept)
    if name is None:
        raise ConfigError(f"{key}: auto found no {kind.replace('_', ' ')} that can run on {device} here "
                          f"(installed: {', '.join(registry.names(kind)) or 'none'}); name one explicitly")
    return name


def resolve_cuda_graph_enabled(enabled: bool | None, device_type: str, backend_name: str,
                               backend_supports: bool) -> bool:
    """``cuda_graph.enabled`` as it will run: ``None`` (auto) means on exactly when the device is
    CUDA and the backend supports graphs; an explicit ``True`` that cannot be honoured is a
    :class:`ConfigError` naming the key rather than a silent eager fallback."""
    if enabled is False:
        return False
    if device_type != "cuda":
        if enabled:
            raise ConfigError(
                f"cuda_graph.enabled: CUDA graphs need a CUDA device, but device.device is {device_type!r}; "
                "set cuda_graph.enabled=false (or leave it null for auto)"
            )
        return False
    if not backend_supports:
        if enabled:
            raise ConfigError(
                f"cuda_graph.enabled: attention backend {backend_name!r} does not support CUDA graphs; "
                "set cuda_graph.enabled=false (or null for auto) or choose a backend that does"
            )
        return False
    return True


def check_section_combinations(cfg: DictConfig) -> None:
    """Combinations that no single key's check can see (no plugin needed)."""
    if cfg.scheduler.mixed_chunk and not mixed_steps_possible(cfg):
        raise ConfigError("scheduler.mixed_chunk: mixed steps run in the synchronous loop of a unified server; "
                          "set scheduler.overlap=false and leave disaggregation.mode unset, or mixed_chunk=false")
    if cfg.scheduler.overlap and _mode(cfg) is not None:
        raise ConfigError("scheduler.overlap: the overlap loop is not supported with disaggregation.mode "
                          f"{_mode(cfg)!r} yet; set scheduler.overlap=false")


def check_component_capabilities(cfg: DictConfig, registry: Any) -> None:
    """The selected components can do what this config asks of them (run on its device, pre-allocate
    rows for a PD decode server)."""
    device = cfg.device.device.value
    for key, kind in DEVICE_CHECKED:
        name = OmegaConf.select(cfg, key)
        caps = registry.get(kind, name, key=key).capabilities
        if device not in caps.devices:
            here = [n for n in registry.names(kind) if device in registry.get(kind, n).capabilities.devices]
            raise ConfigError(f"{key}: {kind.replace('_', ' ')} {name!r} runs on {', '.join(caps.devices)}, "
                              f"not on {device} (device.device); on {device} use one of: {', '.join(here)}")
    if _mode(cfg) == "decode":
        pool = cfg.memory_pool.name
        if not registry.get("memory_pool", pool, key="memory_pool.name").capabilities.preallocation:
            with_it = [n for n in registry.names("memory_pool")
                       if registry.get("memory_pool", n).capabilities.preallocation]
            raise ConfigError(
                f"memory_pool.name: disaggregation.mode=decode needs a pool that pre-allocates rows for requests "
                f"whose KV is in flight, and {pool!r} does not (pools that do: {', '.join(with_it) or 'none'})")

