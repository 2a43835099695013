"""Build the resolved config: schema defaults < preset < ``--config FILE`` < CLI overrides.

Every error is a :class:`~framework.errors.ConfigError` naming the full key path and what would be
accepted, including unknown plugin names (with the installed ones) and the keys of a plugin's
``options`` block (validated against the options dataclass that plugin registered).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.auto import check_component_capabilities, check_section_combinations, resolve_auto
from framework.config.schema import EVENT_LOOPS, HTTP_PARSERS, PlugserveConfig
from framework.errors import ConfigError, did_you_mean

DEFAULT_PRESET = "serve.yaml"
MAX_JSON_DEPTH = 500
"""``server.max_json_depth`` stays well under Python's recursion limit (1000), which the JSON
parser, pydantic and the chat template all count against."""
MAX_N = 1024
"""``server.max_n``: seeds of a request's choices are seed, seed + 1, ...; a bounded n keeps
seed + n - 1 within 64 bits for every valid seed."""
SECRET_ENV = {"api_key": "PLUGSERVE_API_KEY", "admin_key": "PLUGSERVE_ADMIN_KEY"}
"""Where ``server.api_key`` / ``server.admin_key`` come from when the config leaves them null."""

#: (key of the component name, key of its options, registry kind)
COMPONENT_SLOTS: tuple[tuple[str, str, str], ...] = (
    ("attention.backend", "attention.options", "attention_backend"),
    ("memory_pool.name", "memory_pool.options", "memory_pool"),
    ("scheduler.policy", "scheduler.policy_options", "schedule_policy"),
    ("grammar.backend", "grammar.options", "grammar_backend"),
    ("disaggregation.transfer_backend", "disaggregation.transfer_options", "transfer_backend"),
    ("memory_saver.name", "memory_saver.options", "memory_saver"),
    ("parallel.communicator", "parallel.communicator_options", "communicator"),
)

#: (key of an optional component name, registry kind): null means "none"; they take no options.
OPTIONAL_SLOTS: tuple[tuple[str, str], ...] = (
    ("server.tool_call_parser", "tool_parser"),
    ("server.reasoning_parser", "reasoning_parser"),
)


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("asset"):
        from framework.assets import asset_path

        OmegaConf.register_resolver("asset", lambda name: str(asset_path(name)))


def preset_dirs() -> list[Path]:
    """Where presets are looked up: the checkout's conf/, then a wheel's share/plugserve/conf."""
    return [
        Path(__file__).resolve().parents[2] / "conf",
        Path(sys.prefix) / "share" / "plugserve" / "conf",
    ]


def preset_path(name: str = DEFAULT_PRESET) -> Path:
    """Path of a preset shipped in ``conf/`` (``serve.yaml``, ``pd/prefill.yaml``, ...)."""
    for directory in preset_dirs():
        if (directory / name).is_file():
            return directory / name
    raise ConfigError(f"no preset {name!r} in {', '.join(str(d) for d in preset_dirs())}")


def _explain(exc: OmegaConfBaseException, prefix: str = "") -> ConfigError:
    """Turn an OmegaConf error into one line naming the key path, with a suggestion if any."""
    full_key = getattr(exc, "full_key", None) or ""
    key = f"{prefix}{full_key}" if full_key else prefix.rstrip(".")
    msg = getattr(exc, "msg", None) or str(exc)
    msg = msg.split("\n")[0]
    obj_type = getattr(exc, "object_type", None)
    if "not in" in msg and obj_type is not None and dataclasses.is_dataclass(obj_type):
        allowed = [f.name for f in dataclasses.fields(obj_type)]
        bad = full_key.rsplit(".", 1)[-1]
        msg = f"unknown key.{did_you_mean(bad, allowed)} Allowed keys: {', '.join(allowed)}"
    return ConfigError(f"{key}: {msg}" if key else msg)


def _load_yaml(path: str | Path, what: str) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file") from None
    except Exception as exc:  # YAML syntax errors come in several types
        raise ConfigError(f"{what} {path}: cannot parse: {exc}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{what} {path}: expected a mapping at the top level")
    return loaded


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. scheduler.chunked_prefill_size=512")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise _explain(exc) from None


def resolve_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    preset: str | Path | None = DEFAULT_PRESET,
    validate_components: bool = True,
) -> DictConfig:
    """Merge defaults, preset, file and overrides; validate; return the resolved DictConfig."""
    _register_resolvers()
    layers: list[DictConfig] = [OmegaConf.structured(PlugserveConfig)]
    if preset is not None:
        path = preset if isinstance(preset, Path) else preset_path(str(preset))
        layers.append(_load_yaml(path, "preset"))
    if config_file is not None:
        layers.append(_load_yaml(config_file, "config file"))
    layers.append(_parse_overrides(overrides))
    cfg: DictConfig = layers[0]
    for layer in layers[1:]:
        try:
            cfg = OmegaConf.merge(cfg, layer)  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise _explain(exc) from None
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc) from None
    _check_values(cfg)
    check_section_combinations(cfg)
    _keys_from_environment(cfg)
    resolve_auto(cfg)
    if validate_components:
        validate_component_slots(cfg)
    return cfg


def _check_values(cfg: DictConfig) -> None:
    """Range checks that types alone cannot express."""
    checks: list[tuple[str, bool, str]] = [
        ("kv_cache.page_size", cfg.kv_cache.page_size >= 1, ">= 1"),
        ("kv_cache.cpu_memory_budget_gb", cfg.kv_cache.cpu_memory_budget_gb > 0, "> 0"),
        ("kv_cache.gpu_memory_fraction", 0 < cfg.kv_cache.gpu_memory_fraction <= 1, "in (0, 1]"),
        ("scheduler.max_running_requests_limit", cfg.scheduler.max_running_requests_limit >= 1, ">= 1"),
        ("scheduler.expected_tokens_per_request", cfg.scheduler.expected_tokens_per_request >= 1, ">= 1"),
        ("scheduler.stream_interval", cfg.scheduler.stream_interval >= 1, ">= 1"),
        ("scheduler.mixed_chunk_max_stalled_steps",
         cfg.scheduler.mixed_chunk_max_stalled_steps is None or cfg.scheduler.mixed_chunk_max_stalled_steps >= 0,
         ">= 0 or null"),
        ("server.port", 0 <= cfg.server.port < 65536, "in [0, 65535]"),
        ("server.max_body_bytes", cfg.server.max_body_bytes >= 1024, ">= 1024"),
        ("server.max_json_depth", 2 <= cfg.server.max_json_depth <= MAX_JSON_DEPTH, f"in [2, {MAX_JSON_DEPTH}]"),
        ("server.max_n", 1 <= cfg.server.max_n <= MAX_N, f"in [1, {MAX_N}]"),
        ("server.max_sequences_per_request", cfg.server.max_sequences_per_request >= 1, ">= 1"),
        ("server.max_top_logprobs", cfg.server.max_top_logprobs >= 0, ">= 0"),
        ("server.max_connections", cfg.server.max_connections >= 1, ">= 1"),
        ("server.keep_alive_timeout_s", cfg.server.keep_alive_timeout_s > 0, "> 0"),
        ("server.header_read_timeout_s", cfg.server.header_read_timeout_s > 0, "> 0"),
        ("server.body_read_timeout_s", cfg.server.body_read_timeout_s > 0, "> 0"),
        ("server.shutdown_timeout_s", cfg.server.shutdown_timeout_s >= 0, ">= 0"),
        ("device.cpu_gemm_warmup_max_s", cfg.device.cpu_gemm_warmup_max_s > 0, "> 0"),
        ("server.first_token_wait_ms", 0 <= cfg.server.first_token_wait_ms <= 1000, "in [0, 1000]"),
        ("server.event_loop", cfg.server.event_loop in EVENT_LOOPS, f"one of {', '.join(EVENT_LOOPS)}"),
        ("server.http_parser", cfg.server.http_parser in HTTP_PARSERS, f"one of {', '.join(HTTP_PARSERS)}"),
        ("parallel.dp_size", cfg.parallel.dp_size >= 1, ">= 1"),
        # Every replica would bind the same bootstrap / transfer ports: run several PD servers
        # behind the router instead.
        ("parallel.dp_size", cfg.parallel.dp_size == 1 or cfg.disaggregation.mode is None,
         "1 with disaggregation.mode prefill or decode (put several servers behind plugserve router)"),
        # Each replica's tensor-parallel group picks its own free port on this host: a fixed
        # rendezvous address would make every replica join the same group.
        ("parallel.dist_init_addr", cfg.parallel.dp_size == 1 or cfg.parallel.dist_init_addr is None,
         "null when parallel.dp_size > 1 (each replica picks its own rendezvous port)"),
        ("parallel.nnodes", cfg.parallel.dp_size == 1 or cfg.parallel.nnodes == 1,
         "1 when parallel.dp_size > 1 (data parallelism runs on one host; put servers on several hosts "
         "behind plugserve router)"),
        ("parallel.tp_size", cfg.parallel.tp_size >= 1, ">= 1"),
        ("parallel.nnodes", cfg.parallel.nnodes >= 1 and cfg.parallel.tp_size % cfg.parallel.nnodes == 0,
         f">= 1 and divide parallel.tp_size ({cfg.parallel.tp_size}): each host runs tp_size / nnodes ranks"),
        ("parallel.node_rank", 0 <= cfg.parallel.node_rank < cfg.parallel.nnodes,
         f"in [0, parallel.nnodes - 1] = [0, {cfg.parallel.nnodes - 1}]"),
        ("parallel.dist_init_addr", cfg.parallel.nnodes == 1 or _host_port(cfg.parallel.dist_init_addr),
         "host:port of the node-0 rendezvous when parallel.nnodes > 1"),
        ("parallel.dist_timeout_s", cfg.parallel.dist_timeout_s > 0, "> 0"),
        ("parallel.dist_init_addr", cfg.parallel.dp_size == 1 or cfg.parallel.dist_init_addr is None,
         "null with parallel.dp_size > 1 (each replica's ranks meet at a port of their own on this host)"),
        ("cuda_graph.max_batch_size", cfg.cuda_graph.max_batch_size >= 1, ">= 1"),
        ("cuda_graph.num_warmup_runs", cfg.cuda_graph.num_warmup_runs >= 1, ">= 1"),
        (
            "cuda_graph.batch_sizes",
            cfg.cuda_graph.batch_sizes is None or (
                len(cfg.cuda_graph.batch_sizes) > 0 and all(b >= 1 for b in cfg.cuda_graph.batch_sizes)
            ),
            "null or a non-empty list of sizes >= 1",
        ),
    ]
    optional_positive = [
        "scheduler.max_running_requests",
        "scheduler.max_prefill_tokens",
        "scheduler.chunked_prefill_size",
        "scheduler.mixed_chunk_min_running",
        "scheduler.mixed_chunk_max_tokens",
        "scheduler.max_queued_requests",
        "kv_cache.max_total_tokens",
        "model.context_length",
    ]
    for key in optional_positive:
        value = OmegaConf.select(cfg, key)
        checks.append((key, value is None or value >= 1, ">= 1 or null"))
    for key, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"{key}: invalid value {OmegaConf.select(cfg, key)!r}, must be {allowed}")


def _host_port(value: str | None) -> bool:
    host, _, port = (value or "").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _keys_from_environment(cfg: DictConfig) -> None:
    """``server.api_key`` / ``admin_key`` left null take ``$PLUGSERVE_API_KEY`` /
    ``$PLUGSERVE_ADMIN_KEY`` (an empty variable counts as unset, as an unset key would)."""
    for key, env in SECRET_ENV.items():
        if cfg.server[key] is None and os.environ.get(env):
            cfg.server[key] = os.environ[env]


def validate_options(component: Any, options: Any, key: str) -> DictConfig:
    """Validate an ``options`` block against the component's options dataclass."""
    raw = options if options is not None else {}
    if component.options_cls is None:
        if raw:
            names = ", ".join(raw.keys())
            raise ConfigError(f"{key}: {component.kind} {component.name!r} takes no options (got {names})")
        return OmegaConf.create({})
    try:
        return OmegaConf.merge(OmegaConf.structured(component.options_cls), raw)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise _explain(exc, prefix=f"{key}.") from None


def validate_component_slots(cfg: DictConfig) -> None:
    """Check every selected plugin exists and its options match its dataclass."""
    from framework.plugins import get_registry

    registry = get_registry()
    for name_key, options_key, kind in COMPONENT_SLOTS:
        if name_key.startswith("disaggregation.") and cfg.disaggregation.mode is None:
            continue  # the transfer backend is only used in PD mode
        name = OmegaConf.select(cfg, name_key)
        component = registry.get(kind, name, key=name_key)
        validated = validate_options(component, OmegaConf.select(cfg, options_key), options_key)
        OmegaConf.update(cfg, options_key, validated, merge=False)
    for name_key, kind in OPTIONAL_SLOTS:
        name = OmegaConf.select(cfg, name_key)
        if name is not None:
            registry.get(kind, name, key=name_key)  # unknown: fails listing the installed ones
    check_component_capabilities(cfg, registry)
    _validate_model(cfg, registry)


def _validate_model(cfg: DictConfig, registry: Any) -> None:
    """Check the model architecture is registered (when the checkpoint is readable) at start,
    not only once the scheduler process has loaded it."""
    arch = cfg.model.architecture
    config_json = Path(str(cfg.model.path)) / "config.json"
    if arch is None and config_json.is_file():
        try:
            arch = (json.loads(config_json.read_text()).get("architectures") or [None])[0]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.path: cannot read {config_json}: {exc}") from None
    if arch is None:
        return  # no checkpoint here (yet): the model loader reports it
    component = registry.get("model", arch, key="model.architecture")
    validated = validate_options(component, cfg.model.options, "model.options")
    OmegaConf.update(cfg, "model.options", validated, merge=False)


def to_settings(cfg: DictConfig | PlugserveConfig) -> PlugserveConfig:
    """The resolved config as plain dataclasses (options blocks become their dataclasses)."""
    if isinstance(cfg, PlugserveConfig):
        return cfg
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML, keys shown as ``<redacted>`` (see :func:`public_config`)."""
    return OmegaConf.to_yaml(OmegaConf.create(public_config(cfg)))


def public_config(cfg: DictConfig, replacement: str | None = "<redacted>") -> dict[str, Any]:
    """The resolved config as plain data with every key set in ``server`` (api_key, admin_key)
    replaced: what ``config show`` and ``/server_info`` print and the scheduler process gets
    (it never needs the keys: ``replacement=None``)."""
    data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[assignment]
    server = data.get("server", {})
    for key in SECRET_ENV:
        if server.get(key) is not None:
            server[key] = replacement
    return data
