"""The memory-saver plugin kind: selection by config, the cpu saver's byte-exact round trip and
real RSS drop, oneDNN-packed layers unpacked bit-exactly, and torch_memory_saver on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.config.loader import resolve_config
from framework.errors import ConfigError
from framework.memory.memory_saver import MEMORY_TAGS
from framework.models.cpu_linear import (
    PackedLinear,
    PackedSwiGLU,
    onednn_linear_available,
    pack_linear_layers,
    unpack_linear_layers,
)
from framework.models.layers import FusableSwiGLU, SiluAndMul
from framework.plugins import get_registry
from tests.rl.conftest import rss_bytes


def make_saver(name: str, **options):
    comp = get_registry().get("memory_saver", name)
    return comp.factory(comp.make_options(options or None))


def test_auto_picks_cpu_and_unknown_names_fail():
    cfg = resolve_config(None, ["model.path=/nonexistent"])
    assert cfg.memory_saver.name == "cpu"
    with pytest.raises(ConfigError, match="memory_saver.name") as err:
        resolve_config(None, ["model.path=/nonexistent", "memory_saver.name=cpux"])
    assert "cpu" in str(err.value)
    with pytest.raises(ConfigError, match="memory_saver.name"):  # a CUDA-only saver on a CPU device
        resolve_config(None, ["model.path=/nonexistent", "memory_saver.name=torch_memory_saver"])


def test_cpu_saver_round_trip_is_byte_exact_and_frees_rss():
    saver = make_saver("cpu")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1024, 1024, generator=gen) for _ in range(16)]  # 64 MiB
    tied = weights[0][:10]  # a view shares the storage: released and restored once
    kv = [torch.randn(4096, 1024, generator=gen)]  # 16 MiB
    first = weights[0].clone()
    saver.track("weights", [*weights, tied], keep_contents=True)
    saver.track("kv_cache", kv, keep_contents=False)
    assert saver.tracked_bytes("weights") == 64 << 20
    checksums = [float(w.double().sum()) for w in weights]
    rss0 = rss_bytes()
    saver.pause("weights")
    saver.pause("kv_cache")
    saver.pause("weights")  # idempotent
    assert rss0 - rss_bytes() >= (80 << 20) * 0.98
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)
    with pytest.raises(RuntimeError, match="released"):
        saver.track("weights", weights, keep_contents=True)
    saver.resume("weights")
    saver.resume("kv_cache")
    assert torch.equal(weights[0], first) and torch.equal(tied, first[:10])
    assert [float(w.double().sum()) for w in weights] == checksums
    assert float(kv[0].abs().sum()) == 0.0  # KV comes back zeroed, never stale
    saver.close()


def test_none_saver_refuses():
    saver = make_saver("none")
    assert not saver.releases_memory
    with pytest.raises(RuntimeError, match="cannot release"):
        saver.pause("weights")
    assert set(MEMORY_TAGS) == {"weights", "kv_cache", "cuda_graph"}


class _MLP(nn.Module, FusableSwiGLU):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(48, 160, bias=True)
        self.act = SiluAndMul()
        self.down = nn.Linear(80, 48, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up_proj(x)))


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")
def test_unpack_restores_weights_bit_exactly():
    torch.manual_seed(0)
    mlp = _MLP().requires_grad_(False)
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    x = torch.randn(5, 48)
    assert pack_linear_layers(mlp) == 2
    assert isinstance(mlp.gate_up_proj, PackedSwiGLU) and isinstance(mlp.down, PackedLinear)
    packed_out = mlp(x)
    assert unpack_linear_layers(mlp, {"down"}) == 1  # only the named layer
    assert type(mlp.down) is nn.Linear and isinstance(mlp.gate_up_proj, PackedSwiGLU)
    assert unpack_linear_layers(mlp) == 1
    assert isinstance(mlp.act, SiluAndMul)
    assert all(torch.equal(state[k], v) for k, v in mlp.state_dict().items())
    pack_linear_layers(mlp)
    assert torch.equal(mlp(x), packed_out)


@pytest.mark.gpu
def test_torch_memory_saver_releases_cuda_memory():
    """On a GPU with the torch_memory_saver package: weights come back, KV is released and the
    addresses stay the same (what CUDA graphs need)."""
    pytest.importorskip("torch_memory_saver", reason="pip install torch_memory_saver on the GPU machine")
    saver = make_saver("torch_memory_saver")
    with saver.region("weights"):
        w = torch.randn(4096, 4096, device="cuda")
    with saver.region("kv_cache"):
        kv = torch.ones(8192, 4096, device="cuda")
    ref, ptr = w.clone(), w.data_ptr()
    free0, _ = torch.cuda.mem_get_info()
    saver.pause("weights")
    saver.pause("kv_cache")
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= (w.numel() + kv.numel()) * 4 * 0.9
    saver.resume("weights")
    saver.resume("kv_cache")
    assert w.data_ptr() == ptr and torch.equal(w, ref)
