"""The ``cpu_paged`` C extend (prefill) kernel against plain SDPA: scattered pages, cached
prefixes, GQA, head sizes, both cache types and several threads; bf16 queries on AMX tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugins.attention.cpu_paged.kernel import (
    extend_amx_supported,
    extend_supported,
    paged_extend_attention,
    store_kv_rows,
)


def _case(prefix_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs, num_slots = len(q_lens), 8192
    k = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    width = max(p + n for p, n in zip(prefix_lens, q_lens, strict=True)) + 3
    table = torch.zeros(bs + 3, width, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g) + 1  # slot 0 is the padding page: never used
    rows = torch.randperm(bs + 3, generator=g)[:bs]  # rows in any order
    used = 0
    for b, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        table[rows[b], : p + n] = slots[used:used + p + n].to(torch.int32)
        used += p + n
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g) * 2  # sharper softmax than unit scores
    return q, k, v, table, rows.to(torch.int64)


def _reference(q, k, v, table, rows, prefix_lens, q_lens, scale):
    """Per request: SDPA over its whole context with the causal mask at its absolute positions."""
    out, start = torch.empty_like(q), 0
    for b, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        s = table[rows[b], : p + n].long()
        mask = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        qb = q[start:start + n].transpose(0, 1)[None]
        kb, vb = k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


CASES = [
    ([0], [1]),                     # one token, no prefix
    ([0, 0, 0], [128, 5, 17]),      # fresh prompts, lengths off the 4-row and 16-key blocks
    ([33, 0, 100], [1, 64, 50]),    # cached prefixes next to a fresh prompt
    ([200], [3]),                   # a long prefix, a short chunk
    ([0, 16], [16, 16]),            # exactly on the block sizes
]


@pytest.mark.parametrize(("prefix_lens", "q_lens"), CASES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 128), (4, 1, 32), (6, 3, 48)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa(prefix_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                             threads: int, kv_dtype: torch.dtype) -> None:
    """The reference is fp32 SDPA over exactly the values the cache holds (bf16 K/V widened back)."""
    q, k, v, table, rows = _case(prefix_lens, q_lens, heads, kv_heads, head_dim, seed=sum(q_lens) + head_dim)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = torch.full_like(q, float("nan"))  # every element must be written
    scale = head_dim**-0.5
    paged_extend_attention(q, k, v, out, table, rows, torch.tensor(prefix_lens), torch.tensor(q_lens), scale,
                           threads)
    ref = _reference(q, k.float(), v.float(), table, rows, prefix_lens, q_lens, scale)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), (out - ref).abs().max()


needs_amx = pytest.mark.skipif(
    not extend_amx_supported(64),
    reason="bf16 queries run on AMX tiles, which this CPU, OS or kernel build lacks (Sapphire Rapids and later)")


@needs_amx
@pytest.mark.parametrize(("prefix_lens", "q_lens"), CASES + [([0, 0, 0, 0], [128] * 4), ([300], [77])])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 128), (4, 1, 32), (6, 3, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_kernel_matches_sdpa(prefix_lens: list[int], q_lens: list[int], heads: int, kv_heads: int,
                                 head_dim: int, threads: int) -> None:
    """bf16 q, cache and output. The reference is fp32 SDPA over the same bf16 values; the bound is
    what the kernel rounds: each probability to bf16 (at most 2^-9 of it, so 2^-9 max|v| on the
    output and 2^-9 |o| through their sum) and the output to bf16 (2^-9 |o|), with a factor of
    two to spare on the first."""
    q, k, v, table, rows = _case(prefix_lens, q_lens, heads, kv_heads, head_dim, seed=sum(q_lens) + head_dim)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = torch.full_like(q, float("nan"))  # every element must be written
    scale = head_dim**-0.5
    paged_extend_attention(q, k, v, out, table, rows, torch.tensor(prefix_lens), torch.tensor(q_lens), scale,
                           threads)
    ref = _reference(q.float(), k.float(), v.float(), table, rows, prefix_lens, q_lens, scale)
    bound = 2**-8 * ref.abs() + 2**-8 * v.float().abs().max()
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), (err - bound).max()


@needs_amx
def test_amx_kernel_refuses_what_it_cannot_take() -> None:
    q, k, v, table, rows = _case([0], [8], 4, 2, 48, seed=0)
    pre, n = torch.tensor([0]), torch.tensor([8])
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with pytest.raises(RuntimeError, match="status 2"):  # 48 is not a multiple of the tiles' 32
        paged_extend_attention(qb, kb, vb, torch.empty_like(qb), table, rows, pre, n, 0.1, 1)
    with pytest.raises(ValueError, match="k_cache: need a contiguous CPU torch.bfloat16"):  # bf16 q, fp32 cache
        paged_extend_attention(qb, k, v, torch.empty_like(qb), table, rows, pre, n, 0.1, 1)
    assert not extend_amx_supported(48) and not extend_amx_supported(256) and extend_amx_supported(128)


def test_head_sizes_it_takes() -> None:
    assert [d for d in (16, 40, 48, 64, 80, 96, 128, 256) if extend_supported(d)] == [16, 48, 64, 80, 96, 128]


def test_kernel_refuses_wrong_layouts() -> None:
    q, k, v, table, rows = _case([0], [8], 4, 2, 64, seed=0)
    out, pre, n = torch.empty_like(q), torch.tensor([0]), torch.tensor([8])
    with pytest.raises(ValueError, match="req_to_token: need a contiguous CPU torch.int32"):
        paged_extend_attention(q, k, v, out, table.long(), rows, pre, n, 0.1, 1)
    with pytest.raises(ValueError, match="q_lens: need a contiguous CPU torch.int64"):
        paged_extend_attention(q, k, v, out, table, rows, pre, n.int(), 0.1, 1)
    with pytest.raises(ValueError, match="q has 8 rows but q_lens sum to 7"):
        paged_extend_attention(q, k, v, out, table, rows, pre, torch.tensor([7]), 0.1, 1)
    with pytest.raises(RuntimeError, match="status 2"):  # a head size the kernel does not take
        paged_extend_attention(q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous(),
                               out[..., :40].contiguous(), table, rows, pre, n, 0.1, 1)


@pytest.mark.parametrize(("new_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("n", [1, 64, 65, 300])  # whole and partial 64-row chunks, one thread and two
def test_store_kv_rows_writes_what_index_put_writes(new_dtype: torch.dtype, kv_dtype: torch.dtype, n: int) -> None:
    """The extend path's C store against torch's index_put (what ``KVCache.store`` does), byte for
    byte, every other slot untouched; a slot outside the cache is an error and writes nothing."""
    slots, heads, dim = 512, 3, 40
    g = torch.Generator().manual_seed(n)
    k_cache, v_cache = (torch.randn(slots, heads, dim, generator=g).to(kv_dtype) for _ in range(2))
    k, v = ((torch.randn(n, heads * dim, generator=g) * 3).to(new_dtype) for _ in range(2))
    loc = torch.randperm(slots, generator=g)[:n]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref[loc] = k.view(n, heads, dim).to(kv_dtype)
    v_ref[loc] = v.view(n, heads, dim).to(kv_dtype)
    store_kv_rows(k_cache, v_cache, k, v, loc, 2)
    as_bits = torch.int16 if kv_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(k_cache.view(as_bits), k_ref.view(as_bits))
    assert torch.equal(v_cache.view(as_bits), v_ref.view(as_bits))
    bad = loc.clone()
    bad[-1] = slots
    with pytest.raises(IndexError, match="outside the cache's 512 slots"):
        store_kv_rows(k_cache, v_cache, k + 1, v + 1, bad, 2)
    assert torch.equal(k_cache.view(as_bits), k_ref.view(as_bits))
    with pytest.raises(ValueError, match="store_kv_rows: need"):
        store_kv_rows(k_cache, v_cache, k, v, loc[:1] if n > 1 else loc.repeat(2), 2)
