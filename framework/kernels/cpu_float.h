/*
 * Float helpers the CPU kernels share (included by framework/kernels/*.c and the attention
 * plugins' kernels; build.py puts this directory on the include path and hashes this header into
 * every build's cache key, so a change here rebuilds them all).
 */
#ifndef PLUGSERVE_CPU_FLOAT_H
#define PLUGSERVE_CPU_FLOAT_H

#include <stdint.h>
#include <string.h>

/* bfloat16 is the top half of a float32: widening is a shift, and exact. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch converts float to bfloat16 (NaN kept a quiet NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 bf16 values as fp32: bf16_to_float a vector at a time (a shift, exact). */
static inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m512 load_bf16(const uint16_t *p) { return widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }
/* float_to_bf16 of 16 lanes: nearest even, a NaN kept a quiet NaN, in integer steps, so bitwise the
 * scalar form (AVX512-BF16's own conversion would flush denormal inputs to zero). */
static inline __m256i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
/* The float a bf16 rounding of each lane leaves (what a torch bf16 op's result reads back as). */
static inline __m512 round_bf16_16(__m512 v) { return widen_bf16(bf16_bits16(v)); }
#endif

/* exp(x) for x <= 0 (scores minus their max), as 2^k * 2^f with a degree-6 polynomial for 2^f on
 * [-0.5, 0.5] (relative error ~1e-7). Unlike libm's expf it is plain arithmetic, so softmax loops
 * vectorise; a call per score was a visible share of the decode kernel. GCC vectorises the floorf
 * only under -fno-trapping-math: a kernel using this in a loop builds with it. The polynomial's
 * coefficients (1/n! in ln 2 units of f) are shared with the AVX-512 form below. */
#define EXP_C2 0.5f
#define EXP_C3 1.6666667e-1f
#define EXP_C4 4.1666668e-2f
#define EXP_C5 8.3333338e-3f
#define EXP_C6 1.3888889e-3f
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* below this e^x is under FLT_MIN: keep 2^k a normal float */
    const float y = x * 1.44269504088896341f;
    const float kf = __builtin_floorf(y + 0.5f), f = (y - kf) * 0.69314718055994531f;
    const float p = 1.0f + f * (1.0f + f * (EXP_C2 + f * (EXP_C3 + f * (EXP_C4 + f * (EXP_C5 + f * EXP_C6)))));
    const int32_t bits = ((int32_t)kf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(g) = g / (1 + exp(-g)), with exp taken of -|g| only (exp_nonpositive: plain arithmetic the
 * compiler vectorises, where a libm expf call per element was ~5% of a 64-row decode step): for
 * g < 0 it is g e / (1 + e) with e = exp(g), the same quotient multiplied through by e. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.0f ? g : -g);
    return (g < 0.0f ? g * e : g) / (1.0f + e);
}

#ifdef __AVX512F__
/* exp_nonpositive of 16 lanes, for loops written in intrinsics (masked tails). */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 kf = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, kf), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(kf), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* silu of 16 lanes: the scalar silu's operations in its order, exp16_nonpositive for its exp (a NaN
 * gate gives a NaN either way). */
static inline __m512 silu16(__m512 g) {
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
    const __m512 e = exp16_nonpositive(_mm512_mask_blend_ps(negative, minus_g, g));
    return _mm512_div_ps(_mm512_mask_mul_ps(g, negative, g, e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

#endif
