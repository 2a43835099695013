/* Probe: can one core hide memory-bound streaming (a decode step's attention over its K/V) behind
 * compute-bound FMA tiles (its GEMMs) by interleaving the two? Not part of plugserve: a measurement
 * for docs/benchmarks.md ("can decode attention hide behind the GEMMs?").
 *
 *   gcc -O3 -march=native -fopenmp attention_gemm_overlap.c -o overlap && ./overlap 20480 3000
 *
 * Arguments: bytes of streaming per GEMM tile, tiles per thread. Two threads each time, per round:
 *   gemm      the tiles alone (8 rows x 48 columns x K 768, the panel in L2, A in L1)
 *   stream    the streaming alone (a 64-float dot product per row of a cold buffer)
 *   serial    tile, then its piece of streaming, alternating
 *   spread    the same, with the next piece's lines prefetched (into L2) from inside the tile's
 *             k loop, a few at a time
 *   burst     the same, with the next piece's lines all prefetched before the tile
 * Times are medians over 6 rounds. The buffer is filled with 0.5: a bit pattern that makes
 * denormal products would measure the slow path, not memory. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define K 768
#define ROUNDS 6

static void tile(const float *a, const float *b, float *c, const char *pf, size_t pf_bytes) {
    __m512 acc[8][3];
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 3; j++) acc[r][j] = _mm512_setzero_ps();
    const size_t lines = pf_bytes / 64, every = lines ? (K / lines ? K / lines : 1) : 0;
    size_t next = 0, countdown = every ? every : (size_t)-1;
    for (int k = 0; k < K; k++) {
        const __m512 b0 = _mm512_loadu_ps(b + k * 48), b1 = _mm512_loadu_ps(b + k * 48 + 16),
                     b2 = _mm512_loadu_ps(b + k * 48 + 32);
        for (int r = 0; r < 8; r++) {
            const __m512 x = _mm512_set1_ps(a[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
        }
        if (--countdown == 0) {
            countdown = every;
            if (next < lines) _mm_prefetch(pf + 64 * next++, _MM_HINT_T1);
        }
    }
    while (next < lines) _mm_prefetch(pf + 64 * next++, _MM_HINT_T1);
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 3; j++) _mm512_storeu_ps(c + r * 48 + j * 16, acc[r][j]);
}

static float stream(const float *rows, size_t bytes, const float *q) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
                 q3 = _mm512_loadu_ps(q + 48);
    for (size_t i = 0; i < bytes / 4; i += 64) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(rows + i), q0);
        s = _mm512_fmadd_ps(_mm512_loadu_ps(rows + i + 16), q1, s);
        s = _mm512_fmadd_ps(_mm512_loadu_ps(rows + i + 32), q2, s);
        s = _mm512_fmadd_ps(_mm512_loadu_ps(rows + i + 48), q3, s);
        acc = _mm512_add_ps(acc, s);
    }
    return _mm512_reduce_add_ps(acc);
}

static int by_value(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(double *v) {
    qsort(v, ROUNDS, sizeof *v, by_value);
    return (v[ROUNDS / 2 - 1] + v[ROUNDS / 2]) / 2;
}

int main(int argc, char **argv) {
    const size_t piece = argc > 1 ? (size_t)atol(argv[1]) : 20480;
    const int tiles = argc > 2 ? atoi(argv[2]) : 3000;
    const size_t size = (size_t)tiles * piece * 2 + (1 << 20);
    float *buffer = aligned_alloc(64, size), *q = aligned_alloc(64, 64 * sizeof(float));
    if (!buffer || !q) return 1;
    for (size_t i = 0; i < size / 4; i++) buffer[i] = 0.5f;
    for (int i = 0; i < 64; i++) q[i] = 1e-3f;
    enum { GEMM, STREAM, SERIAL, SPREAD, BURST, MODES };
    static const char *names[MODES] = {"gemm", "stream", "serial", "spread", "burst"};
    double times[MODES][ROUNDS];
    float sink = 0;
    for (int round = 0; round < ROUNDS; round++) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
        {
            const int me = omp_get_thread_num();
            float *a = aligned_alloc(64, 8 * K * 4), *b = aligned_alloc(64, K * 48 * 4), *c = aligned_alloc(64, 8 * 48 * 4);
            for (int i = 0; i < 8 * K; i++) a[i] = 1e-3f;
            for (int i = 0; i < K * 48; i++) b[i] = 1e-3f;
            const char *mine = (const char *)buffer + (size_t)me * tiles * piece;
            for (int mode = 0; mode < MODES; mode++) {
#pragma omp barrier
                const double t0 = omp_get_wtime();
                for (int i = 0; i < tiles; i++) {
                    const char *here = mine + (size_t)i * piece, *ahead = i + 1 < tiles ? here + piece : NULL;
                    if (mode == BURST && ahead)
                        for (size_t l = 0; l < piece; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T1);
                    if (mode != STREAM) tile(a, b, c, mode == SPREAD ? ahead : NULL, mode == SPREAD && ahead ? piece : 0);
                    if (mode != GEMM) sink += stream((const float *)here, piece, q);
                }
#pragma omp barrier
                if (me == 0) times[mode][round] = omp_get_wtime() - t0;
            }
            sink += c[5];
            free(a), free(b), free(c);
        }
    }
    printf("%zu bytes per tile, %d tiles per thread:", piece, tiles);
    for (int mode = 0; mode < MODES; mode++) printf("  %s %.2f ms", names[mode], median(times[mode]) * 1e3);
    const double flops = 2.0 * 8 * 48 * K * tiles * 2, bytes = (double)piece * tiles * 2;
    printf("\n  (gemm %.0f GFLOP/s, stream %.1f GB/s; checksum %g)\n", flops / median(times[GEMM]) / 1e9,
           bytes / median(times[STREAM]) / 1e9, sink);
    return 0;
}
