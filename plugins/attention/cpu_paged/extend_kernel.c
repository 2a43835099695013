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

/* Grow a thread's n scratch buffers (kept from one work item to the next) to hold `keys` keys,
 * per_key[i] bytes each in buffer i, 64-byte aligned; *cap is the keys they hold. 1 when memory ran
 * out (then they hold none). */
static int grow_scratch(void **bufs, const size_t *per_key, int n, int64_t *cap, int64_t keys) {
    if (keys <= *cap) return 0;
    int ok = 1;
    for (int i = 0; i < n; ++i) {
        free(bufs[i]);
        bufs[i] = aligned_alloc(64, per_key[i] * (size_t)keys);
        ok &= bufs[i] != NULL;
    }
    *cap = ok ? keys : 0;
    return !ok;
}

static int reserve(scratch_t *w, int64_t keys, int64_t d) {
    void *bufs[3] = {w->kt, w->v, w->s};
    const size_t per_key[3] = {sizeof(float) * (size_t)d, sizeof(float) * (size_t)d, sizeof(float) * 4};
    const int rc = grow_scratch(bufs, per_key, 3, &w->cap, keys);
    w->kt = bufs[0], w->v = bufs[1], w->s = bufs[2];
    return rc;
}

/* Each request's first query row (the running sum of q_lens), malloc'd; NULL when memory ran out. */
static int64_t *query_starts(const int64_t *q_lens, int64_t bs) {
    int64_t *start = malloc(sizeof(int64_t) * (size_t)bs);
    for (int64_t b = 0, acc = 0; start && b < bs; ++b) {
        start[b] = acc;
        acc += q_lens[b];
    }
    return start;
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
    int64_t *q_start = query_starts(q_lens, bs);
    if (!q_start) return 1;
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

/* ---- bf16 queries and cache on AMX tiles (Sapphire Rapids and later) ----
 *
 * Why: on the vector path above a bf16 model's prompt attention was a fifth of a 4 x 128-token
 * prefill on the Sapphire Rapids host (19 ms of ~100, the GEMMs running on oneDNN's AMX tiles), as
 * the queries were widened to fp32 on the way in and the output rounded back on the way out. Here
 * both products run on the tiles: per 16 query rows, scores = Q K^T in 16 x 16 tiles (TDPBF16PS:
 * bf16 pairs multiplied exactly, summed in fp32), the softmax in fp32 vectors, then the
 * probabilities rounded to bf16 and P V in tiles of 16 rows x 16 dims, the way torch's own CPU
 * flash attention rounds them for its second GEMM. Tiles 4-7 hold a block's query chunks while its
 * scores are computed (tile 0 the scores, 1 the keys); for P V tiles 0-3 are the output, 4 the
 * probabilities, 5 the values. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_amx.h"
#define EXTEND_AMX 1
#define TILE 16     /* rows of every tile; keys of a score tile; dims of an output tile */
#define PAIRS 32    /* bf16 along a tile row: 16 pairs */

typedef struct {
    uint32_t *kb;  /* keys as B tiles of Q K^T: [key block][d chunk][pair of dims][16 keys] (a pair is 32 bits) */
    uint16_t *vb;  /* values as B tiles of P V: [key chunk of 32][d tile][pair of keys][16 dims][2] */
    uint16_t *pb;  /* [16][keys32] probabilities */
    float *s;      /* [16][keys32] scores */
    int64_t cap;   /* keys32 the buffers hold */
} amx_scratch;

static int amx_reserve(amx_scratch *w, int64_t keys32, int64_t d) {
    void *bufs[4] = {w->kb, w->vb, w->pb, w->s};
    const size_t per_key[4] = {sizeof(uint16_t) * (size_t)d, sizeof(uint16_t) * (size_t)d, sizeof(uint16_t) * TILE,
                               sizeof(float) * TILE};
    const int rc = grow_scratch(bufs, per_key, 4, &w->cap, keys32);
    w->kb = bufs[0], w->vb = bufs[1], w->pb = bufs[2], w->s = bufs[3];
    return rc;
}

/* One request's K and V of kv head kvh into the tile layouts; keys from `keys` to keys32 are zero
 * (finite, and their probabilities are zero). Vectorised: written element by element the gather
 * took as long as the attention itself at 128-token prompts. */
static void amx_gather(const uint16_t *k, const uint16_t *v, const int32_t *slots, int64_t keys, int64_t keys32,
                       int64_t kv_heads, int64_t kvh, int64_t D, amx_scratch *w) {
    const int64_t chunks = D / PAIRS, dtiles = D / TILE;
    /* K: tile row p of a 16-key block holds dim pair p of each key, a 32-bit gather per row */
    for (int64_t j = 0; j < keys32 / TILE; ++j) {
        int64_t at[TILE];
        __mmask16 valid = 0;
        for (int64_t n = 0; n < TILE; ++n) {
            const int64_t t = j * TILE + n;
            at[n] = t < keys ? ((int64_t)slots[t] * kv_heads + kvh) * D / 2 : 0;
            valid |= (__mmask16)((t < keys) << n);
        }
        const __m512i lo = _mm512_loadu_si512(at), hi = _mm512_loadu_si512(at + 8);
        uint32_t *dst = w->kb + j * chunks * TILE * TILE;
        for (int64_t p = 0; p < D / 2; ++p) {
            const __m512i off = _mm512_set1_epi64(p);
            const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), (__mmask8)valid,
                                                          _mm512_add_epi64(lo, off), k, 4);
            const __m256i b = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), (__mmask8)(valid >> 8),
                                                          _mm512_add_epi64(hi, off), k, 4);
            _mm512_store_si512(dst + (p / TILE) * TILE * TILE + (p % TILE) * TILE,
                               _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
        }
    }
    /* V: tile row p of a 32-key chunk interleaves keys 2p and 2p + 1, 16 dims per tile */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t t = 0; t < keys32; t += 2) {
        const uint16_t *a = t < keys ? v + ((int64_t)slots[t] * kv_heads + kvh) * D : NULL;
        const uint16_t *b = t + 1 < keys ? v + ((int64_t)slots[t + 1] * kv_heads + kvh) * D : NULL;
        uint16_t *dst = w->vb + (t / PAIRS) * dtiles * TILE * PAIRS + ((t % PAIRS) / 2) * PAIRS;
        for (int64_t d = 0; d < D; d += TILE) {
            const __m256i x = a ? _mm256_loadu_si256((const __m256i *)(a + d)) : _mm256_setzero_si256();
            const __m256i y = b ? _mm256_loadu_si256((const __m256i *)(b + d)) : _mm256_setzero_si256();
            const __m512i xy = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
            _mm512_store_si512(dst + (d / TILE) * TILE * PAIRS, _mm512_permutexvar_epi16(pairs, xy));
        }
    }
}

/* Row r's probabilities of keys 0 .. n - 1 as bf16 into p (zero from n to pend, a multiple of 16);
 * returns 1 / their sum. Masked vectors: the scalar tail of each row's odd length was most of
 * the softmax's time. */
static inline float amx_softmax_row(const float *s, uint16_t *p, int64_t n, int64_t pend, float scale) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < n; t += TILE) {
        const __mmask16 m = n - t >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, m, s + t));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sc = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < pend; t += TILE) {
        const int64_t left = n - t;
        const __mmask16 m = left >= TILE ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const __m512 e = _mm512_maskz_mov_ps(m, exp16_nonpositive(_mm512_mul_ps(
                                                    _mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), top), sc)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Tile numbers are constants in the instructions, so a loop's k-th product picks its written-out
 * case: scores (tile 0) += query chunk k (tile 4 + k) x that chunk of 16 keys (tile 1); or, with
 * `output`, output tile k (16 dims) += probabilities of 32 keys (tile 4) x their values (tile 5). */
static inline void tile_product(int output, int64_t k) {
    switch (output ? 4 + k : k) {
        case 0: _tile_dpbf16ps(0, 4, 1); break;
        case 1: _tile_dpbf16ps(0, 5, 1); break;
        case 2: _tile_dpbf16ps(0, 6, 1); break;
        case 3: _tile_dpbf16ps(0, 7, 1); break;
        case 4: _tile_dpbf16ps(0, 4, 5); break;
        case 5: _tile_dpbf16ps(1, 4, 5); break;
        case 6: _tile_dpbf16ps(2, 4, 5); break;
        default: _tile_dpbf16ps(3, 4, 5);
    }
}

/* Rows i0 .. i0 + nr - 1 of head h (request at q_start, keys gathered into w). */
static void amx_block(const uint16_t *q, uint16_t *out, int64_t q_start, int64_t i0, int64_t nr, int64_t prefix,
                      int64_t h, int64_t num_heads, int64_t D, int64_t keys32, float scale, amx_scratch *w) {
    const int64_t chunks = D / PAIRS, last = prefix + i0 + nr - 1;
    uint16_t qbuf[TILE * 128] __attribute__((aligned(64)));
    for (int64_t r = 0; r < TILE; ++r) {
        if (r < nr)
            memcpy(qbuf + r * D, q + ((q_start + i0 + r) * num_heads + h) * D, sizeof(uint16_t) * (size_t)D);
        else
            memset(qbuf + r * D, 0, sizeof(uint16_t) * (size_t)D);
    }
    const int64_t ldq = D * (int64_t)sizeof(uint16_t);
    _tile_loadd(4, qbuf, ldq);
    if (chunks > 1) _tile_loadd(5, qbuf + PAIRS, ldq);
    if (chunks > 2) _tile_loadd(6, qbuf + 2 * PAIRS, ldq);
    if (chunks > 3) _tile_loadd(7, qbuf + 3 * PAIRS, ldq);
    for (int64_t j = 0; j <= last / TILE; ++j) {
        const uint32_t *kj = w->kb + j * chunks * TILE * TILE;
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; ++c) {
            _tile_loadd(1, kj + c * TILE * TILE, 64);
            tile_product(0, c);
        }
        _tile_stored(0, w->s + j * TILE, keys32 * (int64_t)sizeof(float));
    }
    /* softmax of each row over keys 0 .. its position (a padding row repeats the last one); the
     * probabilities up to the block's last 32-key chunk, zero past the position */
    const int64_t pend = (last / PAIRS + 1) * PAIRS;
    float inv[TILE];
    for (int64_t r = 0; r < TILE; ++r)
        inv[r] = amx_softmax_row(w->s + r * keys32, w->pb + r * keys32, prefix + i0 + (r < nr ? r : nr - 1) + 1,
                                 pend, scale);
    const int64_t ldp = keys32 * (int64_t)sizeof(uint16_t), dtiles = D / TILE;
    float obuf[TILE][4 * TILE] __attribute__((aligned(64)));
    for (int64_t d0 = 0; d0 < dtiles; d0 += 4) { /* four output tiles (64 dims) per pass over the keys */
        const int64_t nt = dtiles - d0 < 4 ? dtiles - d0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < pend / PAIRS; ++g) {
            const uint16_t *vg = w->vb + (g * dtiles + d0) * TILE * PAIRS;
            _tile_loadd(4, w->pb + g * PAIRS, ldp);
            for (int64_t t = 0; t < nt; ++t) {
                _tile_loadd(5, vg + t * TILE * PAIRS, 64);
                tile_product(1, t);
            }
        }
        const int64_t ldo = 4 * TILE * (int64_t)sizeof(float);
        _tile_stored(0, &obuf[0][0], ldo);
        if (nt > 1) _tile_stored(1, &obuf[0][TILE], ldo);
        if (nt > 2) _tile_stored(2, &obuf[0][2 * TILE], ldo);
        if (nt > 3) _tile_stored(3, &obuf[0][3 * TILE], ldo);
        for (int64_t r = 0; r < nr; ++r) {
            uint16_t *dst = out + ((q_start + i0 + r) * num_heads + h) * D + d0 * TILE;
            const __m512 norm = _mm512_set1_ps(inv[r]);
            for (int64_t c = 0; c < nt; ++c)
                _mm256_storeu_si256((__m256i *)(dst + c * TILE),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&obuf[r][c * TILE]), norm)));
        }
    }
}
#endif

/* 1 when paged_extend_attention_bf16 runs here (a build for AMX, and the OS granted the tiles). */
int paged_extend_amx(void) {
#ifdef EXTEND_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* paged_extend_attention for bf16 queries, output and cache on AMX tiles (see above); head_dim a
 * multiple of 32 up to 128. Returns 0; 1 when memory ran out; 2 for head counts or sizes it does
 * not take; 4 when this build or CPU has no AMX (the caller takes the fp32 path). */
int paged_extend_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                const int32_t *table, int64_t table_stride, const int64_t *rows,
                                const int64_t *prefix_lens, const int64_t *q_lens, int64_t bs, int64_t num_heads,
                                int64_t kv_heads, int64_t head_dim, float scale, int64_t num_threads) {
#ifdef EXTEND_AMX
    if (!amx_permitted()) return 4;
    if (bs <= 0) return 0;
    if (kv_heads <= 0 || num_heads % kv_heads != 0 || head_dim % PAIRS != 0 || head_dim > 128) return 2;
    int64_t *q_start = query_starts(q_lens, bs);
    if (!q_start) return 1;
    const int64_t items = bs * kv_heads, group = num_heads / kv_heads;
    int status = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1) reduction(| : status)
    {
        amx_scratch w = {NULL, NULL, NULL, NULL, 0};
        amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / kv_heads, kvh = item % kv_heads, q_len = q_lens[b];
            if (q_len <= 0) continue;
            const int64_t keys = prefix_lens[b] + q_len, keys32 = (keys + PAIRS - 1) / PAIRS * PAIRS;
            if (amx_reserve(&w, keys32, head_dim)) {
                status |= 1;
                continue;
            }
            amx_gather(k, v, table + rows[b] * table_stride, keys, keys32, kv_heads, kvh, head_dim, &w);
            for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
                for (int64_t i0 = 0; i0 < q_len; i0 += TILE)
                    amx_block(q, out, q_start[b], i0, q_len - i0 < TILE ? q_len - i0 : TILE, prefix_lens[b], h,
                              num_heads, head_dim, keys32, scale, &w);
        }
        _tile_release();
        free(w.kb);
        free(w.vb);
        free(w.pb);
        free(w.s);
    }
    free(q_start);
    return status;
#else
    (void)q, (void)k, (void)v, (void)out, (void)table, (void)table_stride, (void)rows, (void)prefix_lens;
    (void)q_lens, (void)bs, (void)num_heads, (void)kv_heads, (void)head_dim, (void)scale, (void)num_threads;
    return 4;
#endif
}
