/* Small-batch linear layers on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ add[m, n]).
 *
 * Why a kernel of our own: at a decode step's few rows a linear layer is a matrix-vector product
 * that reads every weight once, so it is bound by how fast the cores stream the weights. oneDNN's
 * GEMV streamed 3-6 GB/s per core on this project's 2-core hosts where a plain read streams 9-15,
 * which made single-stream decode 30-44% of the memory bound. Here each thread walks its own
 * contiguous slice of weight rows front to back (what the hardware prefetcher follows best), a
 * block of rows at a time that stays in L1 while every input row is multiplied by it, so each
 * weight byte comes from DRAM once per call whatever the row count.
 *
 * Layout: w is the nn.Linear weight as it is ([N, K] row-major, fp32): each output is a dot product
 * of two contiguous K-vectors. Accumulation is in fp32, 8 lanes wide then summed across, so results
 * differ from torch's GEMMs by fp32 rounding (~1e-6 relative).
 *
 * Threads: OpenMP (torch's own runtime inside torch's process), output rows in chunks that the
 * threads take in turn.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS_W 4   /* weight rows per block: 4 x K floats stay in L1 for K up to ~2000 */
#define ROWS_X 3   /* input rows per block: 4 x 3 accumulators + loads fit AVX2's 16 registers */
#define ROWS_W1 8  /* weight rows per block when x is one row: 8 streams in flight read ~10-15% faster
                    * than 4 on the AVX2 host (8 accumulators + 1 input + 1 load register) */
#define CHUNK_ROWS 64  /* output rows per unit of work a thread takes (a multiple of ROWS_W and ROWS_W1) */

typedef struct {
    const float *x; int64_t ldx;
    const float *w;
    const float *bias;
    const float *add; int64_t ld_add;
    float *y; int64_t ldy;
    int64_t M, K;
} gemm_args;

/* The epilogue every path shares: bias and the fused residual add, then the store. */
static inline void store(const gemm_args *a, int64_t m, int64_t n, float acc) {
    if (a->bias) acc += a->bias[n];
    if (a->add) acc += a->add[m * a->ld_add + n];
    a->y[m * a->ldy + n] = acc;
}

/* Any block shape, any K: the remainder path, and the whole kernel without AVX2. */
static void block_scalar(const gemm_args *a, int64_t n0, int64_t nw, int64_t m0, int64_t mx, int64_t k0) {
    for (int64_t i = 0; i < nw; i++) {
        for (int64_t j = 0; j < mx; j++) {
            const float *xr = a->x + (m0 + j) * a->ldx;
            float acc = 0.0f;
            for (int64_t k = k0; k < a->K; k++) acc += xr[k] * a->w[(n0 + i) * a->K + k];
            /* k0 > 0: the vector path stored its part already; add this tail onto it. */
            if (k0 > 0) a->y[(m0 + j) * a->ldy + n0 + i] += acc;
            else store(a, m0 + j, n0 + i, acc);
        }
    }
}

#ifdef __AVX2__
static inline __m256 load_w8(const gemm_args *a, int64_t n, int64_t k) {
    return _mm256_loadu_ps(a->w + n * a->K + k);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ROWS_W weight rows (nw of them real) times up to ROWS_X input rows over the K multiple of 8. */
static void block_avx2(const gemm_args *a, int64_t n0, int64_t nw, int64_t m0, int64_t mx) {
    const int64_t k8 = a->K & ~(int64_t)7;
    __m256 acc[ROWS_W][ROWS_X];
    for (int i = 0; i < ROWS_W; i++)
        for (int j = 0; j < ROWS_X; j++) acc[i][j] = _mm256_setzero_ps();
    /* Rows past nw/mx repeat the last real one: the loads stay in bounds, the results are dropped. */
    int64_t wn[ROWS_W];
    const float *xr[ROWS_X];
    for (int i = 0; i < ROWS_W; i++) wn[i] = n0 + (i < nw ? i : nw - 1);
    for (int j = 0; j < ROWS_X; j++) xr[j] = a->x + (m0 + (j < mx ? j : mx - 1)) * a->ldx;
    if (mx == 1) {  /* one input row in a block of several (M % ROWS_X == 1): no wasted FMAs */
        for (int64_t k = 0; k < k8; k += 8) {
            __m256 xv = _mm256_loadu_ps(xr[0] + k);
            for (int i = 0; i < ROWS_W; i++) acc[i][0] = _mm256_fmadd_ps(load_w8(a, wn[i], k), xv, acc[i][0]);
        }
    } else {
        for (int64_t k = 0; k < k8; k += 8) {
            __m256 xv[ROWS_X];
            for (int j = 0; j < ROWS_X; j++) xv[j] = _mm256_loadu_ps(xr[j] + k);
            for (int i = 0; i < ROWS_W; i++) {
                __m256 wv = load_w8(a, wn[i], k);
                for (int j = 0; j < ROWS_X; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < mx; j++) store(a, m0 + j, n0 + i, hsum8(acc[i][j]));
    if (k8 < a->K) block_scalar(a, n0, nw, m0, mx, k8);
}

/* M == 1 (single-stream decode): ROWS_W1 weight rows against the one input row. */
static void block_avx2_row1(const gemm_args *a, int64_t n0, int64_t nw) {
    const int64_t k8 = a->K & ~(int64_t)7;
    __m256 acc[ROWS_W1];
    int64_t wn[ROWS_W1];
    for (int i = 0; i < ROWS_W1; i++) {
        acc[i] = _mm256_setzero_ps();
        wn[i] = n0 + (i < nw ? i : nw - 1);
    }
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 xv = _mm256_loadu_ps(a->x + k);
        for (int i = 0; i < ROWS_W1; i++) acc[i] = _mm256_fmadd_ps(load_w8(a, wn[i], k), xv, acc[i]);
    }
    for (int i = 0; i < nw; i++) store(a, 0, n0 + i, hsum8(acc[i]));
    if (k8 < a->K) block_scalar(a, n0, nw, 0, 1, k8);
}
#endif

static void rows_range(const gemm_args *a, int64_t n_begin, int64_t n_end) {
#ifdef __AVX2__
    if (a->M == 1) {
        for (int64_t n0 = n_begin; n0 < n_end; n0 += ROWS_W1)
            block_avx2_row1(a, n0, n_end - n0 < ROWS_W1 ? n_end - n0 : ROWS_W1);
        return;
    }
#endif
    for (int64_t n0 = n_begin; n0 < n_end; n0 += ROWS_W) {
        int64_t nw = n_end - n0 < ROWS_W ? n_end - n0 : ROWS_W;
        for (int64_t m0 = 0; m0 < a->M; m0 += ROWS_X) {
            int64_t mx = a->M - m0 < ROWS_X ? a->M - m0 : ROWS_X;
#ifdef __AVX2__
            block_avx2(a, n0, nw, m0, mx);
#else
            block_scalar(a, n0, nw, m0, mx, 0);
#endif
        }
    }
}

/* y = x w^T (+ bias) (+ add). x: M rows of K fp32, row stride ldx; w: [N, K] contiguous fp32; bias: N fp32 or NULL; add: M rows of N fp32 (stride ld_add) or NULL;
 * y: M rows of N fp32, row stride ldy. Returns 0, or -1 for bad sizes. */
int small_gemm(const float *x, int64_t ldx, const float *w, const float *bias, const float *add,
               int64_t ld_add, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldy < N || (add && ld_add < N)) return -1;
    if (M == 0 || N == 0) return 0;
    gemm_args a = {x, ldx, w, bias, add, ld_add, y, ldy, M, K};
    if (K == 0) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) store(&a, m, n, 0.0f);
        return 0;
    }
    if (threads < 1) threads = 1;
    /* Each thread at least 64 rows: below that, waking a thread costs more than it streams. */
    int64_t most = (N + 63) / 64;
    if (threads > most) threads = (int)most;
#ifdef _OPENMP
    /* Chunks handed out as threads come for them, not a fixed half each: on a server the HTTP
     * process and the client share these cores, and a thread the kernel deschedules mid-call would
     * otherwise leave its whole half for the others to wait on (a barrier at the end). Chunks of
     * CHUNK_ROWS rows stay long enough (>= 64 rows of K floats) for the prefetchers. */
    int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n_begin = c * CHUNK_ROWS, n_end = n_begin + CHUNK_ROWS < N ? n_begin + CHUNK_ROWS : N;
        rows_range(&a, n_begin, n_end);
    }
#else
    (void)threads;
    rows_range(&a, 0, N);
#endif
    return 0;
}
