/*
 * dispersion_correction, AVX2 + FMA + F16C. Built with -mavx2 -mfma -mf16c;
 * called only when cpuid reports all three. Unit-stride runs are vectorised,
 * other strides and the tails go through the reference's scalar formula.
 * Multiply and add stay separate instructions (no FMA): every variant rounds
 * exactly as the reference does (IEEE mul, correctly rounded sqrt, add), so
 * the C tests compare float32 and float64 bit for bit.
 */
#include <immintrin.h>
#include <math.h>

#include "dispersion_correction.h"
#include "half_avx2.h"

/* Runs that write more than this are streamed past the caches: such an output
 * cannot stay cached anyway, and a non-temporal store skips reading each
 * output line before overwriting it. */
#define DISPERSION_CORRECTION_STREAM_MIN_BYTES ((int64_t)8 << 20)

static inline __m256 fwd8(__m256 x, __m256 a) { return _mm256_add_ps(_mm256_mul_ps(x, a), _mm256_sqrt_ps(x)); }

static inline __m256 bwd8(__m256 g, __m256 x, __m256 a) {
    __m256 den = _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_sqrt_ps(x));
    return _mm256_add_ps(_mm256_mul_ps(g, a), _mm256_div_ps(g, den));
}

/* The 8-wide loops for the three types computed in fp32; strided runs and
 * tails reuse the reference. */
#define DISPERSION_CORRECTION_AVX2(name, E, LD, ST, NT)                                                                \
    static void dispersion_correction_fwd_##name(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs,          \
                                                 double alpha) {                                                       \
        E *y = y_;                                                                                                     \
        const E *x = x_;                                                                                               \
        int64_t i = 0;                                                                                                 \
        if (ys == 1 && xs == 1 && n * (int64_t)sizeof(E) >= DISPERSION_CORRECTION_STREAM_MIN_BYTES) {                  \
            const __m256 a = _mm256_set1_ps((float)alpha);                                                             \
            i = (int64_t)((32 - ((uintptr_t)y & 31)) & 31) / (int64_t)sizeof(E);                                       \
            dispersion_correction_kernels_ref.fwd[OPF_##name](y, x, i, 1, 1, alpha);                                   \
            for (; i + 8 <= n; i += 8) NT(y + i, fwd8(LD(x + i), a));                                                  \
            _mm_sfence();                                                                                              \
        } else if (ys == 1 && xs == 1) {                                                                               \
            const __m256 a = _mm256_set1_ps((float)alpha);                                                             \
            for (; i + 16 <= n; i += 16) {                                                                             \
                __m256 v0 = LD(x + i), v1 = LD(x + i + 8);                                                             \
                ST(y + i, fwd8(v0, a));                                                                                \
                ST(y + i + 8, fwd8(v1, a));                                                                            \
            }                                                                                                          \
            for (; i + 8 <= n; i += 8) ST(y + i, fwd8(LD(x + i), a));                                                  \
        }                                                                                                              \
        dispersion_correction_kernels_ref.fwd[OPF_##name](y + i * ys, x + i * xs, n - i, ys, xs, alpha);               \
    }                                                                                                                  \
    static void dispersion_correction_bwd_##name(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs,   \
                                                 int64_t dys, int64_t xs, double alpha) {                              \
        E *dx = dx_;                                                                                                   \
        const E *dy = dy_, *x = x_;                                                                                    \
        int64_t i = 0;                                                                                                 \
        if (dxs == 1 && dys == 1 && xs == 1) {                                                                         \
            const __m256 a = _mm256_set1_ps((float)alpha);                                                             \
            for (; i + 8 <= n; i += 8) ST(dx + i, bwd8(LD(dy + i), LD(x + i), a));                                     \
        }                                                                                                              \
        dispersion_correction_kernels_ref.bwd[OPF_##name](dx + i * dxs, dy + i * dys, x + i * xs, n - i, dxs, dys, xs, \
                                                          alpha);                                                      \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
DISPERSION_CORRECTION_AVX2(f32, float, ld_f32, st_f32, nt_f32)
DISPERSION_CORRECTION_AVX2(bf16, uint16_t, ld_bf16, st_bf16, nt_bf16)
DISPERSION_CORRECTION_AVX2(f16, uint16_t, ld_f16, st_f16, nt_f16)

static void dispersion_correction_fwd_f64(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs, double alpha) {
    double *y = y_;
    const double *x = x_;
    int64_t i = 0;
    if (ys == 1 && xs == 1) {
        const __m256d a = _mm256_set1_pd(alpha);
        for (; i + 4 <= n; i += 4) {
            __m256d v = _mm256_loadu_pd(x + i);
            _mm256_storeu_pd(y + i, _mm256_add_pd(_mm256_mul_pd(v, a), _mm256_sqrt_pd(v)));
        }
    }
    dispersion_correction_kernels_ref.fwd[OPF_F64](y + i * ys, x + i * xs, n - i, ys, xs, alpha);
}

static void dispersion_correction_bwd_f64(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs,
                                          int64_t dys, int64_t xs, double alpha) {
    double *dx = dx_;
    const double *dy = dy_, *x = x_;
    int64_t i = 0;
    if (dxs == 1 && dys == 1 && xs == 1) {
        const __m256d a = _mm256_set1_pd(alpha), two = _mm256_set1_pd(2.0);
        for (; i + 4 <= n; i += 4) {
            __m256d g = _mm256_loadu_pd(dy + i);
            __m256d den = _mm256_mul_pd(two, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
            _mm256_storeu_pd(dx + i, _mm256_add_pd(_mm256_mul_pd(g, a), _mm256_div_pd(g, den)));
        }
    }
    dispersion_correction_kernels_ref.bwd[OPF_F64](dx + i * dxs, dy + i * dys, x + i * xs, n - i, dxs, dys, xs, alpha);
}

const dispersion_correction_kernels dispersion_correction_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .fwd = {[OPF_F32] = dispersion_correction_fwd_f32,
            [OPF_F64] = dispersion_correction_fwd_f64,
            [OPF_BF16] = dispersion_correction_fwd_bf16,
            [OPF_F16] = dispersion_correction_fwd_f16},
    .bwd = {[OPF_F32] = dispersion_correction_bwd_f32,
            [OPF_F64] = dispersion_correction_bwd_f64,
            [OPF_BF16] = dispersion_correction_bwd_bf16,
            [OPF_F16] = dispersion_correction_bwd_f16},
};
