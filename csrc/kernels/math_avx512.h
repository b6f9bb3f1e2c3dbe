/*
 * 16-wide float32 math for the AVX-512 kernels (built with the avx512 flags:
 * F, BW, VL, DQ), the twin of math_avx2.h: exp, 2^t for softmaxes, tanh and
 * erf. Two exps and two tanhs stand side by side on purpose: each kernel
 * keeps the one its results were checked with, and they are not the same
 * bits (exp16 and exp16_subnormal below -87.68 and above 88.37, exp16z by its
 * other polynomial almost everywhere). Included by *_avx512.c files only.
 */
#ifndef OPFORGE_KERNELS_MATH_AVX512_H
#define OPFORGE_KERNELS_MATH_AVX512_H

#include <immintrin.h>

#define LOG2E 1.44269504088896341f

/* exp(x) = 2^n exp(r), r = x - n ln2 in [-ln2/2, ln2/2], x already clamped: exp(r) by math_avx2.h's
 * degree-6 polynomial, n for the caller to apply (exp16 and exp16_subnormal differ only there) */
static inline __m512 exp16_poly(__m512 x, __m512 *n) {
    *n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

/* math_avx2.h's exp8 on 16 lanes, bit for bit: NaN kept by the clamp's operand order, 0 below -87.68
 * (-inf included); the activations' exp */
static inline __m512 exp16(__m512 x) {
    __m512 n, p = exp16_poly(_mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-88.0f), x)), &n);
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* exp16 with scalef for 2^n, which rounds p 2^n to subnormals as expf does (exp16 flushes them), and to
 * 0 from x = -104 down (-inf included); above 88.37 it stays finite where exp16 gives inf. The fused
 * linear + cross-entropy's: a logit far below the max keeps a subnormal probability, as in expf. */
static inline __m512 exp16_subnormal(__m512 x) {
    __m512 n, p = exp16_poly(_mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x)), &n);
    return _mm512_scalef_ps(p, n);
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
static inline __m512 exp16z(__m512 d) { return exp2_16z(_mm512_mul_ps(d, _mm512_set1_ps(LOG2E))); }

/* v (sign bit clear) with the sign of s */
static inline __m512 or_sign16(__m512 v, __m512 s) {
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(v), _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32((int)0x80000000u))));
}

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|): no overflow, exact sign. On exp16; exp16_subnormal
 * gives the same bits (checked on every float: the two differ only where e < 2^-24, which 1 -+ e drops). */
static inline __m512 tanh16(__m512 u) {
    __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(u), _mm512_set1_ps(-2.0f)));
    return or_sign16(_mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* tanh16 on exp16z, the softmax's exp: cross_entropy's softcap, whose log-sum-exp uses exp16z too */
static inline __m512 tanh16z(__m512 u) {
    __m512 e = exp16z(_mm512_mul_ps(_mm512_abs_ps(u), _mm512_set1_ps(-2.0f)));
    return or_sign16(_mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* erf(x), Abramowitz-Stegun 7.1.26 refined as erf8e of math_avx2.h: |error| < 1.5e-7; *e gets the
 * exp(-x^2) it is made of (GELU's derivative needs it too: its pdf term) */
static inline __m512 erf16e(__m512 x, __m512 *e) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 a = _mm512_abs_ps(x);
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    *e = exp16(_mm512_mul_ps(_mm512_mul_ps(a, a), _mm512_set1_ps(-1.0f)));
    return or_sign16(_mm512_fnmadd_ps(p, *e, one), x);
}

#endif
