/* FMA peak probe, AVX2: 12 independent 8-wide FMA chains (latency 4-5 cycles
 * x 2 pipes needs at least 10 in flight). */
#include <immintrin.h>

#include "probe.h"

static double fma_loop(int64_t iters, float *sink) {
    __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    __m256 c0 = _mm256_set1_ps(0.0f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m256 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    for (int64_t i = 0; i < iters; i++) {
        c0 = _mm256_fmadd_ps(c0, a, b); c1 = _mm256_fmadd_ps(c1, a, b); c2 = _mm256_fmadd_ps(c2, a, b);
        c3 = _mm256_fmadd_ps(c3, a, b); c4 = _mm256_fmadd_ps(c4, a, b); c5 = _mm256_fmadd_ps(c5, a, b);
        c6 = _mm256_fmadd_ps(c6, a, b); c7 = _mm256_fmadd_ps(c7, a, b); c8 = _mm256_fmadd_ps(c8, a, b);
        c9 = _mm256_fmadd_ps(c9, a, b); c10 = _mm256_fmadd_ps(c10, a, b); c11 = _mm256_fmadd_ps(c11, a, b);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                             _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
    _mm256_storeu_ps(sink, s); /* keeps the loop alive */
    return (double)iters * 12 * 8 * 2;
}

const probe_fma_fn probe_fma_avx2 = fma_loop;
