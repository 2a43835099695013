"""Triton kernels over the paged KV cache: the KV store and one attention kernel for extend and decode.

Importing this module decorates the kernels, and Triton decides then whether they are compiled or
run by its interpreter (``TRITON_INTERPRET=1``, the way they are tested on CPU): import it only
after the environment is settled (the backend imports it lazily).

Layout: each layer's K (V) buffer is ``[num_slots, kv_heads, head_dim]`` contiguous, and
``req_to_token[row, pos]`` is the slot of token ``pos`` of the request in pool row ``row``, so the
kernels need no notion of pages: pages only decide which slots a request owns.

Inside the kernels all arithmetic is float32 whatever the storage dtype (fp16/bf16 are loaded and
converted): it is what flash-attention style kernels accumulate in anyway, and the interpreter
gets raw bf16 arithmetic wrong.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Loc,
    num_tokens,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    """Copy ``BLOCK_T`` tokens' K and V rows (``kv_heads * head_dim`` values) to their cache slots."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.arange(0, BLOCK_ROW).to(tl.int64)
    t_ok = t < num_tokens
    ok = t_ok[:, None] & (col[None, :] < ROW)
    slot = tl.load(Loc + t, mask=t_ok, other=0).to(tl.int64)
    k = tl.load(K + t[:, None] * stride_k + col[None, :], mask=ok, other=0.0)
    v = tl.load(V + t[:, None] * stride_v + col[None, :], mask=ok, other=0.0)
    dst = slot[:, None] * ROW + col[None, :]
    tl.store(K_cache + dst, k.to(tl.float32).to(K_cache.dtype.element_ty), mask=ok)
    tl.store(V_cache + dst, v.to(tl.float32).to(V_cache.dtype.element_ty), mask=ok)


@triton.jit
def paged_attention_kernel(
    Q,
    K_cache,
    V_cache,
    Out,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Prefix_lens,
    Q_starts,
    stride_q,
    stride_o,
    stride_table,
    sm_scale,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Causal attention of one request's new queries over its whole paged context.

    Program ``(request, kv_head, block)`` handles ``BLOCK_R // GROUP`` consecutive queries times
    the ``GROUP`` query heads that share ``kv_head`` (GQA without repeating K/V): row ``r`` is query
    ``r // GROUP`` of the block, head ``kv_head * GROUP + r % GROUP``. Query ``m`` sits at absolute
    position ``prefix + m`` and sees keys ``0 .. prefix + m``. The new tokens' K/V are already in
    the cache, so one loop over the request's slots covers prefix and new tokens alike. Decode is
    the case ``q_len == 1``. Online softmax (flash-attention), float32 throughout.
    """
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2).to(tl.int64)
    QUERIES: tl.constexpr = BLOCK_R // GROUP
    # Index arithmetic in int64: no int32 overflow on big caches (and no overflow checks to run
    # per operation under the interpreter).
    seq_len = tl.load(Seq_lens + req).to(tl.int64)
    prefix = tl.load(Prefix_lens + req).to(tl.int64)
    q_len = seq_len - prefix
    if block * QUERIES >= q_len:
        return
    q_start = tl.load(Q_starts + req).to(tl.int64)
    table_row = tl.load(Req_pool_indices + req).to(tl.int64) * stride_table

    rows = tl.arange(0, BLOCK_R).to(tl.int64)
    m = block * QUERIES + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < QUERIES * GROUP) & (m < q_len)
    d = tl.arange(0, HEAD_DIM).to(tl.int64)
    q_off = (q_start + m)[:, None] * stride_q + head[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_pos = prefix + m

    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    # Keys beyond the block's last query are masked for every row: stop there.
    end = tl.minimum(seq_len, prefix + (block + 1) * QUERIES)
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        n_ok = n < end
        slot = tl.load(Req_to_token + table_row + n, mask=n_ok, other=0).to(tl.int64)
        kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        k = tl.load(K_cache + kv_off, mask=n_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        # Key 0 is visible to every row, so after the first step m_new is finite for all rows.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + kv_off, mask=n_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = (q_start + m)[:, None] * stride_o + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
