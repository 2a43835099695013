"""The torch_native backend against plain SDPA on contiguous, unpaged K/V with an explicit causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.attention.base import Attention
from plugins.attention import torch_native
from plugins.attention.torch_native import TorchNativeAttnBackend, TorchNativeOptions
from tests.engine.harness import MiniRunner

NUM_LAYERS = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries ``q [n, H, D]`` are the last ``n`` of the ``k, v [S, Hkv, D]`` sequence; causal."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(s - n, s)[:, None]
    mask = torch.arange(s)[None, :] <= query_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


class Case:
    """One backend over a MiniRunner plus the full (unpaged) K/V history of every request."""

    def __init__(self, page_size: int, num_heads: int, num_kv_heads: int, head_dim: int, **opts: int) -> None:
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        options = TorchNativeOptions(**opts)
        self.runner = MiniRunner(
            TorchNativeAttnBackend,
            num_layers=NUM_LAYERS,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            backend_options=options,
            page_size=page_size,
            num_pages=4096 // page_size,
        )
        self.layers = [
            Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, layer_id=i) for i in range(NUM_LAYERS)
        ]
        self.history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(1234)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def step(self, fb, rows: list[int], new_lens: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run every layer on random q/k/v; return (backend output, reference) per layer per request."""
        n = sum(new_lens)
        results = []
        for layer in self.layers:
            q = self.rand(n, self.h * self.d)
            k, v = self.rand(n, self.hkv * self.d), self.rand(n, self.hkv * self.d)
            out = fb.attn_backend.forward(q, k, v, layer, fb).view(n, self.h, self.d)
            per_req, start = [], 0
            for row, m in zip(rows, new_lens, strict=True):
                sl = slice(start, start + m)
                ki, vi = k[sl].view(m, self.hkv, self.d), v[sl].view(m, self.hkv, self.d)
                old_k, old_v = self.history.get((layer.layer_id, row), (ki[:0], vi[:0]))
                full_k, full_v = torch.cat((old_k, ki)), torch.cat((old_v, vi))
                self.history[(layer.layer_id, row)] = (full_k, full_v)
                ref = reference(q[sl].view(m, self.h, self.d), full_k, full_v, layer.scaling)
                per_req.append((out[sl], ref))
                start += m
            results.append(per_req)
        return results

    def extend(self, rows: list[int], lens: list[int]):
        fb = self.runner.extend_batch(rows, [[0] * n for n in lens])
        return self.step(fb, rows, lens)

    def decode(self, rows: list[int]):
        fb = self.runner.decode_batch(rows, [0] * len(rows))
        return self.step(fb, rows, [1] * len(rows))

    def check_cache(self, rows: list[int]) -> None:
        """The paged cache holds exactly each request's K/V history at the slots its table row names."""
        for (layer_id, row), (full_k, full_v) in self.history.items():
            if row not in rows:
                continue
            slots = self.runner.req_to_token[row, : full_k.shape[0]].long()
            k_buf, v_buf = self.runner.kv_cache.get_kv(layer_id)
            torch.testing.assert_close(k_buf[slots], full_k, rtol=0, atol=0)
            torch.testing.assert_close(v_buf[slots], full_v, rtol=0, atol=0)


def assert_all_close(results) -> None:
    for per_req in results:
        for out, ref in per_req:
            torch.testing.assert_close(out, ref)


SHAPES = pytest.mark.parametrize(
    "page_size,num_heads,num_kv_heads,head_dim",
    [
        (ps, h, hkv, d)
        for ps in (1, 16)
        for (h, hkv) in ((4, 4), (8, 2))  # GQA ratio 1 and 4
        for d in (64, 128)
    ],
)


@SHAPES
def test_extend_mixed_prompt_lengths(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = Case(page_size, num_heads, num_kv_heads, head_dim)
    rows = [case.runner.new_request() for _ in range(4)]
    assert_all_close(case.extend(rows, [1, 7, 20, 33]))
    case.check_cache(rows)


@SHAPES
def test_extend_on_cached_prefix(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = Case(page_size, num_heads, num_kv_heads, head_dim)
    rows = [case.runner.new_request() for _ in range(4)]
    case.extend(rows[:3], [5, 16, 30])  # rows[3] gets no prefix: mixed with prefixed ones below
    assert_all_close(case.extend(rows, [3, 9, 12, 6]))
    # A third chunk on top of a prefix that itself came from two extends.
    assert_all_close(case.extend(rows[1:], [1, 17, 4]))
    case.check_cache(rows)


@SHAPES
def test_decode_mixed_context_lengths(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = Case(page_size, num_heads, num_kv_heads, head_dim)
    rows = [case.runner.new_request() for _ in range(5)]
    case.extend(rows, [1, 9, 16, 40, 63])
    for _ in range(3):  # the 16 and 63 contexts cross a page boundary here
        assert_all_close(case.decode(rows))
    # A decode batch that is a subset, in a different order, of the requests.
    assert_all_close(case.decode([rows[3], rows[0]]))
    case.check_cache(rows)


@pytest.mark.parametrize("cap", [1, 50, 200])
def test_decode_split_into_gather_groups(cap: int) -> None:
    """A small gather cap splits the decode batch into several groups; results must not change."""
    case = Case(16, 8, 2, 64, decode_max_gather_tokens=cap)
    rows = [case.runner.new_request() for _ in range(6)]
    case.extend(rows, [3, 30, 7, 45, 12, 1])
    for _ in range(2):
        assert_all_close(case.decode(rows))
    groups = case.runner.decode_batch(rows, [0] * len(rows)).attn_metadata
    assert len(groups) > 1
    assert sum(g.size for g in groups) == len(rows)


def test_registered_through_hook() -> None:
    registered = {}

    def register(name, factory, config=None, capabilities=None):
        registered[name] = (factory, config, capabilities)

    torch_native.register_attention_backends(register)
    factory, config, capabilities = registered["torch_native"]
    assert config is TorchNativeOptions
    assert capabilities.cuda_graph and set(capabilities.devices) == {"cpu", "cuda"}
    runner = MiniRunner(factory, num_layers=1, num_kv_heads=1, head_dim=8)
    assert isinstance(runner.attn_backend, TorchNativeAttnBackend)
