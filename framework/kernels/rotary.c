/*
 * Rotary position embedding for q and k in one pass, writing q, k and v out contiguous.
 *
 * Why: the torch form of RoPE (x * cos + rotate_half(x) * sin, for q and for k, then a copy of each
 * of q, k, v out of the merged qkv GEMM output) is ~13 small ops per layer; on CPU those measured
 * ~3.5% of a batch-64 decode step and more at batch 1. Here they are one call.
 *
 * Numerics are transformers' exactly: for i < rot/2 out = x[i]*c[i] + (-x[i+rot/2])*s[i], for
 * rot/2 <= i < rot out = x[i]*c[i] + x[i-rot/2]*s[i], each product and the sum rounded to float
 * (built with -ffp-contract=off, so no fused multiply-add), dims past rot copied unchanged. In bf16
 * (rotary_qkv_bf16) each of the three operations rounds to bf16 as torch's bf16 ops do: computed in
 * float (a product of two bf16 values is exact there) and rounded to nearest even.
 *
 * Layout: token t's heads are row t of q / k / v (row strides given, elements contiguous); cos and
 * sin are [n, rot] (row stride given) with the two halves duplicated, as RotaryEmbedding makes them.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_float.h"

static inline void rotate_heads(const float *x, float *out, int64_t heads, int64_t d, int64_t rot,
                                const float *c, const float *s) {
    const int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const float *xh = x + h * d;
        float *oh = out + h * d;
        for (int64_t i = 0; i < half; ++i) {
            const float a = xh[i] * c[i], b = -xh[i + half] * s[i];
            oh[i] = a + b;
        }
        for (int64_t i = half; i < rot; ++i) {
            const float a = xh[i] * c[i], b = xh[i - half] * s[i];
            oh[i] = a + b;
        }
        if (rot < d) memcpy(oh + rot, xh + rot, sizeof(float) * (size_t)(d - rot));
    }
}

/* v may be NULL (then v_out is not written). Returns 0, or 1 when rot is odd or larger than d. */
int rotary_qkv_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const float *cos, const float *sin, int64_t cs_stride, float *q_out,
                   float *k_out, float *v_out, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t rot,
                   int64_t num_threads) {
    if (rot % 2 || rot > d || rot < 0) return 1;
    const int64_t qw = q_heads * d, kw = kv_heads * d;
    /* Parallel only when there are enough tokens to pay for the fork/join (prefill chunks). */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 32 && num_threads > 1)
    for (int64_t t = 0; t < n; ++t) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        rotate_heads(q + t * q_stride, q_out + t * qw, q_heads, d, rot, c, s);
        rotate_heads(k + t * k_stride, k_out + t * kw, kv_heads, d, rot, c, s);
        if (v) memcpy(v_out + t * kw, v + t * v_stride, sizeof(float) * (size_t)kw);
    }
    return 0;
}

/* The bf16 form of rotate_heads: every product and the sum rounded to bf16, as three torch ops. */
static inline void rotate_heads_bf16(const uint16_t *x, uint16_t *out, int64_t heads, int64_t d, int64_t rot,
                                     const uint16_t *c, const uint16_t *s) {
    const int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const uint16_t *xh = x + h * d;
        uint16_t *oh = out + h * d;
        for (int64_t i = 0; i < rot; ++i) {
            const float other = i < half ? -bf16_to_float(xh[i + half]) : bf16_to_float(xh[i - half]);
            const float a = bf16_to_float(float_to_bf16(bf16_to_float(xh[i]) * bf16_to_float(c[i])));
            const float b = bf16_to_float(float_to_bf16(other * bf16_to_float(s[i])));
            oh[i] = float_to_bf16(a + b);
        }
        if (rot < d) memcpy(oh + rot, xh + rot, sizeof(uint16_t) * (size_t)(d - rot));
    }
}

/* rotary_qkv_f32 for bf16 q, k, v, cos and sin (uint16_t bits). */
int rotary_qkv_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, uint16_t *q_out,
                    uint16_t *k_out, uint16_t *v_out, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t d,
                    int64_t rot, int64_t num_threads) {
    if (rot % 2 || rot > d || rot < 0) return 1;
    const int64_t qw = q_heads * d, kw = kv_heads * d;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 32 && num_threads > 1)
    for (int64_t t = 0; t < n; ++t) {
        const uint16_t *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        rotate_heads_bf16(q + t * q_stride, q_out + t * qw, q_heads, d, rot, c, s);
        rotate_heads_bf16(k + t * k_stride, k_out + t * kw, kv_heads, d, rot, c, s);
        if (v) memcpy(v_out + t * kw, v + t * v_stride, sizeof(uint16_t) * (size_t)kw);
    }
    return 0;
}
