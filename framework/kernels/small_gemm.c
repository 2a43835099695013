/* Small-batch linear layers on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ add[m, n]),
 * for fp32 models and for bf16 ones.
 *
 * Why a kernel of our own: at a decode step's few rows a linear layer is a matrix-vector product
 * that reads every weight once, so it is bound by how fast the cores stream the weights. oneDNN's
 * GEMV streamed 3-6 GB/s per core on this project's 2-core hosts where a plain read streams 9-15,
 * which made single-stream decode 30-44% of the memory bound. Here each thread walks its own
 * contiguous slice of the weights front to back (what the hardware prefetcher follows best), a
 * block of rows at a time that stays in L1 while every input row is multiplied by it, so each
 * weight byte comes from DRAM once per call whatever the row count.
 *
 * Layout: the weights are a copy of the nn.Linear weight in panels of PANEL_ROWS rows: within a
 * panel, one cache line's worth of columns of row 0 (a piece: 16 fp32, 32 bf16), the same columns
 * of rows 1..7, then the next piece, so the one-row path reads one sequential stream instead of 8
 * row streams of K each (bf16 rows of 768 are only 24 cache lines): the llama-120m GEMVs went
 * from 21.4 to 26.9 GB/s in bf16 and from 27.6 to 30.6 in fp32 on the Zen 4 host. Rows and columns
 * are zero-padded to whole panels, and the input to whole pieces, so no block has a tail.
 * Accumulation is in fp32 lanes then summed across, so results differ from torch's GEMMs by fp32
 * rounding (~1e-6 relative).
 *
 * bf16 (small_gemm_bf16): weights, input, bias, add and output are bf16. Every product and sum is
 * fp32, as oneDNN's bf16 GEMM accumulates (AVX512-BF16's pair dot product where the CPU has it,
 * else each weight widened as it streams in: a shift, exact); only the output is rounded. Half the
 * bytes of fp32 per weight, and a GEMV is bound by bytes.
 *
 * Threads: OpenMP (torch's own runtime inside torch's process), output rows in chunks that the
 * threads take in turn.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_float.h"

#define PANEL_ROWS 8  /* weight rows per panel, and per block when x is one row: 8 accumulators + 1 input
                       * + 1 load register fit AVX2's 16 */
#define PANEL_K_F32 16   /* columns per panel piece: one 64-byte cache line of a row */
#define PANEL_K_BF16 32
#if defined(__AVX512F__)
#define ROWS_W 8      /* weight rows per block at several input rows: a whole panel, read in order */
#define ROWS_X 4      /* input rows per block: 8 x 4 accumulators, all 32 AVX-512 registers (the
                       * weights come as FMA memory operands). Fewer passes over each panel beat
                       * fitting the registers: against 8 x 3 blocks, 17.0 vs 20.0 ms at 4 rows (fp32,
                       * llama-120m's GEMVs, Zen 4 host, alternating), 15.8 vs 16.4 at 3, 9.3 vs 10.3 in
                       * bf16 at 4; 8 x 6 and 8 x 8 blocks were slower at 4-8 rows than 8 x 4. */
#else
#define ROWS_W 4      /* half a panel: 4 x 3 accumulators + loads fit AVX2's 16 registers */
#define ROWS_X 3      /* input rows per block */
#endif
#define CHUNK_ROWS 64 /* output rows per unit of work a thread takes (a multiple of PANEL_ROWS) */

typedef struct {
    const float *x;                /* M rows of Kp fp32, zero past K (a scratch copy of the input) */
    const uint16_t *xb;            /* the same as bf16 (bf16 only), for AVX512-BF16 */
    const void *w;                 /* the weight in panels (see PANEL_ROWS): float or uint16_t bf16 bits */
    const void *bias;              /* N, the weight's type, or NULL */
    const void *add; int64_t ld_add;  /* M rows of N, the weight's type, or NULL */
    void *y; int64_t ldy;          /* M rows of N, the weight's type */
    int64_t M, Kp;                 /* Kp: K rounded up to the panel piece (PANEL_K_F32 or _BF16) */
    int bf16;
    void *act; int64_t ld_act;     /* SwiGLU output (M rows of N / 2, the weight's type), or NULL: then y
                                    * is a scratch [gate; up] and act gets silu(gate) * up */
} gemm_args;

/* The epilogue every path shares: bias and the fused residual add, then the store. bf16 rounds the
 * linear's output before the add and the sum again after, as `residual + linear(x)` does in bf16. */
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
    ((uint16_t *)a->y)[m * a->ldy + n] = out;
}

/* Element offset of weight (n, k) in the panel layout. */
static inline int64_t panel_offset(const gemm_args *a, int64_t n, int64_t k) {
    const int64_t pk = a->bf16 ? PANEL_K_BF16 : PANEL_K_F32;
    return (n / PANEL_ROWS) * a->Kp * PANEL_ROWS + (k / pk) * (PANEL_ROWS * pk) + (n % PANEL_ROWS) * pk + k % pk;
}

#ifndef SMALL_GEMM_NO_VECTOR
#if defined(__AVX512F__) || defined(__AVX2__)
#define SMALL_GEMM_VECTOR 1
#endif
#endif

#ifndef SMALL_GEMM_VECTOR
/* Without AVX2: one output at a time, any block. */
static void block_scalar(const gemm_args *a, int64_t n0, int64_t nw, int64_t m0, int64_t mx) {
    for (int64_t i = 0; i < nw; i++) {
        for (int64_t j = 0; j < mx; j++) {
            const float *xr = a->x + (m0 + j) * a->Kp;
            float acc = 0.0f;
            for (int64_t k = 0; k < a->Kp; k++) {
                const int64_t at = panel_offset(a, n0 + i, k);
                acc += xr[k] * (a->bf16 ? bf16_to_float(((const uint16_t *)a->w)[at]) : ((const float *)a->w)[at]);
            }
            store(a, m0 + j, n0 + i, acc);
        }
    }
}
#endif

/* The vector blocks, once per weight type (small_gemm_blocks.h is a template on the macros below).
 * AVX-512: 16 fp32 lanes (half the instructions of AVX2 per weight byte), and with AVX512-BF16 a
 * dot product of bf16 pairs into fp32 lanes, 32 weights an instruction with no widening (widening
 * bf16 with shifts capped the AVX2 path at ~19 GB/s on the Zen 4 host, below the memory's rate).
 * W_*(a, p, i, k): weights of row i of the panel starting at element p, from column k. */
#define PANEL_AT(p, i, k, pk) ((p) + ((k) / (pk)) * (PANEL_ROWS * (pk)) + (i) * (pk) + (k) % (pk))
#define W_F32(a, p, i, k) ((const float *)(a)->w + PANEL_AT(p, i, k, PANEL_K_F32))
#define W_BF16(a, p, i, k) ((const uint16_t *)(a)->w + PANEL_AT(p, i, k, PANEL_K_BF16))
#define X_F32(a, m, k) ((a)->x + (m) * (a)->Kp + (k))
/* Software prefetch PREFETCH_BYTES ahead of the weight stream, into L2 (the T1 hint). The hardware
 * prefetchers alone left the stream short of the memory's rate: on the Zen 4 host, llama-120m's
 * one-row GEMV chain went from 23.5-25.2 to 26.8-30.8 GB/s in fp32 and from 20.9-21.2 to 25.0-25.4
 * in bf16 (same process, alternating), the several-row blocks ~10% at 2-4 rows. 4 KB ahead beat 2,
 * 8 and 16 KB; into L1 (T0) gained little. Near the end of a weight this asks for lines past it:
 * a prefetch never faults, and those lines are only fetched, never read. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define PREFETCH_LINE(ptr) _mm_prefetch((const char *)(ptr), _MM_HINT_T1)
/* The line LOAD_W(a, p, i, k) reads, for the weight type of the block being instantiated. */
#define PREFETCH_W(a, p, i, k) \
    PREFETCH_LINE(W_ELEM_BYTES == 4 ? (const void *)W_F32(a, p, i, k) : (const void *)W_BF16(a, p, i, k))
#if defined(SMALL_GEMM_VECTOR) && defined(__AVX512F__)
#define VEC __m512
#define XVEC __m512
#define WVEC __m512
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define LOAD_X(a, m, k) _mm512_loadu_ps(X_F32(a, m, k))
#define FMA(w, x, acc) _mm512_fmadd_ps(w, x, acc)
#define HSUM(v) _mm512_reduce_add_ps(v)
#define SUFFIX f32
#define LOAD_W(a, p, i, k) _mm512_loadu_ps(W_F32(a, p, i, k))
#define W_ELEM_BYTES 4
#include "small_gemm_blocks.h"
#undef SUFFIX
#undef LOAD_W
#undef W_ELEM_BYTES
#define W_ELEM_BYTES 2
#if defined(__AVX512BF16__)
#undef XVEC
#undef WVEC
#undef VLEN
#undef LOAD_X
#undef FMA
#define XVEC __m512bh
#define WVEC __m512bh
#define VLEN 32
#define LOAD_X(a, m, k) ((__m512bh)_mm512_loadu_si512((a)->xb + (m) * (a)->Kp + (k)))
#define LOAD_W(a, p, i, k) ((__m512bh)_mm512_loadu_si512(W_BF16(a, p, i, k)))
#define FMA(w, x, acc) _mm512_dpbf16_ps(acc, w, x)
#else
#define LOAD_W(a, p, i, k) _mm512_castsi512_ps( \
    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)W_BF16(a, p, i, k))), 16))
#endif
#define SUFFIX bf16
#include "small_gemm_blocks.h"
#elif defined(SMALL_GEMM_VECTOR)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VEC __m256
#define XVEC __m256
#define WVEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define LOAD_X(a, m, k) _mm256_loadu_ps(X_F32(a, m, k))
#define FMA(w, x, acc) _mm256_fmadd_ps(w, x, acc)
#define HSUM(v) hsum8(v)
#define SUFFIX f32
#define LOAD_W(a, p, i, k) _mm256_loadu_ps(W_F32(a, p, i, k))
#define W_ELEM_BYTES 4
#include "small_gemm_blocks.h"
#undef SUFFIX
#undef LOAD_W
#undef W_ELEM_BYTES
#define W_ELEM_BYTES 2
/* Eight bf16 weights widened to fp32: zero-extend to 32 bits, shift into the high half (exact). */
#define LOAD_W(a, p, i, k) _mm256_castsi256_ps( \
    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)W_BF16(a, p, i, k))), 16))
#define SUFFIX bf16
#include "small_gemm_blocks.h"
#endif

static void rows_range(const gemm_args *a, int64_t n_begin, int64_t n_end) {
#ifdef SMALL_GEMM_VECTOR
    if (a->M == 1) {
        for (int64_t n0 = n_begin; n0 < n_end; n0 += PANEL_ROWS) {
            int64_t nw = n_end - n0 < PANEL_ROWS ? n_end - n0 : PANEL_ROWS;
            if (a->bf16) block_row1_bf16(a, n0, nw); else block_row1_f32(a, n0, nw);
        }
        return;
    }
#endif
    for (int64_t n0 = n_begin; n0 < n_end; n0 += ROWS_W) {
        int64_t nw = n_end - n0 < ROWS_W ? n_end - n0 : ROWS_W;
        for (int64_t m0 = 0; m0 < a->M; m0 += ROWS_X) {
            int64_t mx = a->M - m0 < ROWS_X ? a->M - m0 : ROWS_X;
#ifdef SMALL_GEMM_VECTOR
            if (a->bf16) block_bf16(a, n0, nw, m0, mx); else block_f32(a, n0, nw, m0, mx);
#else
            block_scalar(a, n0, nw, m0, mx);
#endif
        }
    }
}

/* act[m, n] = silu(gate) * up for n in [n_begin, n_end), gate = y[m, n], up = y[m, half + n], as
 * torch's F.silu(gate) * up: silu is x / (1 + exp(-x)) in fp32 (libm's expf here, torch's own
 * vectorised exp there: the two differ in the last bit at most), and in bf16 silu and the product
 * are each rounded to bf16, as two bf16 torch ops round. */
static void swiglu_rows(const gemm_args *a, int64_t n_begin, int64_t n_end, int64_t half) {
    for (int64_t m = 0; m < a->M; m++) {
        for (int64_t n = n_begin; n < n_end; n++) {
            if (!a->bf16) {
                const float *y = (const float *)a->y + m * a->ldy;
                const float g = y[n];
                ((float *)a->act)[m * a->ld_act + n] = g / (1.0f + expf(-g)) * y[half + n];
                continue;
            }
            const uint16_t *y = (const uint16_t *)a->y + m * a->ldy;
            const float g = bf16_to_float(y[n]);
            const float silu = bf16_to_float(float_to_bf16(g / (1.0f + expf(-g))));
            ((uint16_t *)a->act)[m * a->ld_act + n] = float_to_bf16(silu * bf16_to_float(y[half + n]));
        }
    }
}

/* The rows [n_begin, n_end) of the output; with SwiGLU, of the gate, with the up rows that pair with
 * them and the SwiGLU of the pairs while they are in cache. */
static void unit_of_work(const gemm_args *a, int64_t n_begin, int64_t n_end, int64_t half) {
    rows_range(a, n_begin, n_end);
    if (!a->act) return;
    rows_range(a, half + n_begin, half + n_end);
    swiglu_rows(a, n_begin, n_end, half);
}

static int run(gemm_args *a, int64_t N, int threads) {
    /* With SwiGLU the work is split over the gate rows; each unit also does the matching up rows. */
    const int64_t half = a->act ? N / 2 : 0;
    if (a->act) N = half;
    if (threads < 1) threads = 1;
    /* Each thread at least 64 rows: below that, waking a thread costs more than it streams. */
    int64_t most = (N + 63) / 64;
    if (threads > most) threads = (int)most;
#ifdef _OPENMP
    /* Chunks handed out as threads come for them, not a fixed half each: on a server the HTTP
     * process and the client share these cores, and a thread the kernel deschedules mid-call would
     * otherwise leave its whole half for the others to wait on (a barrier at the end). Chunks of
     * CHUNK_ROWS rows stay long enough (>= 64 rows of K) for the prefetchers. */
    int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n_begin = c * CHUNK_ROWS, n_end = n_begin + CHUNK_ROWS < N ? n_begin + CHUNK_ROWS : N;
        unit_of_work(a, n_begin, n_end, half);
    }
#else
    (void)threads;
    unit_of_work(a, 0, N, half);
#endif
    return 0;
}

/* y = x w^T (+ bias) (+ add), fp32 (bf16 != 0: every tensor bf16, as uint16_t bits). x: M rows of K,
 * row stride ldx; w: [N, K] in panels (small_gemm.py's pack_weight: PANEL_ROWS rows by pieces of
 * PANEL_K_F32 / _BF16 columns, zero-padded); bias: N or NULL; add: M rows of N (stride ld_add) or NULL; y: M rows of N,
 * row stride ldy. With act non-NULL, w is a merged [gate; up] weight (N / 2 a multiple of
 * PANEL_ROWS, so the up rows start a panel), y is ignored (a scratch takes the GEMM) and act gets
 * M rows (stride ld_act) of silu(gate) * up. Returns 0, -1 for bad sizes, -2 when a scratch
 * buffer cannot be allocated. */
static int small_gemm_any(const void *x, int64_t ldx, const void *w, const void *bias, const void *add,
                          int64_t ld_add, void *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads, int bf16,
                          void *act, int64_t ld_act) {
    if (act && (add || N % (2 * PANEL_ROWS) || ld_act < N / 2)) return -1;
    if (act) ldy = N;
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldy < N || (add && ld_add < N)) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t pk = bf16 ? PANEL_K_BF16 : PANEL_K_F32, Kp = (K + pk - 1) / pk * pk;
    /* The input copied once, zero-padded to Kp (the weights' padding), so no block has a tail: M x
     * Kp floats (+ bf16), a few KB. */
    size_t floats = (size_t)(M * Kp > 0 ? M * Kp : 1);
    float *xf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    uint16_t *xb = bf16 ? aligned_alloc(64, (floats * sizeof(uint16_t) + 63) / 64 * 64) : NULL;
    void *scratch = act ? malloc((size_t)(M * N) * (bf16 ? sizeof(uint16_t) : sizeof(float))) : NULL;
    if (!xf || (bf16 && !xb) || (act && !scratch)) {
        free(xf);
        free(xb);
        free(scratch);
        return -2;
    }
    if (act) y = scratch;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < Kp; k++) {
            if (!bf16) {
                xf[m * Kp + k] = k < K ? ((const float *)x)[m * ldx + k] : 0.0f;
                continue;
            }
            const uint16_t h = k < K ? ((const uint16_t *)x)[m * ldx + k] : 0;
            xb[m * Kp + k] = h;
            xf[m * Kp + k] = bf16_to_float(h);
        }
    }
    gemm_args a = {xf, xb, w, bias, add, ld_add, y, ldy, M, Kp, bf16, act, ld_act};
    int rc = run(&a, N, threads);
    free(xf);
    free(xb);
    free(scratch);
    return rc;
}

int small_gemm(const float *x, int64_t ldx, const float *w, const float *bias, const float *add,
               int64_t ld_add, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return small_gemm_any(x, ldx, w, bias, add, ld_add, y, ldy, M, N, K, threads, 0, NULL, 0);
}

int small_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, const uint16_t *add,
                    int64_t ld_add, uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return small_gemm_any(x, ldx, w, bias, add, ld_add, y, ldy, M, N, K, threads, 1, NULL, 0);
}

/* act = silu(x w_gate^T + b_gate) * (x w_up^T + b_up) for a merged [gate; up] weight of N rows (fp32,
 * or every tensor bf16 when bf16 != 0): the MLP's first half in one call, SiLU and the product done
 * by the thread that computed each pair of rows. See small_gemm_any for the rest. */
int small_gemm_swiglu(const void *x, int64_t ldx, const void *w, const void *bias, void *act, int64_t ld_act,
                      int64_t M, int64_t N, int64_t K, int threads, int bf16) {
    return small_gemm_any(x, ldx, w, bias, NULL, 0, NULL, 0, M, N, K, threads, bf16 != 0, act, ld_act);
}

/* The most rows a call should bring (small_gemm.py routes larger calls to oneDNN), for fp32 or
 * (bf16 != 0) bf16 weights. On AVX2 the kernel beat oneDNN's GEMV up to 8 rows. On the Zen 4 host
 * (AVX-512, 8 x 4 blocks) it led in fp32 up to 4 rows (1.46 / 1.30 / 1.14x at 1 / 3 / 4) and
 * lost from 6 (0.81x), and in bf16 led up to 8 (1.66 / 1.47 / 1.09x at 1 / 4 / 8): bf16 streams
 * half the bytes for the same arithmetic as oneDNN's bf16 GEMM. Any row count computes correctly. */
int small_gemm_max_rows(int bf16) {
#if defined(__AVX512F__) && !defined(SMALL_GEMM_NO_VECTOR)
    return bf16 ? 8 : 4;
#else
    (void)bf16;
    return 8;
#endif
}

/* The panel geometry, for the Python side's packing (one source of truth). */
int small_gemm_panel_rows(void) { return PANEL_ROWS; }
int small_gemm_panel_k(int bf16) { return bf16 ? PANEL_K_BF16 : PANEL_K_F32; }
