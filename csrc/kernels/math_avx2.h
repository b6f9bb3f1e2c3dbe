/*
 * 8-wide float32 math for the AVX2 kernels (built with -mavx2 -mfma): exp to
 * ~1-2 ulp (NaN kept, 0 at -inf), a masked 2^t for softmaxes, tanh and erf,
 * horizontal max and sum. math_avx512.h is its 16-lane twin. Included by
 * *_avx2.c files only (and the AVX-512 GEMM epilogue, through act_avx2.h).
 */
#ifndef OPFORGE_KERNELS_MATH_AVX2_H
#define OPFORGE_KERNELS_MATH_AVX2_H

#include <immintrin.h>

#define LOG2E 1.44269504088896341f

/* exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial. The clamp keeps NaN (max
 * and min return their second operand when either is NaN), and its ends are where 2^n's exponent field
 * overflows to inf (n = 128) and reaches 0 (n = -127): exp(NaN) = NaN, exp(inf) = inf, and exp(x) = 0
 * below -87.68 (subnormal there, flushed), -inf included. A clamp to -87.3 with x as the first operand
 * made exp(NaN) and exp(-inf) 1.2e-38: a NaN logit's gradient came out finite, and GELU's x phi(x) was
 * inf instead of NaN at x = inf and -4.9e-9 instead of 0 at -1e30. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-88.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 2^t for t <= 0: t = n + f, |f| <= 1/2, 2^f by a degree-6 polynomial (fitted
 * for relative error, < 1 ulp in float32 with FMA); 0 below -126 (and for
 * -inf), NaN kept. A softmax scales its scores by log2(e) once, folded into
 * the scale, and calls this instead of exp. */
static inline __m256 exp2_8z(__m256 t) {
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.534581242594868e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3399930903688073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618489071726799e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550328642129898e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022646248340607e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471824645996e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                         _mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ));
}

/* exp(d) for d <= 0 */
static inline __m256 exp8z(__m256 d) { return exp2_8z(_mm256_mul_ps(d, _mm256_set1_ps(LOG2E))); }

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|): no overflow, exact sign */
static inline __m256 tanh8(__m256 u) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, u);
    __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_or_ps(t, _mm256_and_ps(u, sign));
}

/* erf(x), Abramowitz-Stegun 7.1.26 refined: |error| < 1.5e-7; *e gets the
 * exp(-x^2) it is made of (GELU's derivative needs it too: its pdf term) */
static inline __m256 erf8e(__m256 x, __m256 *e) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    __m256 a = _mm256_andnot_ps(sign, x);
    __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    *e = exp8(_mm256_mul_ps(_mm256_mul_ps(a, a), _mm256_set1_ps(-1.0f)));
    __m256 y = _mm256_fnmadd_ps(p, *e, one);
    return _mm256_or_ps(y, _mm256_and_ps(x, sign));
}

static inline __m256 erf8(__m256 x) {
    __m256 e;
    return erf8e(x, &e);
}

/* the largest and the sum of v's eight lanes */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a mask with lanes [0, n) set (all from n = 8 on, none up to n = 0): a row's tail, masked */
static inline __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#endif
