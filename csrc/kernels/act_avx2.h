/*
 * 8-wide activations and their derivatives (float32, ~1-2 ulp), built on
 * math_avx2.h: the GEMM epilogues', act_avx2.c's and glu_avx2.c's
 * (act_avx512.h is the 16-lane twin). Included by the files built with
 * -mavx2 -mfma (gemm_avx2.c, gemm_avx512.c, gemm_amx.c, act_avx2.c, glu_avx2.c).
 */
#ifndef OPFORGE_KERNELS_ACT_AVX2_H
#define OPFORGE_KERNELS_ACT_AVX2_H

#include <immintrin.h>

#include "act.h"
#include "math_avx2.h"

static inline __m256 act8(act_kind act, __m256 v) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    switch (act) {
    case ACT_RELU: /* max(v, 0) with NaN kept: blend where v < 0 */
        return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    case ACT_GELU:
        return _mm256_mul_ps(_mm256_mul_ps(half, v),
                             _mm256_add_ps(one, erf8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f)))));
    case ACT_GELU_TANH: {
        __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        __m256 u =
            _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        return _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, tanh8(u)));
    }
    case ACT_SILU: return _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
    default: return v;
    }
}

/* act(x) and act'(x) together, sharing the exponential they are made of. act(x) is x times its factor
 * (x s, x Phi), not act8's rounding (x / (1 + e), (x / 2) (1 + erf)): the GLU backward's */
static inline __m256 act_pair8(act_kind act, __m256 x, __m256 *da) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    switch (act) {
    case ACT_SILU: {
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        *da = _mm256_mul_ps(s, _mm256_fmadd_ps(x, _mm256_sub_ps(one, s), one));
        return _mm256_mul_ps(x, s);
    }
    case ACT_GELU: { /* Phi(x) + x phi(x); erf(x / sqrt 2) is made of exp(-x^2 / 2), phi's exponential */
        __m256 e;
        __m256 cdf =
            _mm256_mul_ps(half, _mm256_add_ps(one, erf8e(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)), &e)));
        *da = _mm256_fmadd_ps(x, _mm256_mul_ps(e, _mm256_set1_ps(0.3989422804014327f)), cdf);
        return _mm256_mul_ps(x, cdf);
    }
    case ACT_GELU_TANH: {
        const __m256 k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
        __m256 x2 = _mm256_mul_ps(x, x);
        __m256 t = tanh8(_mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x2), x, x)));
        __m256 left = _mm256_mul_ps(half, _mm256_add_ps(one, t));
        __m256 dt = _mm256_fnmadd_ps(t, t, one);
        __m256 inner = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(3.0f), c), x2, one));
        *da = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), dt), inner, left);
        return _mm256_mul_ps(x, left);
    }
    default: *da = one; return x;
    }
}

static inline __m256 act_grad8(act_kind act, __m256 x) {
    if (act == ACT_RELU) /* 1 where not x <= 0: NaN included, as act_grad_f32 */
        return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NLE_UQ), _mm256_set1_ps(1.0f));
    __m256 da;
    act_pair8(act, x, &da);
    return da;
}

#endif
