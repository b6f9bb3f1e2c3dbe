/*
 * The row code of the fused linear + cross-entropy, 16 lanes (AVX-512F), the
 * structure of linear_cross_entropy_avx2.c with masked tails instead of a
 * scalar one. exp is exp16_subnormal and tanh tanh16 of math_avx512.h.
 */
#include <immintrin.h>
#include <math.h>

#include "linear_cross_entropy.h"
#include "math_avx512.h"
#include "rows_avx512.h"

static inline __m512 capped16(__m512 u, __m512 cap, __m512 rcap, int has_cap) {
    return has_cap ? _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(u, rcap))) : u;
}

static void lse_update_avx512(const float *u, int64_t n, float capf, float *max, float *sum, float *zsum) {
    const int has_cap = capf > 0.0f;
    const __m512 cap = _mm512_set1_ps(capf), rcap = _mm512_set1_ps(has_cap ? 1.0f / capf : 0.0f);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = ninf, vz = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tail16(n - j);
        __m512 z = capped16(_mm512_maskz_loadu_ps(k, u + j), cap, rcap, has_cap);
        vm = _mm512_mask_max_ps(vm, k, vm, z);
        vz = _mm512_mask_add_ps(vz, k, vz, z);
    }
    float m = _mm512_reduce_max_ps(vm), s;
    *zsum += _mm512_reduce_add_ps(vz);
    if (isnan(*zsum)) *sum = NAN; /* a NaN logit, which the max may drop (m = -inf ends here): NaN, as expf gives */
    if (m == -INFINITY || isnan(*zsum)) return;
    __m512 vs = _mm512_setzero_ps(), mm = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tail16(n - j);
        __m512 z = capped16(_mm512_maskz_loadu_ps(k, u + j), cap, rcap, has_cap);
        vs = _mm512_mask_add_ps(vs, k, vs, exp16_subnormal(_mm512_sub_ps(z, mm)));
    }
    s = _mm512_reduce_add_ps(vs);
    if (m > *max) {
        *sum = *sum * expf(*max - m) + s;
        *max = m;
    } else {
        *sum += s * expf(m - *max);
    }
}

static void grad_avx512(float *u, int64_t n, float capf, float lse, float scale, float eps_v) {
    const int has_cap = capf > 0.0f;
    const __m512 cap = _mm512_set1_ps(capf), rcap = _mm512_set1_ps(has_cap ? 1.0f / capf : 0.0f);
    const __m512 vl = _mm512_set1_ps(lse), vs = _mm512_set1_ps(scale), ve = _mm512_set1_ps(eps_v);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tail16(n - j);
        __m512 z = capped16(_mm512_maskz_loadu_ps(k, u + j), cap, rcap, has_cap);
        __m512 g = _mm512_mul_ps(vs, _mm512_sub_ps(exp16_subnormal(_mm512_sub_ps(z, vl)), ve));
        if (has_cap) {
            __m512 r = _mm512_mul_ps(z, rcap);
            g = _mm512_mul_ps(g, _mm512_fnmadd_ps(r, r, one));
        }
        _mm512_mask_storeu_ps(u + j, k, g);
    }
}

/* tanh16 works lane by lane: a broadcast u[j] gives u[j]'s lane (every logit, the tail too, is a lane) */
static float capped_avx512(const float *u, int64_t n, int64_t j, float capf) {
    (void)n;
    if (!(capf > 0.0f)) return u[j];
    return _mm512_cvtss_f32(capped16(_mm512_set1_ps(u[j]), _mm512_set1_ps(capf), _mm512_set1_ps(1.0f / capf), 1));
}

const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx512 = {.name = "avx512",
                                                                          .isa = OPF_ISA_AVX512,
                                                                          .lse_update = lse_update_avx512,
                                                                          .grad = grad_avx512,
                                                                          .capped = capped_avx512};
