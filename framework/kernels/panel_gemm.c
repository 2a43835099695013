/* fp32 GEMMs of many rows (prefill) on the small-GEMM kernel's panel-packed weights, for CPUs with
 * AVX2 and FMA: y = x W^T (+ bias) (+ add), or silu(gate) * up for a merged [gate; up] weight.
 *
 * Why: on the AVX2-only Zen 3 host (2 cores; a bare FMA loop ran 77-101 GFLOP/s a core) oneDNN's
 * packed GEMM ran llama-120m's prefill shapes at 110-150 GFLOP/s and MKL's sgemm at 100-175, so a
 * 128-token prompt took ~150 ms of GEMMs. small_gemm.c streams each weight panel past every input row, which is
 * right for a decode step's few rows but re-reads the whole input (out of L2 once it passes ~100
 * rows) for every panel. This file blocks the loops the way BLIS's Haswell kernels do:
 *   - the input is copied once into tiles of MR rows, k-major (a tile's k-th MR values adjacent),
 *     zero-padded to whole tiles and to the weight's padded K;
 *   - the threads take units of work (a row block x CHUNK_HALVES half panels of NR = 16
 *     columns) from a shared counter, all reading the shared input copy;
 *   - rows go in blocks of up to MC_TILES tiles and K in blocks of KC, so a row block's slice of
 *     the input copy (MC x KC floats, up to 192 KB) stays in L2 while a half panel's KC x 16
 *     weights (16 KB) stay in L1 across the row block's tiles;
 *   - the 6 x 16 micro-kernel keeps its 12 accumulators in registers over KC steps of k, each step
 *     2 weight loads, 6 broadcasts and 12 FMAs.
 * Partial sums between K blocks go through the output itself (or, for SwiGLU, a scratch buffer of
 * the gate and up columns), and the last K block applies bias, add, or SiLU and the product.
 * Results differ from oneDNN's or MKL's by fp32 summation order only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PANEL_GEMM_VECTOR 1
#endif

#include "cpu_float.h" /* silu */

#define PANEL_COLS 32 /* must match small_gemm.c's layout: [N / 32][Kp][32] floats */
#define NR 16 /* columns of a micro-tile: half a panel, two AVX2 vectors */
#define MR 6  /* rows of a micro-tile: 12 accumulators + 2 weight vectors + a broadcast, of 16 registers
               * (a 3 x 32 tile needs 17, and GCC then re-loaded the weights on every FMA) */
#ifndef KC
#define KC 256 /* k per block: a half panel's block is KC x 64 bytes (16 KB, in L1) */
#endif
/* The most tiles per row block: 192 rows x KC floats of input copy (192 KB, in the 512 KB L2). A
 * call's tiles are split into the fewest blocks of at most this many, of equal size, so each half
 * panel's K block is re-used by as many tiles as fit. AVX2-only Zen 3 host, llama-120m, in the
 * engine, alternating builds in one process, against blocks of 16 tiles with the rest in a last
 * smaller one: one 128-token prompt 0.93x the time (faster in 16 of 16 rounds; one block of 22
 * tiles where it was 16 + 6), two 0.95x; 192 rows 1.01x and eight prompts (1,024 rows) 1.00x, as
 * before. Blocks of at most 32 tiles took 0.98x and 0.97x the time of at most 24 at 192 and 1,024
 * rows, and 48 took 1.05x the time of 32 at 1,024 rows. */
#ifndef MC_TILES
#define MC_TILES 32
#endif

typedef struct {
    const float *xp;   /* input copy: [tiles][Kp][MR] */
    const float *w;    /* [N / 32][Kp][32] */
    const float *bias; /* [N] or NULL */
    const float *add;  /* [M][ld_add] or NULL */
    int64_t ld_add;
    float *c;          /* partial sums and plain results: [M][ldc] */
    int64_t ldc;
    float *act;        /* SwiGLU output [M][ld_act] (c then holds gate and up) or NULL */
    int64_t ld_act;
    int64_t M, N, Kp;
} args_t;

/* c[m0.., n0..n0+16) (+)= xp tile . w half panel over k in [k0, k1); first: overwrite. */
static void micro(const args_t *a, int64_t tile, int64_t half, int64_t k0, int64_t k1, int first, int rows,
                  const float *ahead, int64_t ahead_lines) {
    /* This tile's share of the next weight block, into L2 (see run_block). */
    for (int64_t i = 0; i < ahead_lines; i++) __builtin_prefetch(ahead + i * PANEL_COLS, 0, 2);
    const float *x = a->xp + tile * a->Kp * MR + k0 * MR;
    const float *w = a->w + (half * NR / PANEL_COLS) * a->Kp * PANEL_COLS + k0 * PANEL_COLS + (half * NR % PANEL_COLS);
    float *c = a->c + tile * MR * a->ldc + half * NR;
#ifdef PANEL_GEMM_VECTOR
    /* The output tile's lines, needed after the k loop (a row-major output puts its rows ~N * 4
     * bytes apart, a pattern the hardware prefetchers miss: they were the kernel's top stall). */
    for (int m = 0; m < rows; m++) __builtin_prefetch(c + m * a->ldc, 1, 3);
    /* Twelve named accumulators: with an array GCC kept a memory copy, stored on every k. ROW(m)
     * multiplies row m's x[k] into its pair; KEEP(m) puts the pair in the row's sums. */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define ROW(m)                                                  \
    do {                                                        \
        const __m256 xv = _mm256_broadcast_ss(x + m);           \
        c##m##0 = _mm256_fmadd_ps(w0, xv, c##m##0);             \
        c##m##1 = _mm256_fmadd_ps(w1, xv, c##m##1);             \
    } while (0)
    for (int64_t k = k0; k < k1; k++, x += MR, w += PANEL_COLS) {
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
        ROW(4);
        ROW(5);
    }
#undef ROW
    float sums[MR][NR] __attribute__((aligned(32)));
#define KEEP(m)                                   \
    do {                                          \
        _mm256_store_ps(sums[m], c##m##0);        \
        _mm256_store_ps(sums[m] + 8, c##m##1);    \
    } while (0)
    KEEP(0);
    KEEP(1);
    KEEP(2);
    KEEP(3);
    KEEP(4);
    KEEP(5);
#undef KEEP
    for (int m = 0; m < rows; m++) {
        float *row = c + m * a->ldc;
        for (int v = 0; v < NR; v += 8) {
            __m256 s = _mm256_load_ps(sums[m] + v);
            if (!first) s = _mm256_add_ps(s, _mm256_loadu_ps(row + v));
            _mm256_storeu_ps(row + v, s);
        }
    }
#else
    for (int m = 0; m < rows; m++) {
        for (int n = 0; n < NR; n++) {
            float s = first ? 0.0f : c[m * a->ldc + n];
            for (int64_t k = k0; k < k1; k++) s += x[(k - k0) * MR + m] * w[(k - k0) * PANEL_COLS + n];
            c[m * a->ldc + n] = s;
        }
    }
#endif
}

/* The input copy: tiles of MR rows, k-major, zero-padded (rows past M, k past K). */
static void pack_input(const float *x, int64_t ldx, float *xp, int64_t M, int64_t K, int64_t Kp, int64_t t0,
                       int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        float *dst = xp + t * Kp * MR;
        for (int m = 0; m < MR; m++) {
            const int64_t row = t * MR + m;
            if (row >= M) {
                for (int64_t k = 0; k < Kp; k++) dst[k * MR + m] = 0.0f;
                continue;
            }
            const float *src = x + row * ldx;
            for (int64_t k = 0; k < K; k++) dst[k * MR + m] = src[k];
            for (int64_t k = K; k < Kp; k++) dst[k * MR + m] = 0.0f;
        }
    }
}

/* Bias, add or SwiGLU on rows [r0, r1) of the half panels [h0, h1), after their last K block. */
static void finish(const args_t *a, int64_t r0, int64_t r1, int64_t h0, int64_t h1) {
    for (int64_t m = r0; m < r1; m++) {
        float *row = a->c + m * a->ldc;
        if (a->act) {
            /* Bias first, then SiLU and the product in a loop of its own: a branch in the loop kept
             * GCC from vectorising it (a scalar SiLU cost as much as the gate and up GEMM at 128 rows). */
            const int64_t half_n = a->N / 2, n0 = h0 * NR, n1 = h1 * NR;
            float *gate = row, *up = row + half_n, *out = a->act + m * a->ld_act;
            if (a->bias) {
                for (int64_t n = n0; n < n1; n++) gate[n] += a->bias[n];
                for (int64_t n = n0; n < n1; n++) up[n] += a->bias[half_n + n];
            }
            for (int64_t n = n0; n < n1; n++) out[n] = silu(gate[n]) * up[n];
            continue;
        }
        const int64_t n1 = h1 * NR < a->N ? h1 * NR : a->N;
        if (a->bias)
            for (int64_t n = h0 * NR; n < n1; n++) row[n] += a->bias[n];
        if (a->add)
            for (int64_t n = h0 * NR; n < n1; n++) row[n] += a->add[m * a->ld_add + n];
    }
}

/* Rows [tb * MR, te * MR) (tiles tb..te) times half panels [h0, h1) (and, for SwiGLU, their up
 * partners N / 32 halves on), all of K, then the finish. */
static void run_block(const args_t *a, int64_t tb, int64_t te, int64_t h0, int64_t h1) {
    const int64_t up = a->act ? a->N / 2 / NR : 0;
    for (int64_t k0 = 0; k0 < a->Kp; k0 += KC) {
        const int64_t k1 = k0 + KC < a->Kp ? k0 + KC : a->Kp;
        for (int pass = 0; pass < (a->act ? 2 : 1); pass++) {
            for (int64_t h = h0; h < h1; h++) {
                /* The weight block after this one, fetched into L2 a share per tile while this one
                 * computes: the k rows of a half panel are 128 bytes apart, a stride the
                 * prefetchers followed too late when the weights came from memory. */
                int64_t nh = h + 1, nk = k0, np = pass;
                if (nh == h1) {
                    nh = h0;
                    if (a->act && pass == 0) {
                        np = 1;
                    } else {
                        np = 0;
                        nk = k1 < a->Kp ? k1 : 0;
                    }
                }
                const float *next = a->w + ((nh + np * up) * NR / PANEL_COLS) * a->Kp * PANEL_COLS +
                                    nk * PANEL_COLS + ((nh + np * up) * NR % PANEL_COLS);
                const int64_t lines = nk + KC < a->Kp ? KC : a->Kp - nk;
                const int64_t share = (lines + (te - tb) - 1) / (te - tb);
                for (int64_t t = tb; t < te; t++) {
                    const int rows = (int)(a->M - t * MR < MR ? a->M - t * MR : MR);
                    const int64_t first = (t - tb) * share;
                    const int64_t count = first >= lines ? 0 : (lines - first < share ? lines - first : share);
                    micro(a, t, h + pass * up, k0, k1, k0 == 0, rows, next + first * PANEL_COLS, count);
                }
            }
        }
    }
    finish(a, tb * MR, te * MR < a->M ? te * MR : a->M, h0, h1);
}

/* The call's blocks, row block by row block, each cut into chunks of CHUNK_HALVES half panels
 * that the threads take as they come (an atomic counter): on a shared 2-vCPU host a static split
 * left one thread waiting whenever the other lost time to the hypervisor. */
#ifndef CHUNK_HALVES
#define CHUNK_HALVES 4
#endif
static void run_shared(const args_t *a, int64_t halves, int64_t *counter) {
    const int64_t tiles = (a->M + MR - 1) / MR, chunks = (halves + CHUNK_HALVES - 1) / CHUNK_HALVES;
    /* Row blocks of equal size, at most MC_TILES tiles each (a 128-row prompt is one block of 22). */
    const int64_t blocks = (tiles + MC_TILES - 1) / MC_TILES, mc = (tiles + blocks - 1) / blocks;
    const int64_t units = (tiles + mc - 1) / mc * chunks;
    for (int64_t u = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); u < units;
         u = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED)) {
        const int64_t tb = u / chunks * mc, h0 = u % chunks * CHUNK_HALVES;
        run_block(a, tb, tb + mc < tiles ? tb + mc : tiles, h0,
                  h0 + CHUNK_HALVES < halves ? h0 + CHUNK_HALVES : halves);
    }
}

/* The input copy's and the SwiGLU sums' buffers, kept between calls and grown as needed (one set
 * per calling thread): a fresh multi-megabyte allocation is a fresh mapping whose first writes
 * page-fault, which cost more than the copy itself. A buffer past KEEP_BYTES (a long prompt's
 * chunk on a wide model) is freed after its call instead: there the faults are a small share of
 * the call, and a process should not hold that much for the rare step that needed it. */
#ifndef KEEP_BYTES
#define KEEP_BYTES ((size_t)64 << 20)
#endif
static __thread float *copy_buffer, *sums_buffer;
static __thread size_t copy_floats, sums_floats;

static void release_if_large(float **buffer, size_t *have) {
    if (*have * sizeof(float) > KEEP_BYTES) {
        free(*buffer);
        *buffer = NULL;
        *have = 0;
    }
}

static float *grown(float **buffer, size_t *have, size_t floats) {
    if (floats > *have) {
        free(*buffer);
        *have = 0;
        *buffer = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (*buffer) *have = floats;
    }
    return *buffer;
}

/* x [M][ldx] (K of its columns), w: N / 32 panels of Kp >= K rows (zeros past K); y [M][ldy] gets
 * x w^T (+ bias) (+ add) when act is NULL; otherwise act [M][ld_act] gets silu(gate) * up of the
 * merged weight's two halves (N / 2 columns). Returns 0, 1 for sizes it does not take, 2 when
 * memory ran out. */
static int panel_gemm_any(const float *x, int64_t ldx, const float *w, const float *bias, const float *add,
                          int64_t ld_add, float *y, int64_t ldy, float *act, int64_t ld_act, int64_t M, int64_t N,
                          int64_t K, int64_t Kp, int threads) {
    if (M <= 0 || N <= 0 || N % NR || K <= 0 || Kp < K || (act && (N % (2 * NR)))) return 1;
    const int64_t tiles = (M + MR - 1) / MR;
    float *xp = grown(&copy_buffer, &copy_floats, (size_t)(tiles * Kp * MR));
    if (act) {
        y = grown(&sums_buffer, &sums_floats, (size_t)(M * N));
        ldy = N;
    }
    if (!xp || !y) return 2;
    args_t a = {xp, w, bias, add, ld_add, y, ldy, act, ld_act, M, N, Kp};
    /* SwiGLU threads take gate half panels, each with its up partner. */
    const int64_t halves = act ? N / 2 / NR : N / NR;
    if (threads < 1) threads = 1;
    if (threads > halves) threads = (int)halves;
    int64_t counter = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        pack_input(x, ldx, xp, M, K, Kp, tiles * id / nt, tiles * (id + 1) / nt);
#pragma omp barrier
        run_shared(&a, halves, &counter);
    }
#else
    pack_input(x, ldx, xp, M, K, Kp, 0, tiles);
    run_shared(&a, halves, &counter);
#endif
    release_if_large(&copy_buffer, &copy_floats);
    release_if_large(&sums_buffer, &sums_floats);
    return 0;
}

/* Bytes this thread's buffers hold between calls (tests check that large calls give theirs back). */
int64_t panel_gemm_held_bytes(void) { return (int64_t)((copy_floats + sums_floats) * sizeof(float)); }

int panel_gemm(const float *x, int64_t ldx, const float *w, const float *bias, const float *add, int64_t ld_add,
               float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t Kp, int threads) {
    return panel_gemm_any(x, ldx, w, bias, add, ld_add, y, ldy, NULL, 0, M, N, K, Kp, threads);
}

int panel_gemm_swiglu(const float *x, int64_t ldx, const float *w, const float *bias, float *act, int64_t ld_act,
                      int64_t M, int64_t N, int64_t K, int64_t Kp, int threads) {
    return panel_gemm_any(x, ldx, w, bias, NULL, 0, NULL, 0, act, ld_act, M, N, K, Kp, threads);
}

/* 1 when this build has the AVX2 micro-kernel (else a scalar fallback that only tests use). */
int panel_gemm_vector(void) {
#ifdef PANEL_GEMM_VECTOR
    return 1;
#else
    return 0;
#endif
}
