/* FMA peak probe, AVX2: 12 independent 8-wide FMA chains (latency 4-5 cycles
 * x 2 pipes needs at least 10 in flight). Each chain starts from its own
 * value: chains that start equal compute equal values, and the compiler
 * merges them into one (a latency-bound loop counted as 12). */
#include <immintrin.h>

#include "probe.h"

static double fma_loop(int64_t iters, float *sink) {
    __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    __m256 c[12];
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) c[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) c[j] = _mm256_fmadd_ps(c[j], a, b);
    }
    __m256 s = c[0];
#pragma GCC unroll 12
    for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, c[j]);
    _mm256_storeu_ps(sink, s); /* keeps the loop alive */
    return (double)iters * 12 * 8 * 2;
}

const probe_kernels probe_kernels_avx2 = {.name = "avx2", .isa = OPF_ISA_AVX2, .fma = fma_loop};
