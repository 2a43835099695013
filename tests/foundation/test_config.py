"""Config: layering, validation of keys/types/plugin names/options, and `config show`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from framework.config.loader import resolve_config, to_settings
from framework.config.schema import PlugserveConfig
from framework.errors import ConfigError
from tests.foundation.fake_dists import run_cli

MODEL = ["model.path=/nonexistent-model-dir-is-fine-for-config"]


def resolve(*overrides: str, config_file=None):
    return resolve_config(config_file, [*MODEL, *overrides])


def test_defaults_and_preset():
    cfg = resolve()
    assert cfg.scheduler.policy == "fcfs"
    assert cfg.device.device.value == "cpu"
    assert cfg.attention.backend == "cpu_paged"  # auto resolved for this device (a C compiler is here)
    assert cfg.memory_pool.name == "standard"
    settings = to_settings(cfg)
    assert isinstance(settings, PlugserveConfig)


def test_preset_serves_embedded_model():
    cfg = resolve_config(None, [], validate_components=False)
    assert Path(cfg.model.path).name == "tiny-shakespeare"


def test_layer_precedence(tmp_path: Path):
    f = tmp_path / "user.yaml"
    f.write_text("scheduler:\n  chunked_prefill_size: 1024\n  max_prefill_tokens: 4096\n")
    cfg = resolve("scheduler.chunked_prefill_size=512", config_file=f)
    assert cfg.scheduler.chunked_prefill_size == 512  # CLI beats file
    assert cfg.scheduler.max_prefill_tokens == 4096  # file beats preset/defaults


@pytest.mark.parametrize(
    "override, expected",
    [
        ("scheduler.chunked_prefil_size=3", r"scheduler\.chunked_prefil_size: unknown key\. Did you mean \"chunked_prefill_size\"\?"),
        ("scheduler.chunked_prefill_size=abc", r"scheduler\.chunked_prefill_size: .*could not be converted to Integer"),
        ("model.dtype=fp33", r"model\.dtype: Invalid value 'fp33', expected one of \[auto, float32, bfloat16, float16\]"),
        ("attention.backend=torch_nativ", r"attention\.backend: unknown attention backend 'torch_nativ'\. Did you mean \"torch_native\"\?.*Installed: .*torch_native"),
        ("scheduler.policy=fifo", r"scheduler\.policy: unknown schedule policy 'fifo'.*Installed: .*fcfs, lpm"),
        ("kv_cache.page_size=0", r"kv_cache\.page_size: invalid value 0, must be >= 1"),
        ("server.port=70000", r"server\.port: invalid value 70000"),
        ("nosuchsection.x=1", r"nosuchsection: unknown key"),
    ],
)
def test_errors_name_the_key_and_allowed_values(override, expected):
    with pytest.raises(ConfigError, match=expected):
        resolve(override)


def test_plugin_options_are_validated_against_its_dataclass():
    cfg = resolve("scheduler.policy=lpm", "scheduler.policy_options.max_queue_for_matching=7")
    assert cfg.scheduler.policy_options.max_queue_for_matching == 7
    assert to_settings(cfg).scheduler.policy_options.max_queue_for_matching == 7
    with pytest.raises(ConfigError, match=r"scheduler\.policy_options\.max_queue: unknown key\. Did you mean \"max_queue_for_matching\"\?"):
        resolve("scheduler.policy=lpm", "scheduler.policy_options.max_queue=3")
    with pytest.raises(ConfigError, match=r"memory_pool\.options\.pre_alloc_ratio: .*could not be converted"):
        resolve("memory_pool.name=decode_prealloc", "memory_pool.options.pre_alloc_ratio=x")
    with pytest.raises(ConfigError, match=r"scheduler\.policy_options: schedule_policy 'fcfs' takes no options"):
        resolve("scheduler.policy_options.a=1")


def test_defaults_of_options_are_filled_in():
    cfg = resolve("memory_pool.name=decode_prealloc")
    assert cfg.memory_pool.options.pre_alloc_ratio == 1.0
    assert cfg.memory_pool.options.pre_alloc_size is None


def test_mixed_steps_auto_per_device_and_loop():
    """``scheduler.mixed_chunk`` null: on for a CPU unified synchronous server, with its CPU
    threshold and budget; off (not an error) with the overlap loop or a PD role; an explicit true
    there is an error naming the key."""
    cfg = resolve()
    assert cfg.device.device.value == "cpu"
    assert (cfg.scheduler.mixed_chunk, cfg.scheduler.mixed_chunk_min_running) == (True, 32)
    # The CPU prefill budget waits for the served dtype (the scheduler resolves it).
    assert (cfg.scheduler.max_prefill_tokens, cfg.scheduler.mixed_chunk_max_tokens) == (None, 1792)
    assert resolve("scheduler.overlap=true").scheduler.mixed_chunk is False
    pd = resolve_config(None, [*MODEL, "disaggregation.mode=prefill"], validate_components=False)
    assert pd.scheduler.mixed_chunk is False
    explicit = resolve("scheduler.mixed_chunk=false", "scheduler.mixed_chunk_max_tokens=300")
    assert (explicit.scheduler.mixed_chunk, explicit.scheduler.mixed_chunk_max_tokens) == (False, 300)
    with pytest.raises(ConfigError, match=r"scheduler\.mixed_chunk: mixed steps run in the synchronous loop"):
        resolve("scheduler.mixed_chunk=true", "scheduler.overlap=true")
    with pytest.raises(ConfigError, match=r"scheduler\.mixed_chunk_min_running: invalid value 0, must be >= 1"):
        resolve("scheduler.mixed_chunk_min_running=0")
    assert cfg.scheduler.mixed_chunk_max_stalled_steps == 1
    assert resolve("scheduler.mixed_chunk_max_stalled_steps=null").scheduler.mixed_chunk_max_stalled_steps is None
    with pytest.raises(ConfigError,
                       match=r"scheduler\.mixed_chunk_max_stalled_steps: invalid value -1, must be >= 0 or null"):
        resolve("scheduler.mixed_chunk_max_stalled_steps=-1")


def test_decode_mode_picks_decode_pool_and_checks_transfer_backend():
    cfg = resolve_config(None, [*MODEL, "disaggregation.mode=decode"], validate_components=False)
    assert cfg.memory_pool.name == "decode_prealloc"
    with pytest.raises(ConfigError, match=r"disaggregation\.transfer_backend: unknown transfer backend 'nope'"):
        resolve("disaggregation.mode=decode", "disaggregation.transfer_backend=nope")


def test_bad_files_and_overrides(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        resolve(config_file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        resolve(config_file=bad)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        resolve("scheduler.policy")


def test_config_show_cli(tmp_path: Path):
    proc = run_cli(["config", "show", *MODEL, "scheduler.max_prefill_tokens=999"])
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["scheduler"]["max_prefill_tokens"] == 999
    assert shown["attention"]["backend"] == "cpu_paged"
    proc = run_cli(["config", "show", *MODEL, "scheduler.chunked_prefil_size=3"])
    assert proc.returncode == 2
    assert "Did you mean \"chunked_prefill_size\"" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_model_architecture_fails_at_config_time(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT9ForCausalLM"]}')
    with pytest.raises(ConfigError, match=r"model\.architecture: unknown model 'GPT9ForCausalLM'.*Installed: .*LlamaForCausalLM"):
        resolve_config(None, [f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model\.architecture: unknown model 'Llama'\. Did you mean"):
        resolve_config(None, [f"model.path={tmp_path}", "model.architecture=Llama"])


def test_auto_backend_skips_backends_that_cannot_run_here(register_plugin, plugins):
    from framework.hookspecs import Capabilities, hookimpl

    class Backends:
        @hookimpl
        def register_attention_backends(self, register):
            # Both outrank every built-in on CPU; only the one that can run here is picked.
            register("fake_usable", object, capabilities=Capabilities(auto_priority={"cpu": 90}))
            register("fake_unusable", object, capabilities=Capabilities(
                auto_priority={"cpu": 99}, unavailable_reason=lambda: "needs hardware this machine lacks"))

    register_plugin(Backends(), "fake-backends")
    assert plugins.registry.auto_choice("attention_backend", "cpu") == "fake_usable"
    cfg = resolve_config(None, [*MODEL, "device.device=cpu"], validate_components=False)
    assert cfg.attention.backend == "fake_usable"
    # flashinfer is registered but cannot run without a CUDA device: auto on cuda skips it too.
    assert plugins.registry.auto_choice("attention_backend", "cuda") != "flashinfer"


def test_auto_choices_come_from_declared_capabilities(plugins):
    registry = plugins.registry
    assert registry.auto_choice("attention_backend", "cpu") in ("cpu_paged", "torch_native")
    assert registry.auto_choice("memory_pool", "cpu") == "standard"
    assert registry.auto_choice("memory_pool", "cpu", lambda c: c.capabilities.preallocation) == "decode_prealloc"
    decode = resolve_config(None, [*MODEL, "disaggregation.mode=decode", "disaggregation.transfer_backend=nccl"])
    assert decode.memory_pool.name == "decode_prealloc"


def test_capability_conflicts_fail_at_config_time():
    with pytest.raises(ConfigError, match=r"attention\.backend: attention backend 'flashinfer' runs on cuda, not on cpu"):
        resolve_config(None, [*MODEL, "device.device=cpu", "attention.backend=flashinfer"])
    with pytest.raises(ConfigError, match=r"memory_pool\.name: disaggregation\.mode=decode needs a pool .*decode_prealloc"):
        resolve_config(None, [*MODEL, "disaggregation.mode=decode", "disaggregation.transfer_backend=nccl",
                              "memory_pool.name=standard"])
    with pytest.raises(ConfigError, match=r"scheduler\.overlap: .*disaggregation\.mode"):
        resolve_config(None, [*MODEL, "disaggregation.mode=prefill", "scheduler.overlap=true"],
                       validate_components=False)
