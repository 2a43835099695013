"""The ``cpu_paged`` C decode kernel against plain SDPA, on scattered pages, GQA and several threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugins.attention.cpu_paged.kernel import paged_decode_attention


def _case(bs: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_slots = 16384
    k = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    lens = torch.randint(1, 300, (bs,), generator=g)
    table = torch.zeros(bs + 5, 320, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g) + 1  # slot 0 is the padding page: never used
    rows = torch.randperm(bs + 5, generator=g)[:bs]  # rows in any order, not 0..bs-1
    used = 0
    for b in range(bs):
        n = int(lens[b])
        table[rows[b], :n] = slots[used:used + n].to(torch.int32)
        used += n
    q = torch.randn(bs, heads, head_dim, generator=g)
    return q, k, v, table, rows.to(torch.int64), lens.to(torch.int64)


def _reference(q, k, v, table, rows, lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        s = table[rows[b], : lens[b]].long()
        kb = k[s].transpose(0, 1).repeat_interleave(group, 0)
        vb = v[s].transpose(0, 1).repeat_interleave(group, 0)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], kb, vb, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("bs", [1, 3, 16, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 4, 64), (8, 2, 128), (8, 1, 64), (6, 3, 40), (6, 2, 48)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa(bs: int, heads: int, kv_heads: int, head_dim: int, threads: int,
                             kv_dtype: torch.dtype) -> None:
    """fp32 queries over an fp32 or bf16 cache; the reference is SDPA in fp32 over exactly the
    values the cache holds (bf16-rounded K/V widened back to fp32)."""
    q, k, v, table, rows, lens = _case(bs, heads, kv_heads, head_dim, seed=bs * 100 + heads + threads)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = torch.full_like(q, float("nan"))  # every element must be written
    scale = head_dim**-0.5
    paged_decode_attention(q, k, v, out, table, rows, lens, scale, threads)
    ref = _reference(q, k.float(), v.float(), table, rows, lens, scale)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_bf16_query_is_the_fp32_query_rounded(kv_dtype: torch.dtype, threads: int) -> None:
    """A bf16 query and output (a bf16 model's) give bit for bit what widening the query with
    ``.float()``, running the fp32 kernel and rounding the output with ``.bfloat16()`` gives, and
    SDPA's result to bf16 rounding."""
    q, k, v, table, rows, lens = _case(5, 8, 2, 64, seed=11)
    k, v, qb = k.to(kv_dtype), v.to(kv_dtype), q.bfloat16()
    out = torch.full_like(qb, float("nan"))
    paged_decode_attention(qb, k, v, out, table, rows, lens, 0.125, threads)
    out32 = torch.empty_like(q)
    paged_decode_attention(qb.float(), k, v, out32, table, rows, lens, 0.125, threads)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.bfloat16())
    ref = _reference(qb.float(), k.float(), v.float(), table, rows, lens, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(qb, k, v, out32, table, rows, lens, 0.125, threads)  # q and out must match


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_spans_of_a_long_request_merge_like_one_softmax(kv_dtype: torch.dtype) -> None:
    """Small batches on several threads cut each request into token spans and merge them. Peaked
    scores (large queries) give the spans maxima far apart, so a merge that did not rescale each
    span by exp(its max - the overall max) would be off by orders of magnitude; an empty request
    among them must still come out as zeros."""
    q, k, v, table, rows, lens = _case(3, 8, 2, 64, seed=7)
    g = torch.Generator().manual_seed(8)
    table = torch.zeros(8, 1200, dtype=torch.int32)
    lens = torch.tensor([1100, 0, 70])
    for b in range(3):
        table[rows[b], : lens[b]] = (torch.randperm(16383, generator=g)[: lens[b]] + 1).to(torch.int32)
    q = q * 30
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, out, table, rows, lens, 64**-0.5, 2)
    ref = _reference(q[[0, 2]], k.float(), v.float(), table, rows[[0, 2]], lens[[0, 2]], 64**-0.5)
    assert torch.allclose(out[[0, 2]], ref, atol=2e-5, rtol=1e-5), (out[[0, 2]] - ref).abs().max()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16])
def test_store_in_the_kernel_call_equals_kvcache_store(kv_dtype: torch.dtype, new_dtype: torch.dtype) -> None:
    """``new_kv`` stores this step's K/V (fp32, or bf16 from a bf16 model) before reading: the
    cache must come out bitwise what :meth:`KVCache.store` writes (bf16 rounding or widening
    included), and the output what SDPA gives over it. A slot outside the cache is an IndexError
    with nothing written."""
    from framework.memory.kv_cache import KVCache

    bs, heads, kv_heads, head_dim = 3, 8, 2, 64
    g = torch.Generator().manual_seed(3)
    ours, theirs = (KVCache(1, 60, 16, kv_heads, head_dim, kv_dtype, "cpu") for _ in range(2))
    for cache in (ours, theirs):
        cache.k_buffers[0].copy_(torch.randn(cache.k_buffers[0].shape, generator=g).to(kv_dtype))
        cache.v_buffers[0].copy_(cache.k_buffers[0].flip(0))
    theirs.k_buffers[0].copy_(ours.k_buffers[0])
    theirs.v_buffers[0].copy_(ours.v_buffers[0])
    lens = torch.tensor([5, 40, 17])
    table = torch.zeros(bs, 64, dtype=torch.int32)
    slots = torch.randperm(ours.num_slots - 1, generator=g)[: int(lens.sum())] + 1
    table[torch.arange(bs).repeat_interleave(lens), torch.cat([torch.arange(n) for n in lens.tolist()])] = \
        slots.to(torch.int32)
    loc = table[torch.arange(bs), lens - 1].to(torch.int64)  # this step's token is each request's last
    k_new = (torch.randn(bs, kv_heads * head_dim, generator=g) * 3).to(new_dtype)
    v_new = (torch.randn(bs, kv_heads * head_dim, generator=g) * 3).to(new_dtype)
    q = torch.randn(bs, heads, head_dim, generator=g)
    rows = torch.arange(bs)
    out = torch.empty_like(q)
    paged_decode_attention(q, *ours.get_kv(0), out, table, rows, lens, 0.125, 2, (k_new, v_new, loc))
    theirs.store(0, loc, k_new, v_new)
    assert torch.equal(ours.k_buffers[0], theirs.k_buffers[0]) and torch.equal(ours.v_buffers[0], theirs.v_buffers[0])
    ref = _reference(q, theirs.k_buffers[0].float(), theirs.v_buffers[0].float(), table, rows, lens, 0.125)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5)

    before = ours.k_buffers[0].clone()
    bad = loc.clone()
    bad[2] = ours.num_slots
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, *ours.get_kv(0), out, table, rows, lens, 0.125, 2, (k_new + 1, v_new, bad))
    assert torch.equal(ours.k_buffers[0], before)


def test_kernel_refuses_wrong_layouts() -> None:
    q, k, v, table, rows, lens = _case(2, 4, 2, 64, seed=0)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="req_to_token: need a contiguous CPU torch.int32"):
        paged_decode_attention(q, k, v, out, table.long(), rows, lens, 0.1, 1)
    with pytest.raises(ValueError, match="q: need a contiguous"):
        paged_decode_attention(q.transpose(0, 1), k, v, out, table, rows, lens, 0.1, 1)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, k.half(), v, out, table, rows, lens, 0.1, 1)
    with pytest.raises(ValueError, match="v_cache: need a contiguous CPU torch.bfloat16"):
        paged_decode_attention(q, k.bfloat16(), v, out, table, rows, lens, 0.1, 1)  # K and V must match


def test_kernel_threads_are_torchs_openmp_workers() -> None:
    """With gcc the kernel is built with OpenMP and, inside torch's process, must run on the OpenMP
    runtime torch already loaded: a second runtime (or the pthread variant) would put its threads on
    cores where torch's workers still spin after each parallel region, which measured 2x slower per
    decode layer at batch 64."""
    from plugins.attention.cpu_paged.kernel import kernel_threading

    if "OpenMP" not in torch.__config__.parallel_info() or "Free Software Foundation" not in _cc_version():
        pytest.skip("needs gcc and a torch built with OpenMP (the CPU wheel is); the kernel falls back to pthreads")
    with open("/proc/self/maps") as maps:
        if any("libiomp" in line for line in maps):
            pytest.skip("this torch runs Intel's OpenMP; a gcc-built kernel brings libgomp as a second runtime "
                        "(correct, but its threads compete with torch's)")
    assert kernel_threading() == "openmp"
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def _cc_version() -> str:
    import subprocess

    from plugins.attention.cpu_paged.kernel import compiler

    cc = compiler()
    return "" if cc is None else subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def test_the_backend_leaves_the_store_to_a_pool_that_overrides_it() -> None:
    """The kernel stores K/V itself only for :class:`KVCache`'s own ``store``: a pool subclass that
    overrides it (a plugin may track or transform writes) gets its ``store`` called, and K/V the
    kernel cannot read as they are (strided, not fp32) go through ``store`` too."""
    from framework.memory.kv_cache import KVCache
    from plugins.attention.cpu_paged.backend import _kernel_store

    class TrackingCache(KVCache):
        def store(self, layer_id, loc, k, v):  # noqa: ANN001, ANN202
            super().store(layer_id, loc, k, v)

    plain, tracking = (cls(1, 4, 16, 2, 8, torch.float32, "cpu") for cls in (KVCache, TrackingCache))
    k, v, loc = torch.randn(3, 16), torch.randn(3, 16), torch.tensor([1, 2, 3])
    assert _kernel_store(plain, k, v, loc) == (k, v, loc)
    assert _kernel_store(tracking, k, v, loc) is None
    assert _kernel_store(plain, torch.randn(3, 32)[:, :16], v, loc) is None
    assert _kernel_store(plain, k.bfloat16(), v, loc) is None
    assert _kernel_store(plain, k, v, loc.int()) is None
