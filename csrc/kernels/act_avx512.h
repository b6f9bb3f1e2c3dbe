/*
 * 16-wide activations and their derivatives (float32, ~1-2 ulp), built on
 * math_avx512.h: the twin of act_avx2.h's act_pair8, for the AVX-512 kernels
 * (glu_avx512.c). Included by files built with the avx512 flags only.
 */
#ifndef OPFORGE_KERNELS_ACT_AVX512_H
#define OPFORGE_KERNELS_ACT_AVX512_H

#include <immintrin.h>

#include "act.h"
#include "math_avx512.h"

/* act(x); with da, also act'(x), sharing the exponential */
static inline __m512 act16(act_kind act, __m512 x, __m512 *da) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    switch (act) {
    case ACT_SILU: {
        __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        if (da) *da = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
        return _mm512_mul_ps(x, s);
    }
    case ACT_GELU: {
        __m512 e;
        __m512 cdf =
            _mm512_mul_ps(half, _mm512_add_ps(one, erf16e(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)), &e)));
        if (da) *da = _mm512_fmadd_ps(x, _mm512_mul_ps(e, _mm512_set1_ps(0.3989422804014327f)), cdf);
        return _mm512_mul_ps(x, cdf);
    }
    case ACT_GELU_TANH: {
        const __m512 k = _mm512_set1_ps(0.7978845608028654f), c = _mm512_set1_ps(0.044715f);
        __m512 x2 = _mm512_mul_ps(x, x);
        __m512 t = tanh16(_mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(c, x2), x, x)));
        __m512 left = _mm512_mul_ps(half, _mm512_add_ps(one, t));
        if (da) {
            __m512 dt = _mm512_fnmadd_ps(t, t, one);
            __m512 inner = _mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(3.0f), c), x2, one));
            *da = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(half, x), dt), inner, left);
        }
        return _mm512_mul_ps(x, left);
    }
    default:
        if (da) *da = one;
        return x;
    }
}

#endif
