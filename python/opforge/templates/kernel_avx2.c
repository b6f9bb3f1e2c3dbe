/*
 * {name}, AVX2: 8 floats per instruction on unit-stride runs; other strides
 * and the tail reuse the scalar reference. Built with -mavx2 -mfma -mf16c
 * because of the _avx2.c suffix, and called only on CPUs that have AVX2.
 */
#include <immintrin.h>

#include "{name}.h"

static void fwd_avx2(float *y, const float *x, int64_t n, int64_t ys, int64_t xs, float alpha) {
    int64_t i = 0;
    if (ys == 1 && xs == 1) {
        const __m256 a = _mm256_set1_ps(alpha);
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(a, v), v));
        }
    }
    {name}_kernels_ref.fwd(y + i * ys, x + i * xs, n - i, ys, xs, alpha);
}

static void bwd_avx2(float *dx, const float *dy, const float *x, int64_t n, int64_t dxs, int64_t dys,
                     int64_t xs, float alpha) {
    int64_t i = 0;
    if (dxs == 1 && dys == 1 && xs == 1) {
        const __m256 a2 = _mm256_set1_ps(2.0f * alpha);
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(a2, _mm256_loadu_ps(x + i)), _mm256_loadu_ps(dy + i));
            _mm256_storeu_ps(dx + i, v);
        }
    }
    {name}_kernels_ref.bwd(dx + i * dxs, dy + i * dys, x + i * xs, n - i, dxs, dys, xs, alpha);
}

const {name}_kernels {name}_kernels_avx2 = {fwd_avx2, bwd_avx2};
