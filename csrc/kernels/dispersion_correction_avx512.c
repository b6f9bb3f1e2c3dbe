/*
 * dispersion_correction, AVX-512 (F, BW, VL, DQ). 16 lanes; unit-stride tails
 * use masked loads and stores instead of a scalar loop. Other strides go
 * through the reference. Multiply and add are not fused (see the AVX2 file).
 */
#include <immintrin.h>

#include "dispersion_correction.h"
#include "rows_avx512.h"

static inline __m512 fwd16(__m512 x, __m512 a) { return _mm512_add_ps(_mm512_mul_ps(x, a), _mm512_sqrt_ps(x)); }

static inline __m512 bwd16(__m512 g, __m512 x, __m512 a) {
    __m512 den = _mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_sqrt_ps(x));
    return _mm512_add_ps(_mm512_mul_ps(g, a), _mm512_div_ps(g, den));
}

#define DISPERSION_CORRECTION_AVX512(name, E, LD, ST)                                                                \
    static void dispersion_correction_fwd_##name(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs,        \
                                                 double alpha) {                                                     \
        E *y = y_;                                                                                                   \
        const E *x = x_;                                                                                             \
        if (ys != 1 || xs != 1) {                                                                                    \
            dispersion_correction_kernels_ref.fwd[OPF_##name](y, x, n, ys, xs, alpha);                               \
            return;                                                                                                  \
        }                                                                                                            \
        const __m512 a = _mm512_set1_ps((float)alpha);                                                               \
        int64_t i = 0;                                                                                               \
        for (; i + 32 <= n; i += 32) {                                                                               \
            __m512 v0 = LD(x + i, 0xffff), v1 = LD(x + i + 16, 0xffff);                                              \
            ST(y + i, fwd16(v0, a), 0xffff);                                                                         \
            ST(y + i + 16, fwd16(v1, a), 0xffff);                                                                    \
        }                                                                                                            \
        for (; i < n; i += 16) {                                                                                     \
            __mmask16 m = tail16(n - i);                                                                             \
            ST(y + i, fwd16(LD(x + i, m), a), m);                                                                    \
        }                                                                                                            \
    }                                                                                                                \
    static void dispersion_correction_bwd_##name(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs, \
                                                 int64_t dys, int64_t xs, double alpha) {                            \
        E *dx = dx_;                                                                                                 \
        const E *dy = dy_, *x = x_;                                                                                  \
        if (dxs != 1 || dys != 1 || xs != 1) {                                                                       \
            dispersion_correction_kernels_ref.bwd[OPF_##name](dx, dy, x, n, dxs, dys, xs, alpha);                    \
            return;                                                                                                  \
        }                                                                                                            \
        const __m512 a = _mm512_set1_ps((float)alpha);                                                               \
        for (int64_t i = 0; i < n; i += 16) {                                                                        \
            __mmask16 m = tail16(n - i);                                                                             \
            ST(dx + i, bwd16(LD(dy + i, m), LD(x + i, m), a), m);                                                    \
        }                                                                                                            \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
DISPERSION_CORRECTION_AVX512(f32, float, ld16_f32, st16_f32)
DISPERSION_CORRECTION_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16)
DISPERSION_CORRECTION_AVX512(f16, uint16_t, ld16_f16, st16_f16)

static void dispersion_correction_fwd_f64(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs, double alpha) {
    double *y = y_;
    const double *x = x_;
    if (ys != 1 || xs != 1) {
        dispersion_correction_kernels_ref.fwd[OPF_F64](y, x, n, ys, xs, alpha);
        return;
    }
    const __m512d a = _mm512_set1_pd(alpha);
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 m = n - i >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1);
        __m512d v = _mm512_maskz_loadu_pd(m, x + i);
        _mm512_mask_storeu_pd(y + i, m, _mm512_add_pd(_mm512_mul_pd(v, a), _mm512_sqrt_pd(v)));
    }
}

static void dispersion_correction_bwd_f64(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs,
                                          int64_t dys, int64_t xs, double alpha) {
    double *dx = dx_;
    const double *dy = dy_, *x = x_;
    if (dxs != 1 || dys != 1 || xs != 1) {
        dispersion_correction_kernels_ref.bwd[OPF_F64](dx, dy, x, n, dxs, dys, xs, alpha);
        return;
    }
    const __m512d a = _mm512_set1_pd(alpha), two = _mm512_set1_pd(2.0);
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 m = n - i >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1);
        __m512d g = _mm512_maskz_loadu_pd(m, dy + i);
        __m512d den = _mm512_mul_pd(two, _mm512_sqrt_pd(_mm512_maskz_loadu_pd(m, x + i)));
        _mm512_mask_storeu_pd(dx + i, m, _mm512_add_pd(_mm512_mul_pd(g, a), _mm512_div_pd(g, den)));
    }
}

const dispersion_correction_kernels dispersion_correction_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .fwd = {[OPF_F32] = dispersion_correction_fwd_f32,
            [OPF_F64] = dispersion_correction_fwd_f64,
            [OPF_BF16] = dispersion_correction_fwd_bf16,
            [OPF_F16] = dispersion_correction_fwd_f16},
    .bwd = {[OPF_F32] = dispersion_correction_bwd_f32,
            [OPF_F64] = dispersion_correction_bwd_f64,
            [OPF_BF16] = dispersion_correction_bwd_bf16,
            [OPF_F16] = dispersion_correction_bwd_f16},
};
