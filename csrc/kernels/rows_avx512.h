/*
 * Row helpers of the AVX-512 softmax-like kernels (softmax_avx512.c,
 * cross_entropy_avx512.c), built with the avx512 flags (F, BW, VL, DQ): the
 * 16-lane twins of rows_avx2.h. Every load and store takes a lane mask
 * (tails are masked, never a scalar loop); loads give 0 in masked-off lanes,
 * ldf the given fill.
 */
#ifndef OPFORGE_KERNELS_ROWS_AVX512_H
#define OPFORGE_KERNELS_ROWS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "half_avx512.h"

/* the first `left` lanes: none when left <= 0, all when left >= 16 */
static inline __mmask16 tail16(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 ld16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void st16_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 ld16_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void st16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_BF16));
}
static inline __m512 ld16_f16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline void st16_f16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_F16));
}

/* 2^t for t <= 0, as exp2_8z of math_avx2.h: 0 below -126 (and at -inf), NaN kept */
static inline __m512 exp2_16z(__m512 t) {
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.534581242594868e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399930903688073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618489071726799e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550328642129898e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646248340607e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

/* exp(d) for d <= 0 */
static inline __m512 exp16z(__m512 d) { return exp2_16z(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f))); }

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) */
static inline __m512 tanh16(__m512 u) {
    __m512 a = _mm512_abs_ps(u);
    __m512 e = exp16z(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32((int)0x80000000u))));
}

#endif
