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
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

static void norm_row(const float *x, const float *w, float *out, int64_t d, float eps) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) {
            const float sq = x[i + l] * x[i + l];
            part[l] += sq;
        }
    float sum = 0.0f;
    for (; i < d; ++i) {
        const float sq = x[i] * x[i];
        sum += sq;
    }
    for (int64_t l = 0; l < LANES; ++l) sum += part[l];
    const float r = 1.0f / sqrtf(sum / (float)d + eps);
    for (int64_t j = 0; j < d; ++j) {
        const float h = x[j] * r;
        out[j] = w[j] * h;
    }
}

/* x: n rows of d floats, row stride x_stride; out: n x d contiguous. Returns 0. */
int rmsnorm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t n, int64_t d, float eps,
                int64_t num_threads) {
    /* Parallel only for prefill-sized inputs: at decode sizes the fork/join costs more than the work. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * d >= (1 << 17) && num_threads > 1)
    for (int64_t t = 0; t < n; ++t) norm_row(x + t * x_stride, w, out + t * d, d, eps);
    return 0;
}
