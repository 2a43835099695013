/*
 * RMSNorm of fp32 rows on CPU in one pass per row: out = w * (x * (1 / sqrt(mean(x^2) + eps))).
 *
 * Why: the torch form (pow, mean, add, rsqrt, two multiplies) is seven ops and four temporaries
 * per norm; with two norms per layer they measured ~3% of the reference workload on CPU, mostly
 * allocation and per-op overhead at decode sizes.
 *
 * Numerics follow transformers' LlamaRMSNorm except for the order of the sum of squares: each
 * square, the division by d, the inverse square root (1 / sqrt, as torch's rsqrt computes it), x * r
 * and w * (x * r) are each rounded to float (built with -ffp-contract=off); the squares are summed
 * in 16 interleaved partial sums, so the mean can differ from torch's by float rounding.
 *
 * bf16 rows (rmsnorm_bf16) take the same float path and round where transformers does: x * r to
 * bf16, then w * that (a bf16 product, computed in float and rounded to bf16), round-to-nearest-even.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_float.h"

#define LANES 16
/* Elements from which a call uses the threads: at decode sizes (llama-120m: up to 32 rows of 768)
 * the fork/join costs more than the work; a 128-token prefill's 25 norms (128 x 768) run ~40 us
 * faster each on 2 threads (in process, alternating: the prefill 121.3-122.3 vs 123.2-123.3 ms
 * with the former 1 << 17). */
#ifndef PARALLEL_MIN_ELEMS
#define PARALLEL_MIN_ELEMS (1 << 15)
#endif

/* 1 / sqrt(mean(x^2) + eps) of one row; X(i) reads element i as a float. */
#define INV_RMS(X, d, eps, result)                                  \
    do {                                                            \
        float part[LANES] = {0}, sum = 0.0f;                        \
        int64_t i = 0;                                              \
        for (; i + LANES <= (d); i += LANES)                        \
            for (int64_t l = 0; l < LANES; ++l) {                   \
                const float v = X(i + l), sq = v * v;               \
                part[l] += sq;                                      \
            }                                                       \
        for (; i < (d); ++i) {                                      \
            const float v = X(i), sq = v * v;                       \
            sum += sq;                                              \
        }                                                           \
        for (int64_t l = 0; l < LANES; ++l) sum += part[l];         \
        (result) = 1.0f / sqrtf(sum / (float)(d) + (eps));          \
    } while (0)

#ifdef __AVX512F__
/* The row in 16-lane vectors: lane l holds INV_RMS's part[l] and accumulates it in the same order,
 * the tail and the lanes are summed as there, and each product rounds as in the scalar loops, so
 * rows come out bitwise equal to them. Why: GCC's 256-bit code for those loops (the bf16 rounding
 * per element) took 0.38 ms for a 1728 x 768 bf16 norm on the Sapphire Rapids host, 25 of them in a
 * mixed step of llama-120m. */
static inline __attribute__((always_inline)) void norm_row16(const void *x, const void *w, void *out, int64_t d,
                                                             float eps, int bf16) {
    const int64_t whole = d - d % LANES;
#define LOAD16(p, i) (bf16 ? load_bf16((const uint16_t *)(p) + (i)) : _mm512_loadu_ps((const float *)(p) + (i)))
#define ELEM(p, i) (bf16 ? bf16_to_float(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < whole; i += LANES) {
        const __m512 v = LOAD16(x, i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    float part[LANES], sum = 0.0f;
    _mm512_storeu_ps(part, acc);
    for (int64_t i = whole; i < d; ++i) {
        const float v = ELEM(x, i), sq = v * v;
        sum += sq;
    }
    for (int64_t l = 0; l < LANES; ++l) sum += part[l];
    const float r = 1.0f / sqrtf(sum / (float)d + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t j = 0; j < whole; j += LANES) {
        if (bf16) {
            const __m512 h = round_bf16_16(_mm512_mul_ps(LOAD16(x, j), rv));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + j), bf16_bits16(_mm512_mul_ps(LOAD16(w, j), h)));
        } else {
            _mm512_storeu_ps((float *)out + j, _mm512_mul_ps(LOAD16(w, j), _mm512_mul_ps(LOAD16(x, j), rv)));
        }
    }
    for (int64_t j = whole; j < d; ++j) {
        if (bf16) {
            const float h = bf16_to_float(float_to_bf16(ELEM(x, j) * r));
            ((uint16_t *)out)[j] = float_to_bf16(ELEM(w, j) * h);
        } else {
            ((float *)out)[j] = ELEM(w, j) * (ELEM(x, j) * r);
        }
    }
#undef LOAD16
#undef ELEM
}
#endif

static void norm_row(const float *x, const float *w, float *out, int64_t d, float eps) {
#ifdef __AVX512F__
    norm_row16(x, w, out, d, eps, 0);
#else
    float r;
#define X_F32(i) x[i]
    INV_RMS(X_F32, d, eps, r);
    for (int64_t j = 0; j < d; ++j) {
        const float h = x[j] * r;
        out[j] = w[j] * h;
    }
#endif
}

static void norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t d, float eps) {
#ifdef __AVX512F__
    norm_row16(x, w, out, d, eps, 1);
#else
    float r;
#define X_BF16(i) bf16_to_float(x[i])
    INV_RMS(X_BF16, d, eps, r);
    for (int64_t j = 0; j < d; ++j) {
        const float h = bf16_to_float(float_to_bf16(bf16_to_float(x[j]) * r));
        out[j] = float_to_bf16(bf16_to_float(w[j]) * h);
    }
#endif
}

/* x: n rows of d floats, row stride x_stride; out: n x d contiguous. Returns 0. */
int rmsnorm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t n, int64_t d, float eps,
                int64_t num_threads) {
    /* Parallel only for prefill-sized inputs: at decode sizes the fork/join costs more than the work. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * d >= PARALLEL_MIN_ELEMS && num_threads > 1)
    for (int64_t t = 0; t < n; ++t) norm_row(x + t * x_stride, w, out + t * d, d, eps);
    return 0;
}

/* The same over bf16 rows, weight and output (x row stride x_stride elements). Returns 0. */
int rmsnorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t n, int64_t d,
                 float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * d >= PARALLEL_MIN_ELEMS && num_threads > 1)
    for (int64_t t = 0; t < n; ++t) norm_row_bf16(x + t * x_stride, w, out + t * d, d, eps);
    return 0;
}
