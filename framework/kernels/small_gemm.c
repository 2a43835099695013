/* Small-batch linear layers on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ add[m, n]),
 * for fp32 models and for bf16 ones, at a decode step's 1 to a few dozen rows.
 *
 * Why a kernel of our own: at a few rows a linear layer reads every weight once and does little
 * arithmetic with it, so it is bound by how fast the cores stream the weights, and up to ~24 rows
 * (fp32) its arithmetic still fits under that stream. oneDNN's GEMV streamed 3-6 GB/s per core on
 * this project's 2-core hosts where a plain read streams 9-20, and its blocked GEMM at 8-16 rows
 * neither streams at the memory's rate nor computes at the FMA units' (docs/benchmarks.md). Here
 * each thread walks its own panels of the weights front to back (what the prefetchers follow
 * best), so each weight byte comes from DRAM once per call whatever the row count.
 *
 * Layout (column panels): the weight is copied into panels of PANEL_COLS output columns (rows of
 * the nn.Linear weight). Within a panel, for each k, the PANEL_COLS weights w[n0..n0+32, k] are
 * contiguous (fp32: 128 bytes, two cache lines); bf16 keeps k in pairs, each output's (k, k+1)
 * next to each other (the operand layout of AVX512-BF16's pair dot product), 128 bytes per pair
 * of k. A panel is one sequential stream of K x 128 bytes. Rows are zero-padded to whole panels and
 * K to a multiple of K_ALIGN, so no tile has a tail.
 *
 * Tiles: a panel times up to MR_MAX input rows, as a GEMM micro-kernel: each k loads the panel's
 * 32 weights into vectors once and, for each input row, broadcasts x[m, k] and does one FMA per
 * vector into that row's accumulators (MR_MAX x 2 AVX-512 registers). So the weights are read from
 * memory once per tile and the FMAs need no horizontal sums. Against the previous layout (8-row
 * panels of one cache line per row piece, dot products summed across lanes at the end), on the
 * Zen 4 host, llama-120m's 49 decode GEMVs, same process, alternating: fp32 1 row 11.3 vs 11.6
 * ms, 8 rows 13.1 vs 19.5 (oneDNN 17.4), 16 rows 20.6 vs 28.8 (oneDNN 23.1); bf16 8 rows 7.6 vs
 * 10.9 (oneDNN 10.5), 16 rows 11.5 vs 16.6 (oneDNN 13.1). More rows than MR_MAX are split into
 * equal blocks that re-read the panel from L2.
 *
 * Accumulation: fp32 lanes, one FMA per k per output (bf16: one pair dot product per two k), so
 * results differ from torch's GEMMs by fp32 rounding (~1e-6 relative). bf16 (small_gemm_bf16):
 * weights, input, bias, add and output are bf16; every product and sum is fp32, as oneDNN's bf16
 * GEMM accumulates (each weight widened by a shift where the CPU has no AVX512-BF16: exact); only
 * the output is rounded.
 *
 * Threads: OpenMP (torch's own runtime inside torch's process), panels in chunks that the threads
 * take in turn.
 *
 * AMX: where the CPU has AMX tiles (Sapphire Rapids and later) bf16 calls of 2+ rows multiply on
 * them instead of the vector tiles (tile_amx), in the same panel layout.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_float.h"

#define PANEL_COLS 32   /* output columns per panel: two AVX-512 vectors of fp32 accumulators */
#define K_ALIGN 8       /* K is padded to a multiple of this (bf16 needs pairs) */
#ifndef AMX_PAIRS
#define AMX_PAIRS 1 /* 0: SwiGLU on AMX through the scratch as elsewhere (the tests compare the two) */
#endif
#ifndef SWIGLU_AHEAD
#define SWIGLU_AHEAD 2
#endif
#ifndef SCRATCH_PAD
#define SCRATCH_PAD 32 /* elements past each SwiGLU scratch row (see small_gemm_any) */
#endif
#define CHUNK_PANELS 2  /* panels per unit of work a thread takes (64 output columns) */
#ifndef AMX_MAX_ROWS
#define AMX_MAX_ROWS 128 /* bf16 rows a call alone brings on AMX (small_gemm_max_rows) */
#endif
#define MAX_ROWS_ANY 128 /* the most rows a call may bring on any build (small_gemm.py routes more to oneDNN) */
#define FUSED_MAX_ROWS 64 /* the most rows of a fused decode step (small_gemm_fused_max_rows) */
/* Software prefetch PREFETCH_BYTES ahead of the weight stream, into L2 (the T1 hint), by the first
 * row block over each panel (later blocks find the panel in cache). With the hardware prefetchers
 * alone the stream fell short of the memory's rate: on the Zen 4 host the one-row GEMV chain went
 * from 23.5-25.2 to 26.8-30.8 GB/s in fp32; 4 KB ahead beat 2, 8 and 16 KB, and T0 gained little.
 * Near a weight's end this asks for lines past it: a prefetch never faults. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define INLINE static inline __attribute__((always_inline))
/* Keep a vector in a register: an empty asm that "modifies" it. GCC otherwise folded each panel
 * load into the FMAs as a memory operand, once per row, so a k step loaded the same 128 bytes mr
 * times: on the Zen 4 host a 4-row fp32 tile from L3 ran at 145 GFLOP/s (6 rows: 208), and bf16
 * tiles at every row count well under their rate. gate/up (768 -> 2 x 2048) from L3, before ->
 * after: fp32 4 rows 174 -> 125 us; bf16 1 row 96 -> 54, 3 rows 83 -> 57, 8 rows 154 -> 130. From
 * memory (the 49 decode GEMMs, weights streamed) within +-2% at the rates the memory gave then, bf16
 * 8 rows 0.96x; fp32 tiles of 1-3 rows keep the folded loads (in registers they were 1.02-1.09x
 * slower from memory at 2-3 rows). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

/* The rows of a tile: M rows in ceil(M / MR_MAX) blocks of equal size (the last one smaller). */
static inline int64_t block_rows(int64_t M, int mr_max) {
    const int64_t blocks = (M + mr_max - 1) / mr_max;
    return (M + blocks - 1) / blocks;
}

typedef struct {
    const float *x;                /* M rows of Kp fp32, zero past K (a scratch copy of the input); with
                                    * x_blocked (fp32), row block by row block, each k-major */
    const uint16_t *xb;            /* the same as bf16 (bf16 only); with x_blocked, by blocks of k pairs */
    const void *w;                 /* the weight in column panels: float or uint16_t bf16 bits */
    const void *bias;              /* N, the weight's type, or NULL */
    const void *add; int64_t ld_add;  /* M rows of N, the weight's type, or NULL */
    void *y; int64_t ldy;          /* M rows of N, the weight's type */
    int64_t M, N, Kp;              /* N: the real output columns; Kp: K rounded up to K_ALIGN */
    int bf16, x_blocked, amx;      /* amx: bf16 on AMX tiles (xb row-major, zero rows up to whole passes) */
    void *act; int64_t ld_act;     /* SwiGLU output (M rows of N / 2, the weight's type), or NULL: then y
                                    * is a scratch [gate; up] and act gets silu(gate) * up */
    const void *src; int64_t ldsrc, K, padded_rows;  /* the caller's input, x and xb made from it */
    int out_f32;                   /* bf16 only: y is float, each output its bf16 rounding widened back */
} gemm_args;

/* One output's epilogue: bias and the fused residual add, then the store. bf16 rounds the linear's
 * output before the add and the sum again after, as `residual + linear(x)` does in bf16. */
static inline void store(const gemm_args *a, int64_t m, int64_t n, float acc) {
    if (!a->bf16) {
        if (a->bias) acc += ((const float *)a->bias)[n];
        if (a->add) acc += ((const float *)a->add)[m * a->ld_add + n];
        ((float *)a->y)[m * a->ldy + n] = acc;
        return;
    }
    if (a->bias) acc += bf16_to_float(((const uint16_t *)a->bias)[n]);
    uint16_t out = float_to_bf16(acc);
    if (a->add) out = float_to_bf16(bf16_to_float(out) + bf16_to_float(((const uint16_t *)a->add)[m * a->ld_add + n]));
    if (a->out_f32)
        ((float *)a->y)[m * a->ldy + n] = bf16_to_float(out);
    else
        ((uint16_t *)a->y)[m * a->ldy + n] = out;
}

/* The epilogue of one row of a tile, its PANEL_COLS sums in buf, output by output (the last
 * panel's padding columns are dropped). */
static inline void store_row(const gemm_args *a, int64_t panel, int64_t m, const float *buf) {
    const int64_t n0 = panel * PANEL_COLS, cols = a->N - n0 < PANEL_COLS ? a->N - n0 : PANEL_COLS;
    for (int64_t c = 0; c < cols; c++) store(a, m, n0 + c, buf[c]);
}

#ifndef SMALL_GEMM_NO_VECTOR
#if defined(__AVX512F__) || defined(__AVX2__)
#define SMALL_GEMM_VECTOR 1
#endif
#endif

#if defined(SMALL_GEMM_VECTOR) && defined(__AVX512F__)
#define VEC __m512
#define IVEC __m512i
#define VLEN 16
#ifndef MR_MAX
#define MR_MAX 12 /* 12 rows x 2 vectors = 24 accumulators + 2 weight vectors + a broadcast, of 32
                   * registers (8, 12 and 14 measured alike at 16-24 rows; 6 was 15% slower; tile() takes <= 12) */
#endif
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(f) _mm512_set1_ps(f)
#define VADD(u, v) _mm512_add_ps(u, v)
#define VFMA(w, x, acc) _mm512_fmadd_ps(w, x, acc)
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
/* A bf16 pair's low half (even k) and high half (odd k) as fp32: a shift and a mask, exact. */
#define PAIR_EVEN(i) _mm512_castsi512_ps(_mm512_slli_epi32(i, 16))
#define PAIR_ODD(i) _mm512_castsi512_ps(_mm512_and_si512(i, _mm512_set1_epi32((int)0xffff0000u)))
#elif defined(SMALL_GEMM_VECTOR)
#define VEC __m256
#define IVEC __m256i
#define VLEN 8
#ifndef MR_MAX
#define MR_MAX 2 /* 2 rows x 4 vectors = 8 accumulators + 4 weight vectors + broadcasts, of 16 registers */
#endif
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(f) _mm256_set1_ps(f)
#define VADD(u, v) _mm256_add_ps(u, v)
#define VFMA(w, x, acc) _mm256_fmadd_ps(w, x, acc)
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define PAIR_EVEN(i) _mm256_castsi256_ps(_mm256_slli_epi32(i, 16))
#define PAIR_ODD(i) _mm256_castsi256_ps(_mm256_and_si256(i, _mm256_set1_epi32((int)0xffff0000u)))
#else
#ifndef MR_MAX
#define MR_MAX 4
#endif
#endif

/* A vector tile broadcasts x[m, k] (bf16: the pair x[m, k..k+1]) for each of its rows at each k:
 * from a row-major copy that is one cache line per row at a time (12 lines in flight at 12 rows),
 * from a block stored k-major one or two. So a call of two or more row blocks gets its input copied
 * block by block, each k-major (x_blocked; bf16 where the tile reads pairs, AVX512-BF16). llama-120m's
 * 49 decode GEMMs, alternating with the row-major build: fp32 24 rows (2 blocks of 12) 0.91x, 48
 * rows 0.94-0.95x, 64 rows 0.97-0.99x, 16 and 32 rows 0.99-1.0x; bf16 16 rows 0.95x, 24 0.93x, 32
 * 0.95x, 48 0.93x. At one block (up to 12 rows) it measured 1.03-1.06x slower at 4 and 8 rows
 * (fp32), so those keep rows, and so do the scalar tiles and AVX2's full-panel ones; AVX2's half
 * tiles always take blocks (HALF_XB_MIN_ROWS). */
#if defined(SMALL_GEMM_VECTOR) && MR_MAX > 6
#define X_BLOCKED 1
#else
#define X_BLOCKED 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define XB_BLOCKED 1
#else
#define XB_BLOCKED 0
#endif
/* Whether bf16 calls read only the bf16 copy xb (AVX512-BF16's pair tiles and the AMX tiles): then
 * copy_input makes no fp32 copy. It used to make both, and on AMX a 64-row bf16 decode step wrote
 * ~13 MB of fp32 copies nobody read (12 layers x 64 rows x 4352 inputs x 4 bytes). */
#if defined(SMALL_GEMM_VECTOR) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_READS_XB_ONLY 1
#else
#define BF16_READS_XB_ONLY 0
#endif

#if MR_MAX > 12
#error "MR_MAX above 12: tile() has no case for such row blocks"
#endif

#ifdef SMALL_GEMM_VECTOR
#define PANEL_VECS (PANEL_COLS / VLEN)
#define PREFETCH_PANEL(row) \
    do { \
        _mm_prefetch((const char *)(row) + PREFETCH_BYTES, _MM_HINT_T1); \
        _mm_prefetch((const char *)(row) + PREFETCH_BYTES + 64, _MM_HINT_T1); \
    } while (0)

/* Row m's fp32 sums of nvec vectors from output column n0 (a panel, or half of one): in vectors,
 * bias and add too, where every column is a real one; else output by output, the last panel's
 * padding columns dropped. */
INLINE void store_vectors_f32(const gemm_args *a, int64_t m, int64_t n0, const VEC *acc, const int nvec) {
    if (n0 + nvec * VLEN > a->N) {
        float buf[PANEL_COLS];
        for (int v = 0; v < nvec; v++) VSTORE(buf + v * VLEN, acc[v]);
        for (int64_t c = 0; c < a->N - n0; c++) store(a, m, n0 + c, buf[c]);
        return;
    }
    float *y = (float *)a->y + m * a->ldy + n0;
    for (int v = 0; v < nvec; v++) {
        VEC r = acc[v];
        if (a->bias) r = VADD(r, VLOAD((const float *)a->bias + n0 + v * VLEN));
        if (a->add) r = VADD(r, VLOAD((const float *)a->add + m * a->ld_add + n0 + v * VLEN));
        VSTORE(y + v * VLEN, r);
    }
}

/* The epilogue of an fp32 tile. acc is the tile's [MR_MAX][PANEL_VECS] accumulators. */
INLINE void finish_f32(const gemm_args *a, int64_t panel, int64_t m0, const int mr, VEC acc[MR_MAX][PANEL_VECS]) {
    for (int m = 0; m < mr; m++) store_vectors_f32(a, m0 + m, panel * PANEL_COLS, acc[m], PANEL_VECS);
}

/* The epilogue of one row of a bf16 tile, its sums in acc (the roundings of store, in vectors with
 * AVX-512 for whole panels). */
INLINE void finish_bf16_row(const gemm_args *a, int64_t panel, int64_t m, const VEC acc[PANEL_VECS]) {
    const int64_t n0 = panel * PANEL_COLS;
#ifdef __AVX512F__
    if (n0 + PANEL_COLS <= a->N) {
        uint16_t *y = (uint16_t *)a->y + m * a->ldy + n0;
        float *y_f32 = (float *)a->y + m * a->ldy + n0;
        for (int v = 0; v < PANEL_VECS; v++) {
            VEC r = acc[v];
            if (a->bias) r = VADD(r, load_bf16((const uint16_t *)a->bias + n0 + v * VLEN));
            __m256i out = bf16_bits16(r);
            if (a->add)
                out = bf16_bits16(VADD(widen_bf16(out), load_bf16((const uint16_t *)a->add + m * a->ld_add + n0 + v * VLEN)));
            if (a->out_f32)
                _mm512_storeu_ps(y_f32 + v * VLEN, widen_bf16(out));
            else
                _mm256_storeu_si256((__m256i *)(y + v * VLEN), out);
        }
        return;
    }
#endif
    float buf[PANEL_COLS];
    for (int v = 0; v < PANEL_VECS; v++) VSTORE(buf + v * VLEN, acc[v]);
    store_row(a, panel, m, buf);
}

#ifdef __AVX512F__
/* bf16 SwiGLU of 16 lanes whose gate and up are bf16 values (widened): SiLU rounded to bf16, then the
 * product rounded, as two bf16 torch ops round. pair_amx and swiglu_rows both end here. */
INLINE __m256i swiglu_bf16_16(__m512 gate, __m512 up) {
    return bf16_bits16(_mm512_mul_ps(round_bf16_16(silu16(gate)), up));
}
#endif

/* The epilogue of a bf16 tile. */
INLINE void finish_bf16(const gemm_args *a, int64_t panel, int64_t m0, const int mr, VEC acc[MR_MAX][PANEL_VECS]) {
    for (int m = 0; m < mr; m++) finish_bf16_row(a, panel, m0 + m, acc[m]);
}

/* Input rows m0..m0+mr against one fp32 panel. mr is a constant where this is inlined (see tile),
 * so the accumulators stay in registers. */
INLINE void tile_f32(const gemm_args *a, int64_t panel, int64_t m0, const int mr, const int prefetch,
                     const char *ahead, const int64_t every, const int64_t share, const int blocked) {
    const float *wp = (const float *)a->w + panel * a->Kp * PANEL_COLS;
    const float *x = a->x + m0 * a->Kp; /* this row block: x[m, k] at k * mr + m if blocked */
    VEC acc[MR_MAX][PANEL_VECS];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < PANEL_VECS; v++) acc[m][v] = VZERO();
    /* The next fetch of `ahead` is at iteration due: a compare per iteration, where k % every took
     * an integer division in the loop (~9% of a 64-row call's samples). */
    int64_t due = 0, fetched = 0;
    for (int64_t k = 0; k < a->Kp; k++) {
        const float *row = wp + k * PANEL_COLS;
        if (prefetch) PREFETCH_PANEL(row);
        if (ahead && k == due && fetched < share) {
            _mm_prefetch(ahead + fetched++ * 64, _MM_HINT_T1);
            due += every;
        }
        VEC w[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; v++) {
            w[v] = VLOAD(row + v * VLEN);
            if (mr >= 4) IN_REGISTER(w[v]);
        }
        for (int m = 0; m < mr; m++) {
            const VEC xv = VSET1(blocked ? x[k * mr + m] : x[m * a->Kp + k]);
            for (int v = 0; v < PANEL_VECS; v++) acc[m][v] = VFMA(w[v], xv, acc[m][v]);
        }
    }
    finish_f32(a, panel, m0, mr, acc);
}

/* The same for a bf16 panel, a pair of k per step. */
INLINE void tile_bf16(const gemm_args *a, int64_t panel, int64_t m0, const int mr, const int prefetch,
                      const char *ahead, const int64_t every, const int64_t share, const int blocked) {
    const uint16_t *wp = (const uint16_t *)a->w + panel * a->Kp * PANEL_COLS;
    VEC acc[MR_MAX][PANEL_VECS];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < PANEL_VECS; v++) acc[m][v] = VZERO();
    int64_t due = 0, fetched = 0; /* as in tile_f32, in pairs of k */
    for (int64_t k = 0; k < a->Kp; k += 2) {
        const uint16_t *row = wp + k * PANEL_COLS; /* PANEL_COLS pairs */
        if (prefetch) PREFETCH_PANEL(row);
        if (ahead && k / 2 == due && fetched < share) {
            _mm_prefetch(ahead + fetched++ * 64, _MM_HINT_T1);
            due += every;
        }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        __m512bh w[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; v++) {
            w[v] = (__m512bh)ILOAD(row + v * 2 * VLEN);
            IN_REGISTER(w[v]);
        }
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, blocked ? a->xb + m0 * a->Kp + k * mr + 2 * m : a->xb + (m0 + m) * a->Kp + k, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < PANEL_VECS; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], xv);
        }
#else
        for (int v = 0; v < PANEL_VECS; v++) {
            const IVEC pairs = ILOAD(row + v * 2 * VLEN);
            const VEC even = PAIR_EVEN(pairs), odd = PAIR_ODD(pairs);
            for (int m = 0; m < mr; m++) {
                const float *x = a->x + (m0 + m) * a->Kp + k;
                acc[m][v] = VFMA(odd, VSET1(x[1]), VFMA(even, VSET1(x[0]), acc[m][v]));
            }
        }
#endif
    }
    finish_bf16(a, panel, m0, mr, acc);
}

#define TILE_CASE(n, ahead, blocked) \
    case n: \
        if (a->bf16) tile_bf16(a, panel, m0, n, prefetch, ahead, every, share, blocked); \
        else tile_f32(a, panel, m0, n, prefetch, ahead, every, share, blocked); \
        break;
#if MR_MAX > 6
#define TILE_CASES_7_12(ahead, blocked) \
    TILE_CASE(7, ahead, blocked) TILE_CASE(8, ahead, blocked) TILE_CASE(9, ahead, blocked) \
    TILE_CASE(10, ahead, blocked) TILE_CASE(11, ahead, blocked) TILE_CASE(12, ahead, blocked)
#else
#define TILE_CASES_7_12(ahead, blocked)
#endif
#if MR_MAX > 2
#define TILE_CASES_3_6(ahead, blocked) \
    TILE_CASE(3, ahead, blocked) TILE_CASE(4, ahead, blocked) TILE_CASE(5, ahead, blocked) TILE_CASE(6, ahead, blocked)
#else
#define TILE_CASES_3_6(ahead, blocked)
#endif
/* One tile, its row count made a constant for the compiler. prefetch: stream its own panel ahead
 * (PREFETCH_BYTES); ahead: where this block's share of the next panel's lines begins, or NULL, a
 * line fetched every `every` k iterations, `share` lines in all (panel_rows). A
 * tile with `ahead`, and one reading a blocked input, is an instance of its own (only calls of two
 * or more blocks use them): a check in the k loop of every tile cost 3% at 64 rows. */
static void tile(const gemm_args *a, int64_t panel, int64_t m0, int mr, int prefetch, const char *ahead,
                 int64_t every, int64_t share) {
    if (ahead && mr >= 6) {
        switch (mr) {
            TILE_CASE(6, ahead, 1) TILE_CASES_7_12(ahead, 1)
            default: break;
        }
        return;
    }
    if (a->x_blocked) {
        switch (mr) {
            TILE_CASE(1, NULL, 1) TILE_CASE(2, NULL, 1) TILE_CASES_3_6(NULL, 1) TILE_CASES_7_12(NULL, 1)
            default: break;
        }
        return;
    }
    switch (mr) {
        TILE_CASE(1, NULL, 0) TILE_CASE(2, NULL, 0) TILE_CASES_3_6(NULL, 0) TILE_CASES_7_12(NULL, 0)
        default: break;
    }
}

#ifndef __AVX512F__
/* AVX2, fp32, calls of HALF_MIN_ROWS rows or more: half-panel tiles of up to HALF_MR rows x 16
 * columns (12 accumulators, two weight vectors and a broadcast: 15 of AVX2's 16 registers, the
 * shape of BLIS's Haswell micro-kernel). The full-panel AVX2 tile holds only 2 rows (8 accumulators
 * and 4 weight vectors), so past a few rows it re-read each panel from L2 every 2 rows, 128 bytes
 * per 8 FMAs: at 16-64 rows that bound it at oneDNN's rate or below. A half tile reads 64 bytes (one
 * cache line of each k's 128) per 12 FMAs. The first tile over a panel prefetches both lines, so
 * the second half finds its lines in cache.
 *
 * From 3 rows up (HALF_MIN_ROWS), since every tile over a panel also fetches its share of the
 * thread's next panel into L2 (as panel_rows does for AVX-512's row blocks), up to
 * HALF_SPREAD_MAX_ROWS rows: without that, the first tile streamed the panel from memory and the
 * later ones computed while the memory idled. llama-120m's 49 decode GEMMs on the AVX2 Zen 3 host,
 * alternating in one process, the spread against none: 9 rows 0.77x the time, 16 0.83x, 24
 * 0.81-0.87x, 32 0.92-0.96x, 48 0.92x, 56 0.88-0.96x. Past that the tiles fetch at most
 * HALF_SPREAD_CAP bytes of the next panel (a 768-input panel whole, the first half of a 2048-input
 * one), and its first tile streams the rest itself: the whole panel there measured 1.02-1.05x the
 * time at 64 rows and 1.16-1.19x at 128 while the host was quiet (256 KB of next panel pushed the
 * current one, still re-read by ~20 tiles, out of the 512 KB L2), but while it was busy the capped
 * fetch took 0.74-0.87x the time of none at 64 rows, 0.81-0.93x at 96 and 0.71-0.85x at 128 (the
 * whole panel 0.66-0.74x, 0.92x, 0.87-0.89x). With the spread, half tiles beat the 2-row full-panel
 * tiles from 3 rows (0.96x the time; 4 rows 0.88x, 6 0.75x, 8 0.78x), not at 2 (1.11x). */
#define HALF_COLS 16
#define HALF_MR 6
#ifndef HALF_MIN_ROWS
#define HALF_MIN_ROWS 3
#endif
#ifndef HALF_SPREAD_MAX_ROWS
#define HALF_SPREAD_MAX_ROWS 56
#endif
#ifndef HALF_SPREAD_CAP
#define HALF_SPREAD_CAP 131072
#endif
/* From HALF_XB_MIN_ROWS rows the input is copied block by block, each k-major (x_blocked, as the
 * AVX-512 tiles have it from 13 rows), so a tile's broadcasts read one stream rather than one per
 * row. llama-120m's 49 decode GEMMs on the AVX2 Zen 3 host, three alternating A/Bs against the
 * row-major copy: 64 rows 0.88-0.93x the time, 48 0.92x, 32 0.92-0.96x, 24 0.96x, 16 0.94-0.99x,
 * 8 0.89-1.06x, 3-6 0.97x; whole decode steps varied more with the host than between the two, and
 * blocks were taken from 24 rows only. Later, the 12 layers' GEMMs with SwiGLU and the LM head from
 * memory, 40 runs each, every run next to one of the row-major build (paired, so both see the same
 * moment of this noisy host; median of the 40 time ratios): 3 rows 0.98x, 4 1.01x, 6 0.96x, 8
 * 0.97x, 10 0.96x, 12 0.93x, 16 0.91x (faster in 40 of 40 pairs), 20 0.95x; whole fused decode
 * steps of llama-120m, paired the same way (30 pairs): 4 rows 0.99x, 8 0.99x, 12 0.95x, 16 0.92x
 * (faster in 28 of 30). So every half-tile call takes blocks. */
#ifndef HALF_XB_MIN_ROWS
#define HALF_XB_MIN_ROWS HALF_MIN_ROWS
#endif

INLINE void tile_f32_half(const gemm_args *a, int64_t panel, int half, int64_t m0, const int mr, const int blocked,
                          const int prefetch, const char *ahead, const int64_t every, const int64_t share) {
    const float *wp = (const float *)a->w + panel * a->Kp * PANEL_COLS;
    const float *x = a->x + m0 * a->Kp;
    const int64_t m_step = blocked ? 1 : a->Kp, k_step = blocked ? mr : 1; /* x[m, k] of the tile */
    __m256 acc[HALF_MR][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t due = 0, fetched = 0;
    for (int64_t k = 0; k < a->Kp; k++) {
        const float *row = wp + k * PANEL_COLS;
        if (prefetch) PREFETCH_PANEL(row);
        if (ahead && k == due && fetched < share) {
            _mm_prefetch(ahead + fetched++ * 64, _MM_HINT_T1);
            due += every;
        }
        __m256 w0 = _mm256_loadu_ps(row + half * HALF_COLS), w1 = _mm256_loadu_ps(row + half * HALF_COLS + 8);
        IN_REGISTER(w0);
        IN_REGISTER(w1);
        for (int m = 0; m < mr; m++) {
            const __m256 xv = _mm256_set1_ps(x[m * m_step + k * k_step]);
            acc[m][0] = _mm256_fmadd_ps(w0, xv, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xv, acc[m][1]);
        }
    }
    for (int m = 0; m < mr; m++) store_vectors_f32(a, m0 + m, panel * PANEL_COLS + half * HALF_COLS, acc[m], 2);
}

/* Panel p of an fp32 call in half tiles: each half's row blocks in turn (the half panel, K x 64
 * bytes, stays in L2 between them). next and prefetched as for panel_rows; returns whether this
 * panel's tiles fetched next. */
static int half_panel_rows(const gemm_args *a, int64_t p, int64_t next, int prefetched) {
    const int64_t mr = block_rows(a->M, HALF_MR), blocks = (a->M + mr - 1) / mr;
    const int halves = p * PANEL_COLS + HALF_COLS < a->N ? 2 : 1;
    const int64_t panel_bytes = a->Kp * PANEL_COLS * 4;
    const int64_t fetch_bytes = a->M <= HALF_SPREAD_MAX_ROWS ? panel_bytes
                                : panel_bytes < HALF_SPREAD_CAP ? panel_bytes : HALF_SPREAD_CAP;
    const char *next_panel = fetch_bytes > 0 && next >= 0 ? (const char *)a->w + next * panel_bytes : NULL;
    const int64_t share = fetch_bytes > 0 ? (fetch_bytes / 64 + halves * blocks - 1) / (halves * blocks) : 1;
    const int64_t every = a->Kp / share > 1 ? a->Kp / share : 1;
    int64_t t = 0; /* tiles so far over this panel: tile t fetches lines [t * share, (t + 1) * share) of next */
    for (int half = 0; half < halves; half++) {
        for (int64_t m0 = 0; m0 < a->M; m0 += mr, t++) {
            const int rows = (int)(a->M - m0 < mr ? a->M - m0 : mr), prefetch = half == 0 && m0 == 0 && !prefetched;
            const char *ahead = next_panel ? next_panel + t * share * 64 : NULL;
/* the row count and the input layout constants, so the accumulators stay in registers */
#define HALF_TILE(r, blocked) tile_f32_half(a, p, half, m0, r, blocked, prefetch, ahead, every, share)
#define HALF_TILES_OF(blocked)                       \
    switch (rows) {                                  \
        case 1: HALF_TILE(1, blocked); break;        \
        case 2: HALF_TILE(2, blocked); break;        \
        case 3: HALF_TILE(3, blocked); break;        \
        case 4: HALF_TILE(4, blocked); break;        \
        case 5: HALF_TILE(5, blocked); break;        \
        default: HALF_TILE(6, blocked); break;       \
    }
            if (a->x_blocked) {
                HALF_TILES_OF(1)
            } else {
                HALF_TILES_OF(0)
            }
#undef HALF_TILES_OF
#undef HALF_TILE
        }
    }
    return next_panel != NULL && fetch_bytes == panel_bytes;
}
#define HALF_TILES 1
#endif
#else
/* Without AVX2: one output at a time. */
static void tile(const gemm_args *a, int64_t panel, int64_t m0, int mr, int prefetch, const char *ahead,
                 int64_t every, int64_t share) {
    (void)prefetch;
    (void)ahead;
    (void)every;
    (void)share;
    for (int m = 0; m < mr; m++) {
        float buf[PANEL_COLS];
        const float *x = a->x + (m0 + m) * a->Kp;
        for (int c = 0; c < PANEL_COLS; c++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < a->Kp; k++) {
                const int64_t at = panel * a->Kp * PANEL_COLS + (a->bf16 ? (k / 2) * 2 * PANEL_COLS + c * 2 + k % 2
                                                                         : k * PANEL_COLS + c);
                acc += x[k] * (a->bf16 ? bf16_to_float(((const uint16_t *)a->w)[at]) : ((const float *)a->w)[at]);
            }
            buf[c] = acc;
        }
        store_row(a, panel, m0 + m, buf);
    }
}
#endif

#if defined(SMALL_GEMM_VECTOR) && defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* bf16 on AMX tiles (Sapphire Rapids and later), where the vector tiles above compute too slowly:
 * from 8 rows oneDNN's AMX GEMM beat them (1.5x at 16 rows, 3.9x at 64), and a fused decode step
 * then had to leave this kernel for the module path. A pass over a panel takes up to AMX_PASS_ROWS
 * input rows as two A tiles (16 rows x 32 k each, straight from the row-major bf16 copy) against
 * the panel's two B tiles (16 pairs of k x 16 columns: the panel's pair-interleaved layout is the
 * tiles' own, read with a 128-byte row stride), into four C tiles of fp32 sums, then the same
 * epilogue as the vector tiles. Each pass fetches its share of the next panel into L2, spread over
 * its k steps, as the vector tiles of several blocks do. TDPBF16PS multiplies pairs exactly and
 * sums in fp32 (in its own order, and with denormal inputs and outputs flushed to zero), so results
 * differ from the vector tiles by fp32 rounding, as oneDNN's AMX GEMM does. */
#define SMALL_GEMM_AMX 1
#include "cpu_amx.h" /* amx_permitted, amx_configure: tiles 0-1 A (input rows), 2-3 B (the panel's
                      * columns 0-15 and 16-31), 4-7 C */
#define AMX_ROWS 16                /* rows of an A tile and of a C tile */
#define AMX_K 32                   /* k per step: an A tile row is 32 bf16 (64 bytes) */
#define AMX_PASS_ROWS (2 * AMX_ROWS)
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 2 /* one row streams as fast on the vector tiles (chain of 48 GEMMs: AMX 1.08x the time), two on AMX 0.98x */
#endif

/* Rows m0.. (32, or 16 when two == 0) against one panel, their fp32 sums into `sums`; ahead: the
 * lines of the next panel this pass fetches, `lines` of them, `per_step` a k step. Rows past M are
 * the copy's zero padding and are computed too. */
static void tile_amx_sums(const gemm_args *a, int64_t panel, int64_t m0, const int two, const char *ahead,
                          int64_t lines, int64_t per_step, float sums[AMX_PASS_ROWS][PANEL_COLS]) {
    const uint16_t *wp = (const uint16_t *)a->w + panel * a->Kp * PANEL_COLS;
    const uint16_t *x = a->xb + m0 * a->Kp;
    const int64_t ldx = a->Kp * (int64_t)sizeof(uint16_t), ldw = 2 * PANEL_COLS * (int64_t)sizeof(uint16_t);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t k = 0, line = 0; k < a->Kp; k += AMX_K) {
        for (int64_t end = line + per_step; ahead && line < end && line < lines; line++)
            _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
        const uint16_t *b = wp + k * PANEL_COLS; /* pair row k / 2: PANEL_COLS pairs */
        _tile_loadd(2, b, ldw);
        _tile_loadd(3, b + 2 * AMX_ROWS, ldw);
        _tile_loadd(0, x + k, ldx);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
            _tile_loadd(1, x + AMX_ROWS * a->Kp + k, ldx);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    const int64_t ld = PANEL_COLS * (int64_t)sizeof(float);
    _tile_stored(4, &sums[0][0], ld);
    _tile_stored(5, &sums[0][AMX_ROWS], ld);
    if (two) {
        _tile_stored(6, &sums[AMX_ROWS][0], ld);
        _tile_stored(7, &sums[AMX_ROWS][AMX_ROWS], ld);
    }
}

/* The rows of a pass at m0 that are real (not padding). */
static inline int64_t amx_pass_rows(const gemm_args *a, int64_t m0) {
    return a->M - m0 < AMX_PASS_ROWS ? a->M - m0 : AMX_PASS_ROWS;
}

/* The lines of `next` (a panel, or -1) that pass i of `passes` fetches: *lines of them from the
 * returned address (NULL for none), *per_step a k step. */
static const char *amx_fetch_share(const gemm_args *a, int64_t next, int64_t i, int64_t passes, int64_t *lines,
                                   int64_t *per_step) {
    const int64_t panel_bytes = a->Kp * PANEL_COLS * (int64_t)sizeof(uint16_t), panel_lines = panel_bytes / 64;
    const int64_t share = (panel_lines + passes - 1) / passes, first = i * share;
    *lines = panel_lines - first < share ? panel_lines - first : share;
    *per_step = (share + a->Kp / AMX_K - 1) / (a->Kp / AMX_K);
    return next < 0 ? NULL : (const char *)a->w + next * panel_bytes + first * 64;
}

/* One panel times every input row on AMX, pass by pass; each pass fetches its share of the next
 * panel (the thread's next one, or -1). */
static void panel_amx(const gemm_args *a, int64_t p, int64_t next) {
    const int64_t passes = (a->M + AMX_PASS_ROWS - 1) / AMX_PASS_ROWS;
    float sums[AMX_PASS_ROWS][PANEL_COLS] __attribute__((aligned(64)));
    for (int64_t i = 0; i < passes; i++) {
        const int64_t m0 = i * AMX_PASS_ROWS;
        int64_t lines, per_step;
        const char *ahead = amx_fetch_share(a, next, i, passes, &lines, &per_step);
        tile_amx_sums(a, p, m0, a->M - m0 > AMX_ROWS, ahead, lines, per_step, sums);
        for (int64_t m = 0, rows = amx_pass_rows(a, m0); m < rows; m++) {
            const VEC acc[PANEL_VECS] = {VLOAD(sums[m]), VLOAD(sums[m] + VLEN)};
            finish_bf16_row(a, p, m0 + m, acc);
        }
    }
}

/* SwiGLU on AMX: gate panel g and its up panel u (g + half / PANEL_COLS) pass by pass, and the
 * pass's act columns straight from the two passes' sums while they are in L1, each value rounded
 * as the scratch path rounds it (the GEMM outputs with their bias, then SiLU, then the product).
 * Why: through the scratch, a 64-row llama-120m gate/up call read its gate and up rows back from
 * L2 a row stride apart, ~40 us of ~330 even with the rows prefetched. The gate passes fetch the
 * next pair's gate panel, the up passes its up panel. */
static void pair_amx(const gemm_args *a, int64_t g, int64_t u, int64_t next_g, int64_t next_u) {
    const int64_t passes = (a->M + AMX_PASS_ROWS - 1) / AMX_PASS_ROWS, n0 = g * PANEL_COLS;
    float gate[AMX_PASS_ROWS][PANEL_COLS] __attribute__((aligned(64)));
    float up[AMX_PASS_ROWS][PANEL_COLS] __attribute__((aligned(64)));
    const uint16_t *bias_g = a->bias ? (const uint16_t *)a->bias + n0 : NULL;
    const uint16_t *bias_u = a->bias ? (const uint16_t *)a->bias + u * PANEL_COLS : NULL;
    for (int64_t i = 0; i < passes; i++) {
        const int64_t m0 = i * AMX_PASS_ROWS;
        const int two = a->M - m0 > AMX_ROWS;
        int64_t lines, per_step;
        const char *ahead = amx_fetch_share(a, next_g, i, passes, &lines, &per_step);
        tile_amx_sums(a, g, m0, two, ahead, lines, per_step, gate);
        ahead = amx_fetch_share(a, next_u, i, passes, &lines, &per_step);
        tile_amx_sums(a, u, m0, two, ahead, lines, per_step, up);
        for (int64_t m = 0, rows = amx_pass_rows(a, m0); m < rows; m++) {
            uint16_t *act = (uint16_t *)a->act + (m0 + m) * a->ld_act + n0;
            for (int v = 0; v < PANEL_VECS; v++) {
                VEC gv = VLOAD(gate[m] + v * VLEN), uv = VLOAD(up[m] + v * VLEN);
                if (bias_g) {
                    gv = VADD(gv, load_bf16(bias_g + v * VLEN));
                    uv = VADD(uv, load_bf16(bias_u + v * VLEN));
                }
                _mm256_storeu_si256((__m256i *)(act + v * VLEN), swiglu_bf16_16(round_bf16_16(gv), round_bf16_16(uv)));
            }
        }
    }
}

/* A thread's SwiGLU chunks on AMX (see take_chunks): pair by pair, each fetching the next one's
 * panels, the thread's next chunk taken when its last pair starts. */
static void take_pairs_amx(const gemm_args *a, int64_t *counter, int64_t chunks, int64_t panels, int64_t half) {
    const int64_t up_offset = half / PANEL_COLS;
    int64_t c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    while (c < chunks) {
        const int64_t begin = c * CHUNK_PANELS, end = begin + CHUNK_PANELS < panels ? begin + CHUNK_PANELS : panels;
        int64_t c_next = chunks;
        for (int64_t g = begin; g < end; g++) {
            int64_t next = g + 1;
            if (next == end) {
                c_next = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
                next = c_next < chunks ? c_next * CHUNK_PANELS : -1;
            }
            pair_amx(a, g, g + up_offset, next, next < 0 ? -1 : next + up_offset);
        }
        c = c_next;
    }
}

/* Whether a bf16 call of M rows runs on AMX: the tiles take K in steps of AMX_K. */
static int amx_takes(int64_t M, int64_t Kp) { return M >= AMX_MIN_ROWS && Kp % AMX_K == 0 && amx_permitted(); }
#else
#define AMX_PASS_ROWS 1
static __attribute__((unused)) int amx_permitted(void) { return 0; }
static int amx_takes(int64_t M, int64_t Kp) {
    (void)M;
    (void)Kp;
    return 0;
}
#endif

/* One panel times every input row, in row blocks of equal size (at most MR_MAX). next: the panel
 * this thread computes after it, or -1; prefetched: whether the previous panel fetched this one.
 * Returns whether this one fetched next.
 *
 * With one block the call streams the weights at memory rate, and the block prefetches its own
 * panel PREFETCH_BYTES ahead. With several, the first block over a panel is the only one that
 * reads it from memory, in one block's time, while the later blocks find it in L2 and the memory
 * idles: at 16 rows (two blocks of 8) a fp32 panel came in ~3.4 us, ~29 GB/s a core, more than two
 * cores get. So every block also fetches its share of the next panel into L2, a line every few
 * iterations of its k loop, spreading the stream over the whole time the panel computes, and the
 * next panel's first block finds it there. llama-120m's 49 decode GEMMs (weights from memory,
 * alternating with the previous build in one process), two blocks, Zen 4 host: fp32 13 rows 0.87x,
 * 16 rows 0.925x, 20-24 rows 1.0x; bf16 16 rows 0.94x. Three or more blocks (25+ rows) then kept the
 * old stream (an earlier spread measured 3-4% slower there on Zen 4); on the Sapphire Rapids host
 * the old stream left compute and memory in turn, a 12-layer fp32 chain at 64 rows taking 51.6 ms
 * where its arithmetic alone (weights in cache) took 38.8, and spreading the fetch over all blocks
 * measured fp32 0.83-0.85x at 64 rows, 0.79x at 48, 0.86-0.89x at 32; bf16 0.93x at 48, 0.90x at 32;
 * in a whole 64-row fp32 decode step (attention included) 0.93x. */
static int panel_rows(const gemm_args *a, int64_t p, int64_t next, int prefetched) {
#ifdef SMALL_GEMM_AMX
    if (a->amx) {
        panel_amx(a, p, next);
        return next >= 0;
    }
#endif
#ifdef HALF_TILES
    if (!a->bf16 && a->M >= HALF_MIN_ROWS) { /* the input blocked k-major (HALF_XB_MIN_ROWS) */
        return half_panel_rows(a, p, next, prefetched);
    }
#endif
    const int64_t blocks = (a->M + MR_MAX - 1) / MR_MAX, mr = block_rows(a->M, MR_MAX);
    const int64_t panel_bytes = a->Kp * PANEL_COLS * (a->bf16 ? 2 : 4);
    const char *next_panel = next < 0 || blocks < 2 || MR_MAX <= 6 ? NULL : (const char *)a->w + next * panel_bytes;
    /* Block b fetches lines [b * share, (b + 1) * share) of the next panel, one line every `every`
     * iterations of its k loop (iters of them): the panel's lines spread evenly over its blocks. */
    const int64_t iters = a->bf16 ? a->Kp / 2 : a->Kp, share = (panel_bytes / 64 + blocks - 1) / blocks;
    const int64_t every = iters / share > 1 ? iters / share : 1;
#ifdef SMALL_GEMM_VECTOR
    /* One block: the tile prefetches its own panel PREFETCH_BYTES ahead, which runs on into panel
     * p + 1; when this thread goes on elsewhere (its next chunk), that chunk's first PREFETCH_BYTES
     * are fetched now instead of missing at its start (49 decode GEMMs: fp32 1-2 rows 0.98-0.99x,
     * bf16 1 row 0.98x; a 4-panel chunk to start streams less often measured 0.98-1.0x). */
    if (blocks == 1 && next >= 0 && next != p + 1) {
        const char *head = (const char *)a->w + next * panel_bytes;
        for (int64_t i = 0; i < PREFETCH_BYTES && i < panel_bytes; i += 64) _mm_prefetch(head + i, _MM_HINT_T1);
    }
#endif
    int64_t b = 0;
    for (int64_t m0 = 0; m0 < a->M; m0 += mr, b++)
        tile(a, p, m0, (int)(a->M - m0 < mr ? a->M - m0 : mr), m0 == 0 && !prefetched,
             next_panel ? next_panel + b * share * 64 : NULL, every, share);
    return next_panel != NULL;
}

/* act[m, n] = silu(gate) * up for n in [n_begin, n_end), gate = y[m, n], up = y[m, half + n], as
 * torch's F.silu(gate) * up (in fp32; its vectorised exp and exp_nonpositive differ by about an
 * ulp), and in bf16 with silu and the product each rounded to bf16, as two bf16 torch ops round. */
static void swiglu_rows(const gemm_args *a, int64_t n_begin, int64_t n_end, int64_t half) {
    const int64_t elem = a->bf16 ? 2 : 4, bytes = (n_end - n_begin) * elem;
    for (int64_t m = 0; m < a->M; m++) {
        int64_t n = n_begin;
        /* The chunk's rows are in L2 by now (its panels' weights and inputs pushed them out of
         * L1), a row stride apart: no prefetcher follows that, so each row waited on its loads
         * (at 64 rows ~100 us of a llama-120m gate/up call). Fetch SWIGLU_AHEAD rows ahead. */
        if (m + SWIGLU_AHEAD < a->M) {
            const char *next = (const char *)a->y + ((m + SWIGLU_AHEAD) * a->ldy + n_begin) * elem;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(next + b, 0, 3);
                __builtin_prefetch(next + half * elem + b, 0, 3);
            }
        }
        if (!a->bf16) {
            const float *restrict gate = (const float *)a->y + m * a->ldy, *restrict up = gate + half;
            float *restrict act = (float *)a->act + m * a->ld_act;
#ifdef __AVX512F__
            for (; n + 16 <= n_end; n += 16)
                _mm512_storeu_ps(act + n, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + n)), _mm512_loadu_ps(up + n)));
#endif
            for (; n < n_end; n++) act[n] = silu(gate[n]) * up[n];
            continue;
        }
        const uint16_t *restrict gate = (const uint16_t *)a->y + m * a->ldy, *restrict up = gate + half;
        uint16_t *restrict act = (uint16_t *)a->act + m * a->ld_act;
#ifdef __AVX512F__
        /* 16 lanes: silu16, the arithmetic pair_amx applies too, bitwise the scalar loop below. */
        for (; n + 16 <= n_end; n += 16)
            _mm256_storeu_si256((__m256i *)(act + n), swiglu_bf16_16(load_bf16(gate + n), load_bf16(up + n)));
#endif
        for (; n < n_end; n++) {
            const float rounded_silu = bf16_to_float(float_to_bf16(silu(bf16_to_float(gate[n]))));
            act[n] = float_to_bf16(rounded_silu * bf16_to_float(up[n]));
        }
    }
}

/* The i-th panel of chunk c's work, or -1 past its end: the chunk's CHUNK_PANELS output panels;
 * with SwiGLU, the chunk's gate panels and then the up panels that pair with them. */
static int64_t chunk_panel(const gemm_args *a, int64_t c, int64_t i, int64_t panels, int64_t half) {
    const int64_t begin = c * CHUNK_PANELS, end = begin + CHUNK_PANELS < panels ? begin + CHUNK_PANELS : panels;
    if (i < end - begin) return begin + i;
    if (a->act && i < 2 * (end - begin)) return half / PANEL_COLS + begin + i - (end - begin);
    return -1;
}

/* One thread's share: chunks taken from *counter as the thread comes for them, not a fixed part
 * each: on a server the HTTP process and the client share these cores, and a thread the kernel
 * deschedules mid-call would otherwise leave its whole part for the others to wait on (a barrier at
 * the end). A thread takes its next chunk when it starts the last panel of the current one, so
 * that panel can fetch the next chunk's first (panel_rows); with SwiGLU, each chunk's SiLU and
 * product follow its pairs of panels while they are in cache. */
static void take_chunks(const gemm_args *a, int64_t *counter, int64_t chunks, int64_t panels, int64_t half) {
#ifdef SMALL_GEMM_AMX
    if (a->amx) amx_configure();
    if (a->amx && a->act && AMX_PAIRS) {
        take_pairs_amx(a, counter, chunks, panels, half);
        _tile_release();
        return;
    }
#endif
    int64_t c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    int prefetched = 0;
    while (c < chunks) {
        int64_t c_next = chunks;
        for (int64_t i = 0;; i++) {
            const int64_t p = chunk_panel(a, c, i, panels, half);
            if (p < 0) break;
            int64_t next = chunk_panel(a, c, i + 1, panels, half);
            if (next < 0) {
                c_next = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
                next = c_next < chunks ? chunk_panel(a, c_next, 0, panels, half) : -1;
            }
            prefetched = panel_rows(a, p, next, prefetched);
        }
        if (a->act) {
            const int64_t n_begin = c * CHUNK_PANELS * PANEL_COLS, n_end = n_begin + CHUNK_PANELS * PANEL_COLS;
            swiglu_rows(a, n_begin, n_end < half ? n_end : half, half);
        }
        c = c_next;
    }
#ifdef SMALL_GEMM_AMX
    if (a->amx) _tile_release(); /* the thread's tile state goes back (a context switch then saves less) */
#endif
}

/* Part `part` of `parts` of the input copies a->x and a->xb (zero-padded to Kp; blocked or AMX-padded
 * as a says), made by the threads of the call's region: made by one thread before it, the copy
 * left the other idle (at 64 rows and K 2048, 131K strided floats a call). Row blocks (blocked)
 * or rows are dealt out round robin. */
static void copy_input(const gemm_args *a, int64_t part, int64_t parts) {
    const int64_t M = a->M, K = a->K, Kp = a->Kp, ldx = a->ldsrc;
    const void *x = a->src;
    float *xf = (float *)a->x;
    uint16_t *xb = (uint16_t *)a->xb;
    const int bf16 = a->bf16, x_blocked = a->x_blocked;
    if (a->amx && part == 0) memset(xb + M * Kp, 0, (size_t)((a->padded_rows - M) * Kp) * sizeof(uint16_t));
#ifdef HALF_TILES
    const int64_t mr = x_blocked ? block_rows(M, bf16 ? MR_MAX : HALF_MR) : 1; /* the blocks the tiles read */
#else
    const int64_t mr = x_blocked ? block_rows(M, MR_MAX) : 1;
#endif
    int64_t b = 0;
    for (int64_t m0 = 0; m0 < M; m0 += mr, b++) {
        if (b % parts != part) continue;
        const int64_t rows = M - m0 < mr ? M - m0 : mr;
        if (x_blocked && bf16)
            for (int64_t k = 0; k < Kp; k += 2)
                for (int64_t m = 0; m < rows; m++)
                    for (int64_t h = 0; h < 2; h++) {
                        const uint16_t *row = (const uint16_t *)x + (m0 + m) * ldx;
                        xb[m0 * Kp + k * rows + 2 * m + h] = k + h < K ? row[k + h] : 0;
                    }
        if (x_blocked && !bf16) {
            const float *src = (const float *)x + m0 * ldx;
            float *out = xf + m0 * Kp;
            int64_t k = 0;
#ifdef __AVX512F__
            /* A column of the block per k, gathered: the scalar walk down the rows took ~0.5 ns a float,
             * ~70 us of a 64-row call at K 2048. */
            if (rows <= 16 && ldx < INT32_MAX / 16) {
                const __mmask16 lanes = (__mmask16)((1u << rows) - 1);
                const __m512i offsets = _mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32((int)ldx));
                for (; k < K; k++)
                    _mm512_mask_storeu_ps(out + k * rows, lanes,
                                          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, offsets, src + k, 4));
            }
#endif
            for (; k < Kp; k++)
                for (int64_t m = 0; m < rows; m++) out[k * rows + m] = k < K ? src[m * ldx + k] : 0.0f;
            continue;
        }
        if (bf16 && BF16_READS_XB_ONLY) { /* blocked above, else row-major rows zero-padded to Kp */
            for (int64_t m = m0; !x_blocked && m < m0 + rows; m++) {
                memcpy(xb + m * Kp, (const uint16_t *)x + m * ldx, (size_t)K * sizeof(uint16_t));
                memset(xb + m * Kp + K, 0, (size_t)(Kp - K) * sizeof(uint16_t));
            }
            continue;
        }
        for (int64_t m = m0; m < m0 + rows; m++)
            for (int64_t k = 0; k < Kp; k++) {
                if (!bf16) {
                    xf[m * Kp + k] = k < K ? ((const float *)x)[m * ldx + k] : 0.0f;
                    continue;
                }
                const uint16_t h = k < K ? ((const uint16_t *)x)[m * ldx + k] : 0;
                if (!x_blocked) xb[m * Kp + k] = h;
                xf[m * Kp + k] = bf16_to_float(h);
            }
    }
}

static int run(gemm_args *a, int threads) {
    /* With SwiGLU the work is split over the gate panels; each chunk also does the matching up ones. */
    const int64_t half = a->act ? a->N / 2 : 0;
    const int64_t cols = a->act ? half : a->N, panels = (cols + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t chunks = (panels + CHUNK_PANELS - 1) / CHUNK_PANELS;
    if (threads < 1) threads = 1;
    /* Each thread at least 64 columns: below that, waking a thread costs more than it streams. */
    int64_t most = (cols + 63) / 64;
    if (threads > most) threads = (int)most;
    int64_t counter = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        copy_input(a, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
        take_chunks(a, &counter, chunks, panels, half);
    }
#else
    (void)threads;
    copy_input(a, 0, 1);
    take_chunks(a, &counter, chunks, panels, half);
#endif
    return 0;
}

/* y = x w^T (+ bias) (+ add), fp32 (bf16 != 0: every tensor bf16, as uint16_t bits). x: M rows of K,
 * row stride ldx; w: [N, K] in column panels (small_gemm.py's pack_weight: PANEL_COLS columns, K
 * padded to K_ALIGN, zero-padded); bias: N or NULL; add: M rows of N (stride ld_add) or NULL; y: M
 * rows of N, row stride ldy. With act non-NULL, w is a merged [gate; up] weight (N / 2 a multiple
 * of PANEL_COLS, so the up rows start a panel), y is ignored (a scratch takes the GEMM) and act
 * gets M rows (stride ld_act) of silu(gate) * up. Returns 0, -1 for bad sizes (M above
 * MAX_ROWS_ANY included), -2 when a scratch buffer cannot be allocated. */
static int small_gemm_any(const void *x, int64_t ldx, const void *w, const void *bias, const void *add,
                          int64_t ld_add, void *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads, int bf16,
                          void *act, int64_t ld_act, int out_f32) {
    if (act && (add || N % (2 * PANEL_COLS) || ld_act < N / 2)) return -1;
    if (out_f32 && (!bf16 || act)) return -1;
    /* The SwiGLU scratch's rows are padded by a cache line: N bf16 of llama-120m's 2 x 2048 are 8 KB,
     * and rows a multiple of 4 KB apart fall into the same L1 set, so the 64 rows of a chunk's
     * gate and up columns evicted each other before swiglu_rows read them back. With the padding
     * and swiglu_rows' prefetch, a 64-row bf16 call took ~40-50 us more than the plain GEMM of
     * the same weight, against ~110 us before (on AMX pair_amx now takes those calls). */
    if (act) ldy = N + SCRATCH_PAD;
    if (M < 0 || M > MAX_ROWS_ANY || N < 0 || K < 0 || ldx < K || ldy < N || (add && ld_add < N)) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t Kp = (K + K_ALIGN - 1) / K_ALIGN * K_ALIGN;
    /* The input copied once, zero-padded to Kp (the weights' padding), so no tile has a tail: M x
     * Kp floats (+ bf16), a few KB. */
    size_t floats = (size_t)(M * Kp > 0 ? M * Kp : 1);
    /* On AMX the bf16 copy is row-major with its rows padded with zeros to whole passes: a pass's
     * tile loads read 16 or 32 rows whatever M is. */
    const int amx = bf16 && amx_takes(M, Kp);
    const int64_t padded_rows = amx ? (M + AMX_PASS_ROWS - 1) / AMX_PASS_ROWS * AMX_PASS_ROWS : M;
    float *xf = bf16 && BF16_READS_XB_ONLY ? NULL : aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    uint16_t *xb = bf16 ? aligned_alloc(64, ((size_t)(padded_rows * Kp) * sizeof(uint16_t) + 63) / 64 * 64) : NULL;
    /* SwiGLU on AMX needs no scratch (pair_amx); elsewhere the GEMM goes through one. */
    const int via_scratch = act && !(amx && AMX_PAIRS);
    void *scratch = via_scratch ? malloc((size_t)(M * ldy) * (bf16 ? sizeof(uint16_t) : sizeof(float))) : NULL;
    if ((!xf && !(bf16 && BF16_READS_XB_ONLY)) || (bf16 && !xb) || (via_scratch && !scratch)) {
        free(xf);
        free(xb);
        free(scratch);
        return -2;
    }
    if (act) y = scratch; /* NULL on AMX: pair_amx writes act directly */
#ifdef HALF_TILES
    const int x_blocked = !bf16 && M >= HALF_XB_MIN_ROWS; /* the half tiles (AVX2 fp32) */
#else
    const int x_blocked = X_BLOCKED && (!bf16 || XB_BLOCKED) && M > MR_MAX && !amx;
#endif
    gemm_args a = {xf, xb, w, bias, add, ld_add, y, ldy, M, N, Kp, bf16, x_blocked, amx, act, ld_act,
                   x, ldx, K, padded_rows, out_f32};
    int rc = run(&a, threads);
    free(xf);
    free(xb);
    free(scratch);
    return rc;
}

int small_gemm(const float *x, int64_t ldx, const float *w, const float *bias, const float *add,
               int64_t ld_add, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return small_gemm_any(x, ldx, w, bias, add, ld_add, y, ldy, M, N, K, threads, 0, NULL, 0, 0);
}

int small_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, const uint16_t *add,
                    int64_t ld_add, uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return small_gemm_any(x, ldx, w, bias, add, ld_add, y, ldy, M, N, K, threads, 1, NULL, 0, 0);
}

/* small_gemm_bf16 (no add) with float32 output: each output the bf16 value small_gemm_bf16 gives,
 * widened (bitwise what `.float()` of its result reads). For the LM head, whose logits every
 * consumer takes in fp32: the separate widening pass over [rows, vocab] took ~0.5 ms of a 64-row
 * bf16 decode step. */
int small_gemm_bf16_f32out(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, float *y,
                           int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return small_gemm_any(x, ldx, w, bias, NULL, 0, y, ldy, M, N, K, threads, 1, NULL, 0, 1);
}

/* act = silu(x w_gate^T + b_gate) * (x w_up^T + b_up) for a merged [gate; up] weight of N rows (fp32,
 * or every tensor bf16 when bf16 != 0): the MLP's first half in one call, SiLU and the product done
 * by the thread that computed each pair of panels. See small_gemm_any for the rest. */
int small_gemm_swiglu(const void *x, int64_t ldx, const void *w, const void *bias, void *act, int64_t ld_act,
                      int64_t M, int64_t N, int64_t K, int threads, int bf16) {
    return small_gemm_any(x, ldx, w, bias, NULL, 0, NULL, 0, M, N, K, threads, bf16 != 0, act, ld_act, 0);
}

/* The most rows a call should bring (small_gemm.py routes larger calls to oneDNN), for fp32 or
 * (bf16 != 0) bf16 weights: where the kernel stopped beating oneDNN's blocked GEMM. On the Zen 4
 * host (AVX-512, AVX512-BF16; llama-120m's GEMVs, alternating) fp32 led at every count up to 32
 * (1.34x at 8, 1.12x at 16, 1.06x at 32, 0.96-1.1x at 32 across runs), bf16 up to 24 (1.40x at 8,
 * 1.18x at 16, 1.11x at 24) and lost at 32 (0.88x: oneDNN's bf16 GEMM computes faster once the
 * stream no longer bounds it); on the AVX2 host the previous kernel led up to 8, and this one
 * beats that one at 1-8 rows (AVX2 build on the Zen 4 host). With AMX tiles bf16 takes every row
 * count: on the Sapphire Rapids host the 48 decode GEMMs (12 layers, weights from memory) took
 * 0.89-0.93x oneDNN's time (AMX too) at 1-32 rows and 1.01x at 64. Any row count up to
 * MAX_ROWS_ANY computes correctly. */
int small_gemm_max_rows(int bf16) {
#if defined(__AVX512F__) && defined(SMALL_GEMM_VECTOR)
    /* fp32 too where the kernel has AMX tiles (an Intel core, Sapphire Rapids or later): there
     * oneDNN's fp32 GEMM overtakes the kernel later than on the Zen 4 the 32 below was measured on.
     * Sapphire Rapids host, this kernel / oneDNN, cold weights: llama-120m's 48 decode GEMMs 0.78x
     * at 32 and 48 rows, 0.87x at 64; its 32000-column LM head 0.78x at 48 rows, 0.86x at 64. Past
     * 64 rows (a prompt of up to 128 tokens), after the k loop lost its division and the input copy
     * its serial pass, 12 layers' GEMMs against the module path's oneDNN calls (SiLU and product as
     * torch ops): 0.84x at 96 rows, 0.94x at 128, 1.03x at 192, 1.10x at 256. bf16 up to 128
     * rows once the input copy stopped writing an unread fp32 copy and SwiGLU took its sums
     * straight from the AMX passes (pair_amx): 12 layers' GEMMs, weights from memory, against
     * oneDNN's AMX calls with SiLU and product as post-ops, 0.98-1.02x at 65-96 rows, 0.91-0.93x
     * at 112-128; a 128-token bf16 prefill forward took 0.90-0.95x the time with 128 as the cap
     * than with 64 (3 alternations). */
    if (amx_permitted()) return bf16 ? AMX_MAX_ROWS : MAX_ROWS_ANY;
    return bf16 ? 24 : 32;
#elif defined(HALF_TILES)
    /* AVX2 fp32 with the half-panel tiles: up to 64 rows (a fused decode step's most). AVX2 Zen 3
     * host (2 cores), llama-120m's 49 decode GEMMs, this kernel / oneDNN: one morning 8 rows 0.93x,
     * 16 0.83x, 64-128 0.88x; that afternoon (the host busier, the next-panel fetch in) 4-16 rows
     * 0.64-0.75x, 32 0.84x, but 48-128 rows 0.97-1.31x, and a 128-token prompt's prefill on
     * oneDNN took 0.90x the time of the kernel's (median of 12 alternating rounds), so past 64
     * rows oneDNN, whose blocking keeps the input in cache, takes the calls. At 64 rows the whole
     * fused step stayed ahead (0.79x the module path on oneDNN, same hour). bf16 (widened by
     * shifts, no native bf16 dot product on such a CPU) keeps the full-panel tiles and 8. */
    return bf16 ? 8 : FUSED_MAX_ROWS;
#else
    (void)bf16;
    return 8;
#endif
}

/* The most rows a fused decode step (decode_layers.c) should bring to this kernel: more than a
 * call alone, because there the alternative is not oneDNN's GEMM by itself but the module path
 * (per-layer Python, torch ops, and OpenMP regions in which the second thread waits while the first
 * runs serial code; oneDNN splits its work statically, this kernel hands chunks out as threads come).
 * llama-120m, Zen 4 host, a decode step alternating fused and module path in one process: fp32
 * 0.87x at 48 rows and 0.875x at 64 (the GEMMs alone: 1.02x and 1.00x), bf16 0.89x at 32, 0.91x at
 * 48 and 0.985x at 64 (the GEMMs alone 0.97x, 0.93x, 0.90x); on the AVX2 build, as a call alone.
 * bf16 on AMX tiles, Sapphire Rapids host, against the module path on oneDNN's AMX GEMM: 1 row
 * 0.58x, 4 rows 0.66x, 16 rows 0.72x, 32 rows 0.76x, 64 rows 0.84x. */
int small_gemm_fused_max_rows(int bf16) {
#if defined(__AVX512F__) && defined(SMALL_GEMM_VECTOR)
    if (bf16 && amx_permitted()) return FUSED_MAX_ROWS;
    return bf16 ? 48 : FUSED_MAX_ROWS;
#else
    const int rows = small_gemm_max_rows(bf16);
    return rows < FUSED_MAX_ROWS ? rows : FUSED_MAX_ROWS;
#endif
}

/* 1 when bf16 calls run on AMX tiles (this build has them and the OS granted the tile state). */
int small_gemm_amx(void) { return amx_permitted(); }

/* The layout's geometry, for the Python side's packing (one source of truth). */
int small_gemm_panel_cols(void) { return PANEL_COLS; }
int small_gemm_k_align(void) { return K_ALIGN; }
int small_gemm_max_rows_any(void) { return MAX_ROWS_ANY; }
