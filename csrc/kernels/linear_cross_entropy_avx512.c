/*
 * The row code of the fused linear + cross-entropy, 16 lanes (AVX-512F), the
 * structure of linear_cross_entropy_avx2.c with masked tails instead of a
 * scalar one. exp and tanh are math_avx2.h's and act_avx2.h's, widened:
 * this is the only AVX-512 file that needs them.
 */
#include <immintrin.h>
#include <math.h>

#include "linear_cross_entropy.h"

/* exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial (math_avx2.h's exp8). The
 * clamp keeps NaN (max and min return their second operand when either is NaN: a NaN logit's gradient is
 * NaN); scalef rounds p 2^n to subnormals as expf does, and to 0 from x = -104 down (-inf included) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) */
static inline __m512 tanh16(__m512 u) {
    __m512 a = _mm512_abs_ps(u);
    __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32((int)0x80000000u))));
}

static inline __m512 capped16(__m512 u, __m512 cap, __m512 rcap, int has_cap) {
    return has_cap ? _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(u, rcap))) : u;
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static void lse_update_avx512(const float *u, int64_t n, float capf, float *max, float *sum, float *zsum) {
    const int has_cap = capf > 0.0f;
    const __m512 cap = _mm512_set1_ps(capf), rcap = _mm512_set1_ps(has_cap ? 1.0f / capf : 0.0f);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = ninf, vz = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tail_mask(n - j);
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
        __mmask16 k = tail_mask(n - j);
        __m512 z = capped16(_mm512_maskz_loadu_ps(k, u + j), cap, rcap, has_cap);
        vs = _mm512_mask_add_ps(vs, k, vs, exp16(_mm512_sub_ps(z, mm)));
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
        __mmask16 k = tail_mask(n - j);
        __m512 z = capped16(_mm512_maskz_loadu_ps(k, u + j), cap, rcap, has_cap);
        __m512 g = _mm512_mul_ps(vs, _mm512_sub_ps(exp16(_mm512_sub_ps(z, vl)), ve));
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

const lce_kernels lce_kernels_avx512 = {.name = "avx512",
                                        .isa = OPF_ISA_AVX512,
                                        .lse_update = lse_update_avx512,
                                        .grad = grad_avx512,
                                        .capped = capped_avx512};
