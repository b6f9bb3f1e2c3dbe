/* FMA peak probe, AVX-512: 16 independent 16-wide FMA chains (latency 4
 * cycles x up to 2 zmm pipes needs at least 8 in flight). On cores that split
 * a zmm FMA in two 256-bit halves (Zen 4) this reads the same as the AVX2
 * probe; on cores with two 512-bit pipes, twice as much. */
#include <immintrin.h>

#include "probe.h"

static double fma_loop(int64_t iters, float *sink) {
    __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    __m512 c[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) c[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) c[j] = _mm512_fmadd_ps(c[j], a, b);
    }
    __m512 s = c[0];
#pragma GCC unroll 16
    for (int j = 1; j < 16; j++) s = _mm512_add_ps(s, c[j]);
    _mm256_storeu_ps(sink, _mm512_castps512_ps256(s)); /* keeps the loop alive */
    return (double)iters * 16 * 16 * 2;
}

const probe_kernels probe_kernels_avx512 = {.name = "avx512", .isa = OPF_ISA_AVX512, .fma = fma_loop};
