/*
 * The row code of the fused linear + cross-entropy, 8 lanes (AVX2 + FMA):
 * per logit it costs a few percent of the 2H-deep GEMM dot products around
 * it, but scalar expf / tanhf (~20-40 cycles each, twice per logit over the
 * two sweeps) would cost 10-15% at H = 2048 and more at smaller H.
 */
#include <immintrin.h>
#include <math.h>

#include "linear_cross_entropy.h"
#include "math_avx2.h"

static inline __m256 capped8(__m256 u, __m256 cap, __m256 rcap, int has_cap) {
    return has_cap ? _mm256_mul_ps(cap, tanh8(_mm256_mul_ps(u, rcap))) : u;
}

static inline float capped1(float u, float cap) { return cap > 0.0f ? cap * tanhf(u / cap) : u; }

static void lse_update_avx2(const float *u, int64_t n, float capf, float *max, float *sum, float *zsum) {
    const int has_cap = capf > 0.0f;
    const __m256 cap = _mm256_set1_ps(capf), rcap = _mm256_set1_ps(has_cap ? 1.0f / capf : 0.0f);
    __m256 vm = _mm256_set1_ps(-INFINITY), vz = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 z = capped8(_mm256_loadu_ps(u + j), cap, rcap, has_cap);
        vm = _mm256_max_ps(vm, z); /* a NaN z may be dropped here, as fmaxf drops it: it shows in the sum */
        vz = _mm256_add_ps(vz, z);
    }
    float m = hmax8(vm), zs = hsum8(vz), s = 0.0f;
    for (int64_t i = j; i < n; i++) {
        float z = capped1(u[i], capf);
        m = fmaxf(m, z);
        zs += z;
    }
    *zsum += zs;
    if (isnan(*zsum)) *sum = NAN; /* a NaN logit, which the max may drop (m = -inf ends here): NaN, as expf gives */
    if (m == -INFINITY || isnan(*zsum)) return;
    __m256 vs = _mm256_setzero_ps(), mm = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= n; j += 8)
        vs = _mm256_add_ps(vs, exp8(_mm256_sub_ps(capped8(_mm256_loadu_ps(u + j), cap, rcap, has_cap), mm)));
    s = hsum8(vs);
    for (int64_t i = j; i < n; i++) s += expf(capped1(u[i], capf) - m);
    if (m > *max) {
        *sum = *sum * expf(*max - m) + s;
        *max = m;
    } else {
        *sum += s * expf(m - *max);
    }
}

static void grad_avx2(float *u, int64_t n, float capf, float lse, float scale, float eps_v) {
    const int has_cap = capf > 0.0f;
    const __m256 cap = _mm256_set1_ps(capf), rcap = _mm256_set1_ps(has_cap ? 1.0f / capf : 0.0f);
    const __m256 vl = _mm256_set1_ps(lse), vs = _mm256_set1_ps(scale), ve = _mm256_set1_ps(eps_v);
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 z = capped8(_mm256_loadu_ps(u + j), cap, rcap, has_cap);
        __m256 g = _mm256_mul_ps(vs, _mm256_sub_ps(exp8(_mm256_sub_ps(z, vl)), ve));
        if (has_cap) {
            __m256 r = _mm256_mul_ps(z, rcap);
            g = _mm256_mul_ps(g, _mm256_fnmadd_ps(r, r, one));
        }
        _mm256_storeu_ps(u + j, g);
    }
    linear_cross_entropy_kernels_ref.grad(u + j, n - j, capf, lse, scale, eps_v);
}

/* tanh8 works lane by lane: a broadcast u[j] gives u[j]'s lane of its block; the tail is scalar */
static float capped_avx2(const float *u, int64_t n, int64_t j, float capf) {
    if (!(capf > 0.0f) || j >= n - n % 8) return capped1(u[j], capf);
    return _mm256_cvtss_f32(capped8(_mm256_set1_ps(u[j]), _mm256_set1_ps(capf), _mm256_set1_ps(1.0f / capf), 1));
}

const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx2 = {
    .name = "avx2", .isa = OPF_ISA_AVX2, .lse_update = lse_update_avx2, .grad = grad_avx2, .capped = capped_avx2};
