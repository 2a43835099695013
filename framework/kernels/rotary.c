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

/* Element i of x (fp32, or bf16 bits), as a float; and a float rounded as the type stores it. */
static inline float load_elem(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float rounded(float x, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(x)) : x; }

/* `heads` heads of d elements from x into out. In bf16 each product and the sum are rounded to bf16,
 * as three torch ops round (a product of two bf16 values is exact in float, so once). bf16 is a
 * literal at every call, so each type gets its own inlined loop. */
static inline __attribute__((always_inline)) void rotate_heads(const void *x, void *out, int64_t heads, int64_t d,
                                                               int64_t rot, const void *c, const void *s, int bf16) {
    const int64_t half = rot / 2, elem = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; ++h) {
        const char *xh = (const char *)x + h * d * elem;
        char *oh = (char *)out + h * d * elem;
        for (int64_t i = 0; i < rot; ++i) {
            const float other = i < half ? -load_elem(xh, i + half, bf16) : load_elem(xh, i - half, bf16);
            const float a = rounded(load_elem(xh, i, bf16) * load_elem(c, i, bf16), bf16);
            const float b = rounded(other * load_elem(s, i, bf16), bf16);
            if (bf16) ((uint16_t *)oh)[i] = float_to_bf16(a + b);
            else ((float *)oh)[i] = a + b;
        }
        if (rot < d) memcpy(oh + rot * elem, xh + rot * elem, (size_t)((d - rot) * elem));
    }
}

#ifdef __AVX512F__
/* One head's first rot elements, 16 pairs (i, i + half) at a time, with the scalar loop's operations
 * in its order (a product, a product, their sum; in bf16 each rounded). half % 16 == 0.
 *
 * Why: the scalar loop's branch on i < half and its per-element bf16 rounding left GCC 256-bit code
 * with versioning checks around every 64-element head; a 1728-row bf16 prefill chunk of llama-120m
 * spent 1.13 ms a layer here (~7% of a mixed step on the Sapphire Rapids host). */
static inline __attribute__((always_inline)) void rotate_head16(const void *x, void *out, int64_t half,
                                                                const void *c, const void *s, int bf16) {
    for (int64_t i = 0; i < half; i += 16) {
        __m512 x1, x2, c1, c2, s1, s2;
        if (bf16) {
            const uint16_t *xb = x, *cb = c, *sb = s;
            x1 = load_bf16(xb + i), x2 = load_bf16(xb + half + i);
            c1 = load_bf16(cb + i), c2 = load_bf16(cb + half + i), s1 = load_bf16(sb + i), s2 = load_bf16(sb + half + i);
        } else {
            const float *xf = x, *cf = c, *sf = s;
            x1 = _mm512_loadu_ps(xf + i), x2 = _mm512_loadu_ps(xf + half + i);
            c1 = _mm512_loadu_ps(cf + i), c2 = _mm512_loadu_ps(cf + half + i);
            s1 = _mm512_loadu_ps(sf + i), s2 = _mm512_loadu_ps(sf + half + i);
        }
        const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32((int)0x80000000)));
        __m512 a1 = _mm512_mul_ps(x1, c1), b1 = _mm512_mul_ps(neg_x2, s1);
        __m512 a2 = _mm512_mul_ps(x2, c2), b2 = _mm512_mul_ps(x1, s2);
        if (bf16) {
            a1 = round_bf16_16(a1), b1 = round_bf16_16(b1), a2 = round_bf16_16(a2), b2 = round_bf16_16(b2);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), bf16_bits16(_mm512_add_ps(a1, b1)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + half + i), bf16_bits16(_mm512_add_ps(a2, b2)));
        } else {
            _mm512_storeu_ps((float *)out + i, _mm512_add_ps(a1, b1));
            _mm512_storeu_ps((float *)out + half + i, _mm512_add_ps(a2, b2));
        }
    }
}
#endif

/* rotate_heads through rotate_head16 where the halves are whole vectors, else the scalar loop. */
static inline __attribute__((always_inline)) void rotate_all(const void *x, void *out, int64_t heads, int64_t d,
                                                             int64_t rot, const void *c, const void *s, int bf16) {
#ifdef __AVX512F__
    if ((rot / 2) % 16 == 0) {
        const int64_t elem = bf16 ? 2 : 4;
        for (int64_t h = 0; h < heads; ++h) {
            const char *xh = (const char *)x + h * d * elem;
            char *oh = (char *)out + h * d * elem;
            rotate_head16(xh, oh, rot / 2, c, s, bf16);
            if (rot < d) memcpy(oh + rot * elem, xh + rot * elem, (size_t)((d - rot) * elem));
        }
        return;
    }
#endif
    rotate_heads(x, out, heads, d, rot, c, s, bf16);
}

/* Token t of q, k, v (fp32, or bf16 bits when bf16 != 0): both rotated, v copied. Pointers are to
 * the first element; strides and widths in elements. */
static void rotary_token(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                         int64_t v_stride, const void *cos, const void *sin, int64_t cs_stride, void *q_out,
                         void *k_out, void *v_out, int64_t t, int64_t q_heads, int64_t kv_heads, int64_t d,
                         int64_t rot, int bf16) {
    const int64_t qw = q_heads * d, kw = kv_heads * d, e = bf16 ? 2 : 4;
    const char *c = (const char *)cos + t * cs_stride * e, *s = (const char *)sin + t * cs_stride * e;
    const char *qt = (const char *)q + t * q_stride * e, *kt = (const char *)k + t * k_stride * e;
    char *qo = (char *)q_out + t * qw * e, *ko = (char *)k_out + t * kw * e;
    if (bf16) {
        rotate_all(qt, qo, q_heads, d, rot, c, s, 1);
        rotate_all(kt, ko, kv_heads, d, rot, c, s, 1);
    } else {
        rotate_all(qt, qo, q_heads, d, rot, c, s, 0);
        rotate_all(kt, ko, kv_heads, d, rot, c, s, 0);
    }
    if (v) memcpy((char *)v_out + t * kw * e, (const char *)v + t * v_stride * e, (size_t)(kw * e));
}

static int rotary_qkv_any(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                          int64_t v_stride, const void *cos, const void *sin, int64_t cs_stride, void *q_out,
                          void *k_out, void *v_out, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t d,
                          int64_t rot, int64_t num_threads, int bf16) {
    if (rot % 2 || rot > d || rot < 0) return 1;
    /* Parallel only when there are enough tokens to pay for the fork/join (prefill chunks). */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 32 && num_threads > 1)
    for (int64_t t = 0; t < n; ++t)
        rotary_token(q, q_stride, k, k_stride, v, v_stride, cos, sin, cs_stride, q_out, k_out, v_out, t, q_heads,
                     kv_heads, d, rot, bf16);
    return 0;
}

/* v may be NULL (then v_out is not written). Returns 0, or 1 when rot is odd or larger than d. */
int rotary_qkv_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const float *cos, const float *sin, int64_t cs_stride, float *q_out,
                   float *k_out, float *v_out, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t rot,
                   int64_t num_threads) {
    return rotary_qkv_any(q, q_stride, k, k_stride, v, v_stride, cos, sin, cs_stride, q_out, k_out, v_out, n, q_heads,
                          kv_heads, d, rot, num_threads, 0);
}

/* rotary_qkv_f32 for bf16 q, k, v, cos and sin (uint16_t bits). */
int rotary_qkv_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, uint16_t *q_out,
                    uint16_t *k_out, uint16_t *v_out, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t d,
                    int64_t rot, int64_t num_threads) {
    return rotary_qkv_any(q, q_stride, k, k_stride, v, v_stride, cos, sin, cs_stride, q_out, k_out, v_out, n, q_heads,
                          kv_heads, d, rot, num_threads, 1);
}
