/*
 * Paged extend (prefill) attention on CPU: causal attention of each request's new tokens over its
 * cached prefix and themselves, reading K/V through the page table after they were stored.
 *
 * Why a kernel: torch's SDPA ran one call per request and layer (768 calls for a 64-prompt prefill)
 * at ~65 GFLOP/s for 128-token prompts, ~4% of the reference workload; a request with a cached
 * prefix also paid for an index_select, a cat and a boolean mask per layer. Here every (request,
 * kv head) is one work item on torch's OpenMP workers, and the arithmetic is register-blocked:
 * R query rows at a time against a vector of keys (scores) or one value row (output), so each load feeds
 * R fused multiply-adds.
 *
 * Layout:
 *   q, out   [tokens, num_heads, head_dim]          float32, contiguous; request b's queries are
 *                                                   rows q_start[b] .. q_start[b] + q_len[b] - 1
 *   k, v     [num_slots, kv_heads, head_dim]        float32 or bfloat16 (widened on load, exact)
 *   table    [rows, table_stride] int32             slot of each token position of each request row
 *   rows, prefix_lens, q_lens  [bs] int64           query i of request b sits at position
 *                                                   prefix_lens[b] + i and sees keys 0 .. that position
 * head_dim must be a multiple of 16 (the caller falls back to SDPA otherwise).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_float.h"

/* A vector is one register: 16 floats with AVX-512, else 8 (AVX2). gcc splits a 16-float vector
 * into two AVX2 registers, which doubled the blocks' register need and spilled the output
 * accumulators: prefill attention ran at ~5 GFLOP/s on an AVX2-only host, slower than SDPA. */
#ifdef __AVX512F__
#define VF_LANES 16
#else
#define VF_LANES 8
#endif
typedef float vf __attribute__((vector_size(VF_LANES * 4), aligned(VF_LANES * 4)));
typedef int32_t vi __attribute__((vector_size(VF_LANES * 4), aligned(VF_LANES * 4)));

/* max of s[0 .. n-1], n >= 1, s 64-byte aligned: VF_LANES lanes at a time (gcc leaves the scalar
 * ternary loop unvectorised without -ffinite-math-only, and it was ~7% of the kernel). */
static inline float row_max(const float *s, int64_t n) {
    float m = s[0];
    int64_t t = 0;
    if (n >= VF_LANES) {
        vf acc = *(const vf *)s;
        for (t = VF_LANES; t + VF_LANES <= n; t += VF_LANES) {
            const vf x = *(const vf *)(s + t);
            const vi gt = x > acc;
            acc = (vf)(((vi)x & gt) | ((vi)acc & ~gt));
        }
        for (int64_t l = 0; l < VF_LANES; ++l) m = acc[l] > m ? acc[l] : m;
    }
    for (; t < n; ++t) m = s[t] > m ? s[t] : m;
    return m;
}

typedef struct {
    float *kt;    /* [padded keys / VF_LANES][head_dim][VF_LANES]: K transposed in blocks of VF_LANES keys, each block
                   * contiguous (a plain transpose put a block's rows 4 KB apart: L1 set conflicts) */
    float *v;     /* [keys][head_dim] */
    float *s;     /* [R][padded keys] scores, then probabilities */
    int64_t cap;  /* padded keys the buffers hold */
} scratch_t;

static int reserve(scratch_t *w, int64_t keys, int64_t d) {
    if (keys <= w->cap) return 0;
    free(w->kt);
    free(w->v);
    free(w->s);
    w->kt = aligned_alloc(64, sizeof(float) * (size_t)(d * keys));
    w->v = aligned_alloc(64, sizeof(float) * (size_t)(d * keys));
    w->s = aligned_alloc(64, sizeof(float) * (size_t)(4 * keys));
    w->cap = (w->kt && w->v && w->s) ? keys : 0;
    return w->cap ? 0 : 1;
}

/* One request and kv head: gather its K (transposed) and V once, then run every query head of the
 * group over them, R query rows at a time. D and R are compile-time constants at each call site
 * (the function is force-inlined into one wrapper per head size), so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) int run_item(
    const float *q, const void *k, const void *v, float *out, const int32_t *slots, int64_t prefix, int64_t q_len,
    int64_t q_start, int64_t kvh, int64_t num_heads, int64_t kv_heads, float scale, int bf16, scratch_t *w,
    const int64_t D, const int64_t R) {
    const int64_t keys = prefix + q_len, padded = (keys + VF_LANES - 1) / VF_LANES * VF_LANES, V = D / VF_LANES;
    if (reserve(w, padded, D)) return 1;
    /* Gather: V of a bf16 cache widened row by row (fp32 V is read in place); K a block of VF_LANES
     * rows at a time, then transposed, so that VF_LANES consecutive keys are one vector. */
    float rows16[VF_LANES * 128] __attribute__((aligned(64))); /* one block's K rows, D <= 128 */
    for (int64_t b = 0; b < padded / VF_LANES; ++b) {
        for (int64_t l = 0; l < VF_LANES; ++l) {
            const int64_t t = b * VF_LANES + l;
            float *kr_out = rows16 + l * D;
            if (t >= keys) {
                memset(kr_out, 0, sizeof(float) * (size_t)D);
                continue;
            }
            const int64_t elem = ((int64_t)slots[t] * kv_heads + kvh) * D;
            if (bf16) {
                const uint16_t *kr = (const uint16_t *)k + elem, *vs = (const uint16_t *)v + elem;
                float *vr = w->v + t * D;
                for (int64_t e = 0; e < D; ++e) {
                    vr[e] = bf16_to_float(vs[e]);
                    kr_out[e] = bf16_to_float(kr[e]);
                }
            } else {
                memcpy(kr_out, (const float *)k + elem, sizeof(float) * (size_t)D);
            }
        }
        float *blk = w->kt + b * D * VF_LANES;
        for (int64_t e = 0; e < D; ++e)
            for (int64_t l = 0; l < VF_LANES; ++l) blk[e * VF_LANES + l] = rows16[l * D + e];
    }
    const int64_t group = num_heads / kv_heads;
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t i0 = 0; i0 < q_len; i0 += R) {
            const int64_t nr = q_len - i0 < R ? q_len - i0 : R;
            const int64_t last = prefix + i0 + nr - 1; /* the block's last query position */
            const int64_t nblk = last / VF_LANES + 1;
            const float *qr[4];
            for (int64_t r = 0; r < R; ++r) qr[r] = q + ((q_start + i0 + (r < nr ? r : 0)) * num_heads + h) * D;
            /* scores: R rows x 2 blocks of VF_LANES keys at a time (2R independent accumulators hide the
             * multiply-add latency, and each broadcast query element feeds two of them) */
            for (int64_t b = 0; b < nblk; b += 2) {
                const int64_t b1 = b + 1 < nblk ? b + 1 : b; /* an odd last block is done twice */
                vf acc0[4] = {0}, acc1[4] = {0};
                const float *blk0 = w->kt + b * D * VF_LANES, *blk1 = w->kt + b1 * D * VF_LANES;
                for (int64_t e = 0; e < D; ++e) {
                    const vf k0 = *(const vf *)(blk0 + e * VF_LANES), k1 = *(const vf *)(blk1 + e * VF_LANES);
                    for (int64_t r = 0; r < R; ++r) {
                        const float x = qr[r][e];
                        acc0[r] += x * k0;
                        acc1[r] += x * k1;
                    }
                }
                for (int64_t r = 0; r < R; ++r) {
                    *(vf *)(w->s + r * padded + b * VF_LANES) = acc0[r] * scale;
                    *(vf *)(w->s + r * padded + b1 * VF_LANES) = acc1[r] * scale;
                }
            }
            /* softmax over keys 0 .. position of each row; later keys get probability 0 */
            float inv[4];
            for (int64_t r = 0; r < R; ++r) {
                float *s = w->s + r * padded;
                const int64_t n = prefix + i0 + (r < nr ? r : 0) + 1;
                const float m = row_max(s, n);
                float sum = 0.0f;
                for (int64_t t = 0; t < n; ++t) {
                    s[t] = exp_nonpositive(s[t] - m);
                    sum += s[t];
                }
                for (int64_t t = n; t <= last; ++t) s[t] = 0.0f;
                inv[r] = 1.0f / sum;
            }
            /* output: each value row is loaded once for the R rows */
            vf o[4][128 / VF_LANES]; /* only [R][D / VF_LANES] is used: zero just that (zeroing all 32 was ~10% of the time) */
            for (int64_t r = 0; r < R; ++r)
                for (int64_t c = 0; c < V; ++c) o[r][c] = (vf){0};
            for (int64_t t = 0; t <= last; ++t) {
                /* fp32 values are read in place from the cache; bf16 ones were widened into the
                 * scratch buffer above */
                const float *vr = bf16 ? w->v + t * D : (const float *)v + ((int64_t)slots[t] * kv_heads + kvh) * D;
                for (int64_t c = 0; c < V; ++c) {
                    vf x;
                    memcpy(&x, vr + c * VF_LANES, sizeof x); /* the cache promises no alignment */
#ifdef __AVX512F__
                    /* Keep the value vector in a register: gcc otherwise folds the load into each
                     * of the R multiply-adds as a memory operand, R loads instead of one. */
                    __asm__("" : "+v"(x));
#endif
                    for (int64_t r = 0; r < R; ++r) o[r][c] += w->s[r * padded + t] * x;
                }
            }
            for (int64_t r = 0; r < nr; ++r) {
                float *dst = out + ((q_start + i0 + r) * num_heads + h) * D;
                for (int64_t c = 0; c < V; ++c) {
                    const vf y = o[r][c] * inv[r];
                    memcpy(dst + c * VF_LANES, &y, sizeof y);
                }
            }
        }
    }
    return 0;
}

#define ITEM_ARGS                                                                                            \
    const float *q, const void *k, const void *v, float *out, const int32_t *slots, int64_t prefix, int64_t q_len, \
        int64_t q_start, int64_t kvh, int64_t num_heads, int64_t kv_heads, float scale, int bf16, scratch_t *w
#define ITEM_CALL q, k, v, out, slots, prefix, q_len, q_start, kvh, num_heads, kv_heads, scale, bf16, w
#define ITEM_CALL_BF16(flag) q, k, v, out, slots, prefix, q_len, q_start, kvh, num_heads, kv_heads, scale, flag, w

/* One wrapper per head size and K/V type, with as many query rows at a time as keep the output
 * accumulators (R x D / VF_LANES vectors) within the registers: with AVX-512's 32, 4 rows of 64 and
 * 2 of 128; with AVX2's 16, 2 rows of 64 (4 measured 1.2x slower on an AVX2 host) and 1 of 128.
 * Other multiples of 16 run one row at a time with the head size a run-time value. */
#if VF_LANES == 16
#define ROWS_D64 4
#define ROWS_D128 2
#else
#define ROWS_D64 2
#define ROWS_D128 1
#endif
#define BOTH_TYPES(d, r) (bf16 ? run_item(ITEM_CALL_BF16(1), d, r) : run_item(ITEM_CALL_BF16(0), d, r))
static int item_d64(ITEM_ARGS) { return BOTH_TYPES(64, ROWS_D64); }
static int item_d128(ITEM_ARGS) { return BOTH_TYPES(128, ROWS_D128); }
static int item_d32(ITEM_ARGS) { return BOTH_TYPES(32, 4); }
static int item_d16x(ITEM_ARGS, int64_t d) { return run_item(ITEM_CALL, d, 1); }

/* Returns 0 on success; 1 when memory ran out; 2 for head counts or a head_dim it does not take
 * (not a multiple of 16, or over 128). */
int paged_extend_attention(const float *q, const void *k, const void *v, float *out, const int32_t *table,
                           int64_t table_stride, const int64_t *rows, const int64_t *prefix_lens,
                           const int64_t *q_lens, int64_t bs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                           float scale, int64_t num_threads, int64_t kv_bf16) {
    if (bs <= 0) return 0;
    if (kv_heads <= 0 || num_heads % kv_heads != 0 || head_dim % 16 != 0 || head_dim > 128) return 2;
    int64_t *q_start = malloc(sizeof(int64_t) * (size_t)bs);
    if (!q_start) return 1;
    for (int64_t b = 0, acc = 0; b < bs; ++b) {
        q_start[b] = acc;
        acc += q_lens[b];
    }
    const int64_t items = bs * kv_heads;
    int status = 0;
    if (num_threads < 1) num_threads = 1;
    /* Items differ in cost (prompt lengths, prefixes): hand them out one at a time. */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1) reduction(| : status)
    {
        scratch_t w = {NULL, NULL, NULL, 0};
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / kv_heads, kvh = item % kv_heads;
            if (q_lens[b] <= 0) continue;
            const int32_t *slots = table + rows[b] * table_stride;
            const int bf16 = kv_bf16 != 0;
            const int64_t prefix = prefix_lens[b], q_len = q_lens[b], qs = q_start[b];
            int rc;
#define ARGS q, k, v, out, slots, prefix, q_len, qs, kvh, num_heads, kv_heads, scale, bf16, &w
            switch (head_dim) {
                case 64: rc = item_d64(ARGS); break;
                case 128: rc = item_d128(ARGS); break;
                case 32: rc = item_d32(ARGS); break;
                default: rc = item_d16x(ARGS, head_dim);
            }
#undef ARGS
            status |= rc;
        }
        free(w.kt);
        free(w.v);
        free(w.s);
    }
    free(q_start);
    return status;
}
