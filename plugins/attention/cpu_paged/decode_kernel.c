/*
 * Paged decode attention on CPU, reading each request's K/V in place through its page table.
 *
 * Why a kernel: the torch path gathers every request's K/V into a padded buffer before SDPA reads
 * it again, so a decode step moves the whole KV context three times (read, write, read). Decode on
 * CPU is memory-bound, so reading it once is most of the win.
 *
 * Layout (what plugserve's KVCache and request pool hold):
 *   q        [bs, num_heads, head_dim]            float32, contiguous
 *   k, v     [num_slots, kv_heads, head_dim]      float32 or bfloat16, contiguous (one layer)
 *   table    [rows, table_stride]                 int32 slot of each token of each request row
 *   rows     [bs] int64 request row per query;  lens [bs] int64 context length per query
 *   out      [bs, num_heads, head_dim]            float32
 * Query heads h*group .. h*group+group-1 share kv head h (GQA), so each K/V row is read once for
 * the whole group, and a work unit always covers every head: a token's K (and V) row of all kv
 * heads is one contiguous piece of memory, which the loads and the prefetcher stream whole.
 *
 * Units are split over threads by token count. With enough requests (>= 4 per thread) a unit is a
 * whole request. With fewer, each request is cut into spans of tokens (flash-decoding): a span
 * yields its heads' unnormalised outputs with their running max and sum of exponentials, and the
 * calling thread merges a request's spans after the threads are done. (Splitting by kv head instead
 * read a 256-byte piece of every 3 KB token row per unit; at batch 1 it measured ~3x slower than the
 * bytes it reads allow.)
 *
 * A bfloat16 cache (kv_cache.dtype=bfloat16) halves the bytes a decode step reads; each element is
 * widened to float32 on load (a 16-bit shift, exact), and all arithmetic stays float32.
 */
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_float.h"
#include "decode_abi.h"

/* Tokens [t0, t1) of request b. part < 0: the unit is the whole request and writes its normalised
 * output to `out`; else it writes partial results (see partial_t) to slot `part`. */
typedef struct {
    int64_t b, t0, t1, part;
} unit_t;

/* A span's result per query head: sum_t exp(s_t - m) v_t, with m the span's max score and
 * l = sum_t exp(s_t - m); merging spans rescales each by exp(m - M) for the overall max M. */
typedef struct {
    float *o; /* [parts, num_heads, head_dim] */
    float *m; /* [parts, num_heads] */
    float *l; /* [parts, num_heads] */
} partial_t;

typedef struct {
    const float *q;
    const void *k, *v; /* float32 or bfloat16 elements: the run function knows which */
    float *out;
    const int32_t *table;
    const int64_t *rows;
    int64_t table_stride, num_heads, kv_heads, head_dim, max_unit;
    float scale;
    const unit_t *units;
    partial_t partial;
    int64_t unit_begin, unit_end;
    int status;
} job_t;

/* Element i of a K/V row of either type. `bf16` is a compile-time constant wherever this is used
 * (run_units is force-inlined into one wrapper per type), so each loop below is compiled twice,
 * each time straight-line, and gcc vectorises both. */
static inline float kv_at(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline const void *kv_row(const void *base, int64_t element, int bf16) {
    return (const char *)base + element * (bf16 ? 2 : 4);
}

/* Plain loops: compiled with -O3 and reassociation allowed, gcc turns them into FMA vector code.
 * (Two explicit vector accumulators for the dot product measured no faster.) */
static inline float dot(const float *a, const void *b, int64_t n, int bf16) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * kv_at(b, i, bf16);
    return s;
}

static inline void axpy(float *y, float a, const void *x, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * kv_at(x, i, bf16);
}

/* Ask for a token's row ahead of use: rows sit wherever the page table puts them, so the hardware
 * prefetcher cannot guess the next one. PREFETCH_TOKENS rows ahead (the first ones before the loop),
 * not one: a row's scores (or its weighted sum) take ~150 ns of compute here, about one memory
 * latency, so a prefetch one row ahead arrived just in time at best. Zen 4 host, 12 layers of fp32
 * KV, against the one-row-ahead build alternating in one process (medians of 10): 64 requests x 150
 * tokens 0.92-1.0x in seven runs (and 1.15x once), x 300 0.88-0.93x; 16 x 150 0.91x (1.02x once);
 * 4 x 200 0.90-0.96x; 1 x 600 0.81-0.84x (spans); 1 x 150 0.99-1.05x. In the minutes the memory
 * reads at ~29 GB/s every build reads at that rate. 2 to 12 rows ahead all gained, 6 and 8 most;
 * prefetching only a row's first 256 bytes or every other line was no better. */
#ifndef PREFETCH_TOKENS
#define PREFETCH_TOKENS 6
#endif
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 1);
}

/* Token t + PREFETCH_TOKENS's K or V row, or NULL past the unit's end: what the plain loops prefetch,
 * a head's slice at a time. */
static inline const void *row_ahead(const void *base, const int32_t *slots, int64_t t, int64_t len,
                                    int64_t row_elems, int bf16) {
    return t + PREFETCH_TOKENS < len ? kv_row(base, (int64_t)slots[t + PREFETCH_TOKENS] * row_elems, bf16) : NULL;
}

/* The rows of tokens [from, to) (clipped to len) of a unit's K or V, ahead of use. */
static inline void prefetch_tokens(const void *base, const int32_t *slots, int64_t from, int64_t to, int64_t len,
                                   int64_t row_elems, int64_t row_bytes, int bf16) {
    for (int64_t t = from; t < to && t < len; ++t)
        prefetch_row(kv_row(base, (int64_t)slots[t] * row_elems, bf16), row_bytes);
}

#ifdef __AVX512F__
/* The passes with AVX-512 intrinsics, for head_dim a multiple of 16 up to 128 (nv = head_dim / 16
 * vectors), fp32 or bf16 cache (widened on load, exactly, as the plain loops do). Within a block of BLOCK_TOKENS tokens the loops go head by head, so
 * a head's query (pass 1) or its output accumulators (pass 2) stay in registers across the block
 * instead of being loaded, and in pass 2 stored, again for every token as the plain loops below
 * do. Pass 2 does the same FMAs in the same order as those loops (bit for bit the same output);
 * pass 1 sums each dot product in another order (float rounding). Sapphire Rapids host, against
 * the plain loops (which gcc vectorises 256 bits wide there), the kernel alone over 12 layers: K/V
 * in L2 1.48x as fast, from memory 64 requests x 170 tokens 0.88-0.91x the time, 16 x 300 0.84x,
 * 4 x 600 0.68x, 1 x 600 0.84x; inside llama-120m's fused decode step (alternating in one process)
 * the attention took 0.89x at 4 x 600 and 0.94x at 16 x 1000 (steps 0.96x and 0.95x) but the same
 * at 64 x 128-208 (36.0 vs 36.5 ms: there it waits on memory either way). A bf16 cache measured
 * no faster this way (1.02x) until the prefetches below were spread; with them, the kernel alone
 * took 0.86x the plain loops' time at 64 x 170, 0.85x at 16 x 300, 0.79x at 4 x 600, 0.76x at 1 x
 * 600, and in a bf16 model's fused step the attention 0.88x at 64 x 128-208, 0.80x at 16 rows.
 *
 * Prefetching, spread: each head of a block asks for its own slice of the next block's rows (4
 * lines a row at head_dim 64), so the requests go out a few at a time between the loads that use
 * the data. Asking for the next block's whole rows at the block's start (the plain loops' scheme,
 * 384 lines at once here) measured slower: a burst fills the core's miss queues and the block's own
 * loads wait behind it. Same host, from memory, against that burst (alternating in one process):
 * the kernel alone over 12 layers 64 x 170 tokens 0.91-0.92x the time (25.1 -> 27.5-27.8 GB/s of
 * a 29 GB/s plain read), 16 x 1000 0.92x, 4 x 600 0.90x, 1 x 600 0.83-0.90x, 8 x 150 0.87x; in the
 * fused step the attention took 0.865x at 64 x 128-208 (step layers 68.9 vs 73.3 ms), 0.80x at 16
 * x 128-208, 0.93x at 4 x 600, 0.85x at 1 x 600. Two blocks ahead, or blocks of 4 or 16, were no
 * better; prefetching into L1 (locality 3) was 1.04x slower, non-temporal 2.8x slower. */
#define BLOCK_TOKENS 8
#ifndef BLOCKED_BF16
#define BLOCKED_BF16 1 /* 0: a bf16 cache takes the plain loops (for A/B builds) */
#endif

/* Elements 16e .. 16e+15 of a K/V row's head slice `row`, as fp32 (bf16 widened, exactly). */
static inline __attribute__((always_inline)) __m512 load16(const void *row, int e, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)row + 16 * e) : _mm512_loadu_ps((const float *)row + 16 * e);
}

/* Fewer instructions per byte, for a bf16 cache, whose threads each fall short of the memory's
 * rate (~10 GB/s a thread here, where fp32 gets ~12.6) while the kernel does twice fp32's
 * instructions per byte:
 * - BATCHED_SCORES: pass 1 sums a block's 8 dot products in one transpose-and-add tree (sum8)
 *   rather than one horizontal reduction each (4 shuffles and 4 adds apiece);
 * - BF16_PAIRS: a bf16 row is read 32 elements per 512-bit load and split into even and odd
 *   elements by a shift and a mask (load_pairs), where a widening load took 16 at a time through
 *   the shuffle port; the query and the output accumulators are held split the same way.
 * Sapphire Rapids host, the kernel alone over 12 layers on 2 MiB pages, alternating with the
 * previous build in one process: bf16 64 requests x 160 tokens 0.96x the time (BATCHED_SCORES
 * alone 0.97-0.98x), 16 x 300 0.945x, 4 x 600 0.946x, 8 x 150 0.92x, one thread at 64 x 160
 * 0.958x; fp32 (where only BATCHED_SCORES applies) 0.98-1.0x. In a bf16 llama-120m's 64-stream
 * closed loop the decode steps took 45.4-46.3 ms against 46.3-46.8. Pass 2 still does each output
 * element's FMAs in the same order, so its results are unchanged. */
#ifndef BATCHED_SCORES
#define BATCHED_SCORES 1
#endif
/* The 8 lanes' sums of acc[0..7] (each 16 fp32), in token order in lanes 0-7: a transpose-and-add
 * tree, 3 shuffle levels for all 8 where a reduction per vector takes 4 each. */
static inline __attribute__((always_inline)) __m512 sum8(const __m512 acc[8]) {
    __m512 half[4], quarter[2];
    for (int i = 0; i < 4; ++i) /* lanes 0-7: acc[2i] folded to 8, lanes 8-15: acc[2i+1] */
        half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i) /* 128-bit lane l: token 4i + l folded to 4 */
        quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane l: [t_l p0 + p2, t_{l+4} p0 + p2, t_l p1 + p3, t_{l+4} p1 + p3] */
    const __m512 pairs = _mm512_add_ps(_mm512_unpacklo_ps(quarter[0], quarter[1]), _mm512_unpackhi_ps(quarter[0], quarter[1]));
    /* lane l: [t_l, t_{l+4}, ...] */
    const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(1, 0, 3, 2)));
    /* t_l at element 4l, t_{l+4} at 4l + 1: gather them into lanes 0-7 in token order */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), sums);
}

#ifndef BF16_PAIRS
#define BF16_PAIRS 1
#endif
/* A bf16 row read 32 elements (one 512-bit load) at a time: the low 16 bits of each 32-bit lane
 * (even elements) shifted up, the high 16 (odd elements) masked, each exact fp32. The query and
 * the output accumulators are held the same way, even and odd elements in separate vectors
 * (split_pairs, join_pairs), so each element still meets its own partner. */
static inline __attribute__((always_inline)) void load_pairs(const void *row, int e2, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)row + 32 * e2));
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Each pair reg[i], reg[i+1] (i even) replaced by two permutations of its 32 lanes. */
static inline __attribute__((always_inline)) void permute_pairs(__m512 *reg, int nv, __m512i first, __m512i second) {
    for (int i = 0; i < nv; i += 2) {
        const __m512 a = reg[i], b = reg[i + 1];
        reg[i] = _mm512_permutex2var_ps(a, first, b);
        reg[i + 1] = _mm512_permutex2var_ps(a, second, b);
    }
}

/* reg[2i], reg[2i+1] (elements 32i .. 32i+31 in order) -> their even and their odd elements. */
static inline __attribute__((always_inline)) void split_pairs(__m512 *reg, int nv) {
    permute_pairs(reg, nv, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                  _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

/* The inverse of split_pairs. */
static inline __attribute__((always_inline)) void join_pairs(__m512 *reg, int nv) {
    permute_pairs(reg, nv, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                  _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}

/* q . row over a head's nv vectors of elements (pass 1), in lanes: summed across them later. */
static inline __attribute__((always_inline)) __m512 dot_lanes(const __m512 *reg, const void *row, const int nv,
                                                              const int bf16, const int pairs) {
    if (pairs) {
        __m512 even, odd, acc;
        load_pairs(row, 0, &even, &odd);
        acc = _mm512_fmadd_ps(reg[1], odd, _mm512_mul_ps(reg[0], even));
        for (int e = 2; e < nv; e += 2) {
            load_pairs(row, e / 2, &even, &odd);
            acc = _mm512_fmadd_ps(reg[e + 1], odd, _mm512_fmadd_ps(reg[e], even, acc));
        }
        return acc;
    }
    __m512 acc = _mm512_mul_ps(reg[0], load16(row, 0, bf16));
    for (int e = 1; e < nv; ++e) acc = _mm512_fmadd_ps(reg[e], load16(row, e, bf16), acc);
    return acc;
}

/* reg += p row (pass 2): per element the same FMA whichever way the lanes are arranged. */
static inline __attribute__((always_inline)) void axpy_lanes(__m512 *reg, __m512 p, const void *row, const int nv,
                                                             const int bf16, const int pairs) {
    if (pairs) {
        for (int e = 0; e < nv; e += 2) {
            __m512 even, odd;
            load_pairs(row, e / 2, &even, &odd);
            reg[e] = _mm512_fmadd_ps(p, even, reg[e]);
            reg[e + 1] = _mm512_fmadd_ps(p, odd, reg[e + 1]);
        }
        return;
    }
    for (int e = 0; e < nv; ++e) reg[e] = _mm512_fmadd_ps(p, load16(row, e, bf16), reg[e]);
}

/* Tokens [t0, t1) for every query head, head by head. Pass 1 (values == 0): scores[qi * len + t] =
 * scale * q_qi . k_t, q_qi in registers. Pass 2: ob[qi] += sum_t p[qi, t] v_t, summed in registers
 * over the block and stored once. */

static inline __attribute__((always_inline)) void block_heads(const job_t *j, const float *qb, float *ob,
                                                              const int32_t *slots, int64_t t0, int64_t t1,
                                                              int64_t len, float *scores, const int nv, int values,
                                                              const int bf16) {
    const int64_t d = j->head_dim, row_elems = j->kv_heads * d, group = j->num_heads / j->kv_heads;
    const void *cache = values ? j->v : j->k;
    const int64_t line_elems = bf16 ? 32 : 16; /* elements in a 64-byte line */
    const int pairs = BF16_PAIRS && bf16 && nv % 2 == 0;
    for (int64_t h = 0, qi = 0; h < j->kv_heads; ++h)
        for (int64_t g = 0; g < group; ++g, ++qi) {
            if (g == 0) /* this kv head's slice of the next block's rows, ahead of use */
                for (int64_t u = t1; u < t1 + BLOCK_TOKENS && u < len; ++u)
                    for (int64_t e = 0; e < d; e += line_elems)
                        __builtin_prefetch(kv_row(cache, (int64_t)slots[u] * row_elems + h * d + e, bf16), 0, 1);
            __m512 reg[8]; /* the query (pass 1) or the output accumulators (pass 2) */
            for (int e = 0; e < nv; ++e) reg[e] = _mm512_loadu_ps((values ? ob : qb) + qi * d + 16 * e);
            if (pairs) split_pairs(reg, nv);
            if (BATCHED_SCORES && !values && BLOCK_TOKENS == 8) {
                /* every token's products summed per lane, then all 8 sums in one tree (sum8) */
                __m512 acc[8];
                for (int64_t i = 0; i < 8; ++i)
                    acc[i] = t0 + i < t1 ? dot_lanes(reg, kv_row(cache, (int64_t)slots[t0 + i] * row_elems + h * d, bf16),
                                                     nv, bf16, pairs)
                                         : _mm512_setzero_ps();
                const __m512 s = _mm512_mul_ps(sum8(acc), _mm512_set1_ps(j->scale));
                _mm512_mask_storeu_ps(scores + qi * len + t0, (__mmask16)((1u << (t1 - t0)) - 1), s);
                continue;
            }
            for (int64_t t = t0; t < t1; ++t) {
                const void *row = kv_row(cache, (int64_t)slots[t] * row_elems + h * d, bf16);
                if (values)
                    axpy_lanes(reg, _mm512_set1_ps(scores[qi * len + t]), row, nv, bf16, pairs);
                else
                    scores[qi * len + t] = _mm512_reduce_add_ps(dot_lanes(reg, row, nv, bf16, pairs)) * j->scale;
            }
            if (values) { /* the output accumulators back in element order (the query needs no undoing) */
                if (pairs) join_pairs(reg, nv);
                for (int e = 0; e < nv; ++e) _mm512_storeu_ps(ob + qi * d + 16 * e, reg[e]);
            }
        }
}

/* Pass 1 (values == 0) or 2 over a unit's tokens, a block at a time; block_heads prefetches the
 * next block, so only the rest of the first one is asked for here (its first PREFETCH_TOKENS rows
 * were before the pass). */
static inline __attribute__((always_inline)) void blocked_pass(const job_t *j, const float *qb, float *ob,
                                                               const int32_t *slots, int64_t len, float *scores,
                                                               int values, const int bf16) {
    const int64_t row_elems = j->kv_heads * j->head_dim, row_bytes = row_elems * (bf16 ? 2 : 4);
    const int nv = (int)(j->head_dim / 16);
    const void *base = values ? j->v : j->k;
    prefetch_tokens(base, slots, PREFETCH_TOKENS, BLOCK_TOKENS, len, row_elems, row_bytes, bf16); /* the rest of block 0 */
    for (int64_t t = 0; t < len; t += BLOCK_TOKENS) {
        const int64_t end = t + BLOCK_TOKENS < len ? t + BLOCK_TOKENS : len;
        /* nv a constant for the common head dims, so the vector loops unroll */
        if (nv == 4) block_heads(j, qb, ob, slots, t, end, len, scores, 4, values, bf16);
        else if (nv == 8) block_heads(j, qb, ob, slots, t, end, len, scores, 8, values, bf16);
        else block_heads(j, qb, ob, slots, t, end, len, scores, nv, values, bf16);
    }
}
#endif

static inline __attribute__((always_inline)) void *run_units(job_t *j, int bf16) {
    const int64_t d = j->head_dim, nq = j->num_heads, group = nq / j->kv_heads;
    const int64_t row_elems = j->kv_heads * d, row_bytes = row_elems * (bf16 ? 2 : 4), head_bytes = d * (bf16 ? 2 : 4);
    float *scores = (float *)malloc(sizeof(float) * (size_t)(nq * (j->max_unit > 0 ? j->max_unit : 1)));
    if (!scores) {
        j->status = 1;
        return NULL;
    }
    for (int64_t u = j->unit_begin; u < j->unit_end; ++u) {
        const unit_t *unit = &j->units[u];
        const int64_t b = unit->b, t0 = unit->t0, len = unit->t1 - unit->t0;
        const int32_t *slots = j->table + j->rows[b] * j->table_stride + t0;
        const float *qb = j->q + b * nq * d;
        float *ob = unit->part < 0 ? j->out + b * nq * d : j->partial.o + unit->part * nq * d;
        memset(ob, 0, sizeof(float) * (size_t)(nq * d));
        if (len <= 0) continue;
        /* pass 1: scores of every head against each token's whole K row. In the plain loops each
         * head asks for its own slice of the row PREFETCH_TOKENS ahead, spread as the blocked
         * passes spread theirs (see there): asking for the whole row at once, per token, took
         * 1.12-1.25x the time. AVX2-only Zen 3 host, the kernel alone over 12 layers on 2 MiB
         * pages, alternating in one process: 64 requests x 130-190 tokens 22.3-22.6 -> 25.0-25.5
         * GB/s in three runs (18.9 -> 23.6 and 21.4 -> 26.7 in two more), 4 x 600 20.8 -> 23.2 GB/s;
         * 4, 10 or 16 rows ahead measured the same as 6; an AVX2 port of the blocked passes
         * (registers held per head over 8-token blocks) measured no faster than this (31.5 vs
         * 31.5 ms at 64 x 160, 7.21 vs 7.26 at 4 x 600). */
        prefetch_tokens(j->k, slots, 1, PREFETCH_TOKENS, len, row_elems, row_bytes, bf16);
#ifdef __AVX512F__
        const int blocked = BLOCKED_BF16 >= bf16 && d % 16 == 0 && d <= 128;
        if (blocked) blocked_pass(j, qb, ob, slots, len, scores, 0, bf16);
        for (int64_t t = 0; t < (blocked ? 0 : len); ++t) {
#else
        for (int64_t t = 0; t < len; ++t) {
#endif
            const void *kr = kv_row(j->k, (int64_t)slots[t] * row_elems, bf16);
            const void *ahead = row_ahead(j->k, slots, t, len, row_elems, bf16);
            for (int64_t qi = 0; qi < nq; ++qi) {
                if (ahead && qi % group == 0) prefetch_row(kv_row(ahead, (qi / group) * d, bf16), head_bytes);
                scores[qi * len + t] = dot(qb + qi * d, kv_row(kr, (qi / group) * d, bf16), d, bf16) * j->scale;
            }
        }
        /* softmax per query head, max-subtracted like SDPA; a whole request normalises here, a span
         * keeps its max and sum for the merge */
        for (int64_t qi = 0; qi < nq; ++qi) {
            float *s = scores + qi * len, m = s[0], sum = 0.0f;
            for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < len; ++t) {
                s[t] = exp_nonpositive(s[t] - m);
                sum += s[t];
            }
            if (unit->part < 0) {
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; ++t) s[t] *= inv;
            } else {
                j->partial.m[unit->part * nq + qi] = m;
                j->partial.l[unit->part * nq + qi] = sum;
            }
        }
        /* pass 2: weighted sum of the values, each V row read whole */
        prefetch_tokens(j->v, slots, 1, PREFETCH_TOKENS, len, row_elems, row_bytes, bf16);
#ifdef __AVX512F__
        if (blocked) blocked_pass(j, qb, ob, slots, len, scores, 1, bf16);
        for (int64_t t = 0; t < (blocked ? 0 : len); ++t) {
#else
        for (int64_t t = 0; t < len; ++t) {
#endif
            const void *vr = kv_row(j->v, (int64_t)slots[t] * row_elems, bf16);
            const void *ahead = row_ahead(j->v, slots, t, len, row_elems, bf16);
            for (int64_t qi = 0; qi < nq; ++qi) {
                if (ahead && qi % group == 0) prefetch_row(kv_row(ahead, (qi / group) * d, bf16), head_bytes);
                axpy(ob + qi * d, scores[qi * len + t], kv_row(vr, (qi / group) * d, bf16), d, bf16);
            }
        }
    }
    free(scores);
    return NULL;
}

static void *run_units_f32(void *arg) { return run_units((job_t *)arg, 0); }
static void *run_units_bf16(void *arg) { return run_units((job_t *)arg, 1); }

/* out[b] = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i over request b's spans i. */
static void merge_spans(const job_t *j, const unit_t *units, int64_t n_units) {
    const int64_t nq = j->num_heads, d = j->head_dim;
    for (int64_t first = 0; first < n_units;) {
        int64_t last = first;
        while (last + 1 < n_units && units[last + 1].b == units[first].b) ++last;
        if (units[first].part >= 0) {
            float *ob = j->out + units[first].b * nq * d;
            for (int64_t qi = 0; qi < nq; ++qi) {
                float big = j->partial.m[units[first].part * nq + qi], denom = 0.0f;
                for (int64_t u = first + 1; u <= last; ++u) {
                    const float m = j->partial.m[units[u].part * nq + qi];
                    big = m > big ? m : big;
                }
                float *o = ob + qi * d;
                memset(o, 0, sizeof(float) * (size_t)d);
                for (int64_t u = first; u <= last; ++u) {
                    const int64_t p = units[u].part;
                    const float w = exp_nonpositive(j->partial.m[p * nq + qi] - big);
                    denom += w * j->partial.l[p * nq + qi];
                    const float *po = j->partial.o + (p * nq + qi) * d;
                    for (int64_t e = 0; e < d; ++e) o[e] += w * po[e];
                }
                const float inv = 1.0f / denom;
                for (int64_t e = 0; e < d; ++e) o[e] *= inv;
            }
        }
        first = last + 1;
    }
}

#define MAX_THREADS 64
#define SPANS_PER_THREAD 4 /* spans per thread at small batches: a few, so the split balances */
#define MIN_SPAN 32        /* tokens: below this a span's merge costs more than its share saves */

/* Cut the batch into units (see unit_t); returns their count, or -1 when memory could not be had.
 * *parts is set to the number of spans that write partial results. */
static int64_t make_units(const int64_t *lens, int64_t bs, int64_t num_threads, unit_t **units, int64_t *parts,
                          int64_t *max_unit) {
    int64_t total = 0;
    for (int64_t b = 0; b < bs; ++b) total += lens[b] > 0 ? lens[b] : 0;
    int64_t span = total + 1;  /* whole requests */
    if (num_threads > 1 && bs < 4 * num_threads) {
        span = (total + num_threads * SPANS_PER_THREAD - 1) / (num_threads * SPANS_PER_THREAD);
        span = span < MIN_SPAN ? MIN_SPAN : span;
    }
    int64_t n = 0;
    for (int64_t b = 0; b < bs; ++b) n += lens[b] > span ? (lens[b] + span - 1) / span : 1;
    *units = (unit_t *)malloc(sizeof(unit_t) * (size_t)n);
    if (!*units) return -1;
    int64_t u = 0, p = 0;
    *max_unit = 0;
    for (int64_t b = 0; b < bs; ++b) {
        const int64_t len = lens[b] > 0 ? lens[b] : 0;
        if (len <= span) {
            (*units)[u++] = (unit_t){b, 0, len, -1};
        } else {
            for (int64_t t0 = 0; t0 < len; t0 += span)
                (*units)[u++] = (unit_t){b, t0, t0 + span < len ? t0 + span : len, p++};
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = (*units)[i].t1 - (*units)[i].t0;
        *max_unit = len > *max_unit ? len : *max_unit;
    }
    *parts = p;
    return n;
}

/* Each query's new K and V row (kv_heads * head_dim elements, contiguous; bfloat16 when new_bf16,
 * else float32) into slot loc[b] of the cache, converted to the cache's type as torch's index_put
 * does (fp32 rounded to bf16 to nearest even, bf16 widened exactly, same types copied): the store a
 * decode step makes before reading, in this call rather than two torch index_puts per layer. */
static void store_new_rows(void *k, void *v, const void *k_new, const void *v_new, const int64_t *loc,
                           int64_t bs, int64_t row_elems, int bf16, int new_bf16) {
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t b = 0; b < bs; ++b) {
        const int64_t src = b * row_elems, dst = loc[b] * row_elems;
        if (bf16 == new_bf16) {
            memcpy((char *)k + dst * elem, (const char *)k_new + src * elem, elem * (size_t)row_elems);
            memcpy((char *)v + dst * elem, (const char *)v_new + src * elem, elem * (size_t)row_elems);
        } else if (bf16) {
            const float *kn = (const float *)k_new + src, *vn = (const float *)v_new + src;
            uint16_t *kd = (uint16_t *)k + dst, *vd = (uint16_t *)v + dst;
            for (int64_t e = 0; e < row_elems; ++e) {
                kd[e] = float_to_bf16(kn[e]);
                vd[e] = float_to_bf16(vn[e]);
            }
        } else {
            const uint16_t *kn = (const uint16_t *)k_new + src, *vn = (const uint16_t *)v_new + src;
            float *kd = (float *)k + dst, *vd = (float *)v + dst;
            for (int64_t e = 0; e < row_elems; ++e) {
                kd[e] = bf16_to_float(kn[e]);
                vd[e] = bf16_to_float(vn[e]);
            }
        }
    }
}

/* Rows a thread stores at a time in paged_store_kv (a fork per call, not per row). */
#define STORE_CHUNK_ROWS 64

/* n new K/V rows into slots loc, as store_new_rows: the extend path's store (a prefill chunk's or a
 * mixed step's thousands of rows), threaded over rows where OpenMP is there. Why: torch's two
 * index_puts per layer took 0.34 ms each for a 1713-row bf16 step of llama-120m on the Sapphire
 * Rapids host (1.5 KB rows, ~8 GB/s), 8 ms of a ~210 ms mixed step.
 * Returns 0, or 3 for a slot in loc outside [0, num_slots) (then nothing is written). */
int paged_store_kv(void *k, void *v, const void *k_new, const void *v_new, const int64_t *loc, int64_t n,
                   int64_t row_elems, int64_t kv_bf16, int64_t new_bf16, int64_t num_slots, int64_t num_threads) {
    for (int64_t b = 0; b < n; ++b)
        if (loc[b] < 0 || loc[b] >= num_slots) return 3;
    const size_t new_elem = new_bf16 ? 2 : 4;
    const int64_t chunks = (n + STORE_CHUNK_ROWS - 1) / STORE_CHUNK_ROWS;
    (void)num_threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(static) if (chunks > 1 && num_threads > 1)
#endif
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * STORE_CHUNK_ROWS, rows = n - first < STORE_CHUNK_ROWS ? n - first : STORE_CHUNK_ROWS;
        const size_t offset = (size_t)(first * row_elems) * new_elem;
        store_new_rows(k, v, (const char *)k_new + offset, (const char *)v_new + offset, loc + first, rows, row_elems,
                       kv_bf16 != 0, new_bf16 != 0);
    }
    return 0;
}

/* k and v hold bfloat16 elements when kv_bf16 is non-zero, float32 otherwise. With k_new, v_new and
 * loc non-NULL, the new tokens' K/V (bfloat16 when new_bf16 is non-zero, else float32) are stored
 * first (see store_new_rows).
 * Returns 0 on success, 3 for a slot in loc outside [0, num_slots) (nothing written), other
 * non-zero values when memory or a thread could not be had. */
static int decode_fp32_query(const float *q, void *k, void *v, float *out, const int32_t *table,
                             int64_t table_stride, const int64_t *rows, const int64_t *lens, int64_t bs,
                             int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t num_threads,
                             int64_t kv_bf16, const void *k_new, const void *v_new, const int64_t *loc,
                             int64_t num_slots, int64_t new_bf16) {
    void *(*run)(void *) = kv_bf16 ? run_units_bf16 : run_units_f32;
    if (bs <= 0) return 0;
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return 2;
    if (k_new && v_new && loc) {
        /* A decode step's rows are one chunk: stored by this thread, as before the extend path shared it. */
        const int stored = paged_store_kv(k, v, k_new, v_new, loc, bs, kv_heads * head_dim, kv_bf16, new_bf16,
                                          num_slots, 1);
        if (stored != 0) return stored;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    unit_t *units = NULL;
    int64_t parts = 0, max_unit = 0;
    const int64_t n_units = make_units(lens, bs, num_threads, &units, &parts, &max_unit);
    if (n_units < 0) return 1;
    partial_t partial = {NULL, NULL, NULL};
    if (parts > 0) {
        partial.o = (float *)malloc(sizeof(float) * (size_t)(parts * num_heads * (head_dim + 2)));
        if (!partial.o) {
            free(units);
            return 1;
        }
        partial.m = partial.o + parts * num_heads * head_dim;
        partial.l = partial.m + parts * num_heads;
    }
    if (num_threads > n_units) num_threads = n_units;
    int64_t total = 0;
    for (int64_t u = 0; u < n_units; ++u) total += units[u].t1 - units[u].t0 + 1;
    job_t jobs[MAX_THREADS];
    /* Balance by tokens: thread i takes units until its share of the total context is reached. */
    int64_t unit = 0, acc = 0;
    for (int64_t i = 0; i < num_threads; ++i) {
        const int64_t goal = total * (i + 1) / num_threads;
        job_t *j = &jobs[i];
        *j = (job_t){q, k, v, out, table, rows, table_stride, num_heads, kv_heads, head_dim, max_unit, scale,
                     units, partial, unit, unit, 0};
        while (unit < n_units && (acc < goal || i == num_threads - 1)) {
            acc += units[unit].t1 - units[unit].t0 + 1;
            ++unit;
        }
        j->unit_end = unit;
    }
    int status = 0;
    if (num_threads == 1) {
        run(&jobs[0]);
    } else {
#ifdef _OPENMP
        /* torch's OpenMP workers spin for a while after each parallel region; a thread of our own
         * then fights one of them for a core (measured: 2 pthreads at batch 64 were no faster than
         * one, 5.3 ms per layer, and 7x slower at batch 1). Inside torch's process this region runs
         * on the same libgomp (matched by soname), i.e. on those already-spinning workers. */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int64_t i = 0; i < num_threads; ++i)
            if (jobs[i].unit_begin < jobs[i].unit_end) run(&jobs[i]);
#else
        pthread_t threads[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int64_t i = 1; i < num_threads; ++i) {
            if (jobs[i].unit_begin == jobs[i].unit_end) continue;
            if (pthread_create(&threads[i], NULL, run, &jobs[i]) == 0) {
                started[i] = 1;
            } else {
                run(&jobs[i]); /* no thread to be had: do its share here */
            }
        }
        run(&jobs[0]);
        for (int64_t i = 1; i < num_threads; ++i)
            if (started[i]) pthread_join(threads[i], NULL);
#endif
    }
    for (int64_t i = 0; i < num_threads; ++i) status |= jobs[i].status;
    if (status == 0 && parts > 0) merge_spans(&jobs[0], units, n_units);
    free(partial.o);
    free(units);
    return status;
}

/* q and out are [bs, num_heads, head_dim]: float32, or bfloat16 bits when q_bf16 is non-zero (a bf16
 * model's query, widened here exactly and the output rounded to nearest even, what torch's .to()
 * does both ways, without the two tensor conversions a layer). The rest as decode_fp32_query. */
int paged_decode_attention(const void *q, void *k, void *v, void *out, const int32_t *table,
                           int64_t table_stride, const int64_t *rows, const int64_t *lens, int64_t bs,
                           int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t num_threads,
                           int64_t kv_bf16, const void *k_new, const void *v_new, const int64_t *loc,
                           int64_t num_slots, int64_t new_bf16, int64_t q_bf16) {
    if (!q_bf16)
        return decode_fp32_query(q, k, v, out, table, table_stride, rows, lens, bs, num_heads, kv_heads, head_dim,
                                 scale, num_threads, kv_bf16, k_new, v_new, loc, num_slots, new_bf16);
    const int64_t n = bs > 0 ? bs * num_heads * head_dim : 0;
    float *qf = (float *)malloc(sizeof(float) * (size_t)(2 * n + 1));
    if (!qf) return 1;
    float *of = qf + n;
    for (int64_t i = 0; i < n; ++i) qf[i] = bf16_to_float(((const uint16_t *)q)[i]);
    const int status = decode_fp32_query(qf, k, v, of, table, table_stride, rows, lens, bs, num_heads, kv_heads,
                                         head_dim, scale, num_threads, kv_bf16, k_new, v_new, loc, num_slots, new_bf16);
    if (status == 0)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)out)[i] = float_to_bf16(of[i]);
    free(qf);
    return status;
}

/* The batch's side of paged_decode_attention for the fused decode step (decode_abi.h): everything
 * but the layer's q, k, v and output, prepared once per step by backend.py's native_decode. */
typedef struct {
    void *const *k_caches; /* per layer given to native_decode, [slots, kv_heads, head_dim] */
    void *const *v_caches;
    const int32_t *table;
    int64_t table_stride;
    const int64_t *rows, *lens, *loc;
    int64_t bs, num_heads, kv_heads, head_dim;
    float scale;
    int64_t num_threads, kv_bf16, num_slots, bf16; /* bf16: q, k, v and out are bf16 (else fp32) */
} paged_decode_step;

/* A plugserve_decode_attention_fn: store layer `layer`'s new K/V at loc and attend, exactly the
 * call forward_decode makes for that layer. */
int paged_decode_layer(const void *ctx, int64_t layer, const void *q, const void *k, const void *v, void *out) {
    const paged_decode_step *s = (const paged_decode_step *)ctx;
    return paged_decode_attention(q, s->k_caches[layer], s->v_caches[layer], out, s->table, s->table_stride, s->rows,
                                  s->lens, s->bs, s->num_heads, s->kv_heads, s->head_dim, s->scale, s->num_threads,
                                  s->kv_bf16, k, v, s->loc, s->num_slots, s->bf16, s->bf16);
}

/* 1 when built with OpenMP (threads come from the process's OpenMP runtime), 0 for pthreads. */
int paged_decode_uses_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
