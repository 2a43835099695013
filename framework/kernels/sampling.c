/*
 * Drawing one token per row on CPU: from a row of (unnormalised) probabilities by inverse CDF, and
 * the greedy argmax.
 *
 * Why: the sampler drew a token by the exponential race (argmax of p / E with E ~ Exp(1), one draw
 * per vocabulary entry). torch's CPU exponential_ costs ~18 ns a draw, so a 64-row step of a
 * 32,000-token vocabulary spent ~37 ms on noise alone (about a third of the step); one row 0.6 ms.
 * Inverse CDF needs one uniform per row and two passes over the row: ~0.1 ms for 64 rows. torch's
 * argmax over rows (1.6 ms for 64 x 32,000) does not vectorise its reduction either.
 *
 * Inverse CDF: the row's cumulative sum runs in double, in blocks: pass 1 sums each block of
 * BLOCK entries (8 interleaved partial sums, so the compiler vectorises it) and the row's total
 * from the block sums in order; target = u * total with u in [0, 1). Pass 2 walks the block sums,
 * then the entries of the block that crosses the target one by one, and picks the first entry at
 * which the running sum exceeds the target. An entry of probability 0 never raises the running
 * sum, so it is never picked. Rounding (the block sums are summed in another order than the
 * entries) can leave the running sum at or under the target at a block's end: the walk then goes
 * on into the next blocks entry by entry, and past the last entry it takes the last entry whose
 * probability is above 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 64
#define PARTS 8

/* Sum of p[0..n) in double, 8 interleaved partial sums (n <= BLOCK). */
static double block_sum(const float *p, int64_t n) {
    double part[PARTS] = {0};
    int64_t i = 0;
    for (; i + PARTS <= n; i += PARTS)
        for (int l = 0; l < PARTS; ++l) part[l] += (double)p[i + l];
    double s = 0.0;
    for (; i < n; ++i) s += (double)p[i];
    for (int l = 0; l < PARTS; ++l) s += part[l];
    return s;
}

static int64_t last_positive(const float *p, int64_t vocab) {
    for (int64_t i = vocab - 1; i >= 0; --i)
        if (p[i] > 0.0f) return i;
    return 0;
}

static int64_t sample_row(const float *p, int64_t vocab, double u, double *sums) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * BLOCK;
        sums[b] = block_sum(p + start, vocab - start < BLOCK ? vocab - start : BLOCK);
        total += sums[b];
    }
    if (!(total > 0.0)) return last_positive(p, vocab); /* nothing positive, or NaN: no distribution */
    const double target = u * total;
    double acc = 0.0;
    int64_t b = 0;
    while (b < blocks && acc + sums[b] <= target) acc += sums[b++];
    for (int64_t i = b * BLOCK; i < vocab; ++i) {
        acc += (double)p[i];
        if (acc > target) return i;
    }
    return last_positive(p, vocab);
}

/* Row r of the [rows, vocab] float probabilities at probs + r * stride (>= 0, any scale) gives
 * out[r]: the first index whose cumulative probability exceeds uniforms[r] * the row's total.
 * Returns 0, or -1 when memory for the block sums ran out. */
int sample_rows_f32(const float *probs, int64_t stride, int64_t rows, int64_t vocab, const double *uniforms,
                    int64_t *out, int threads) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 1) reduction(| : failed)
    {
        double *sums = malloc((size_t)(blocks > 0 ? blocks : 1) * sizeof(double));
        if (sums == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(probs + r * stride, vocab, uniforms[r], sums);
        }
        free(sums);
    }
    return failed ? -1 : 0;
}

/* 16 floats and 16 int lanes in GCC's vector extension: AVX-512 or two AVX2 registers, whatever
 * -march offers (written with masks because plain loops of float selects did not vectorise). */
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));

/* Whether any lane of the i32x16 mask m is set (a macro: GCC notes an ABI change for passing
 * 64-byte vectors to functions on AVX2-only targets). */
#define ANY_LANE(m, result)                                     \
    do {                                                        \
        int32_t any_ = 0;                                       \
        for (int l_ = 0; l_ < 16; ++l_) any_ |= (m)[l_];        \
        (result) = any_ != 0;                                   \
    } while (0)

/* The first index of the row's largest value; a NaN counts as larger than any number (the first
 * NaN wins), as torch.argmax decides. */
static int64_t argmax_row(const float *x, int64_t n) {
    f32x16 best16 = {0};
    i32x16 nan16 = {0};
    int64_t i = 0;
    for (int l = 0; l < 16; ++l) best16[l] = -INFINITY;
    for (; i + 16 <= n; i += 16) {
        const f32x16 v = *(const f32x16 *)(x + i);
        const i32x16 gt = v > best16; /* false for a NaN: the maximum skips NaNs, flagged apart */
        best16 = (f32x16)(((i32x16)v & gt) | ((i32x16)best16 & ~gt));
        nan16 |= v != v;
    }
    float best = -INFINITY;
    int any_nan;
    ANY_LANE(nan16, any_nan);
    for (int l = 0; l < 16; ++l) best = best16[l] > best ? best16[l] : best;
    for (; i < n; ++i) {
        any_nan |= x[i] != x[i];
        best = x[i] > best ? x[i] : best;
    }
    /* The first lane equal to the maximum (or the first NaN), 16 at a time. */
    f32x16 b16;
    for (int l = 0; l < 16; ++l) b16[l] = best;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const f32x16 v = *(const f32x16 *)(x + j);
        const i32x16 hit = any_nan ? v != v : v == b16;
        int found;
        ANY_LANE(hit, found);
        if (found) break;
    }
    for (; j < n; ++j)
        if (any_nan ? x[j] != x[j] : x[j] == best) return j;
    return 0; /* n == 0 */
}

/* out[r] = argmax of row r of the [rows, n] floats at x + r * stride. */
void argmax_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, n);
}
