/*
 * cross_entropy rows, AVX-512 (F, BW, VL, DQ): the AVX2 file's passes on 16
 * lanes, tails masked; float64 and non-unit strides run the reference. tanh
 * (softcap) is tanh16z of math_avx512.h, built on the same exp as the softmax.
 */
#include <immintrin.h>
#include <math.h>

#include "cross_entropy.h"
#include "math_avx512.h"
#include "rows_avx512.h"

static inline __m512 cap16(__m512 x, float cap, float inv) {
    return _mm512_mul_ps(_mm512_set1_ps(cap), tanh16z(_mm512_mul_ps(x, _mm512_set1_ps(inv))));
}

#define CROSS_ENTROPY_AVX512(name, E, LD, ST, DT)                                                                     \
    static void cross_entropy_fwd_##name(const void *x_, int64_t C, int64_t xs, const void *w_, int64_t ws,           \
                                         double cap_, double *lse, double *wz) {                                      \
        const E *x = x_, *w = w_;                                                                                     \
        if (xs != 1 || (w && ws != 1)) {                                                                              \
            cross_entropy_kernels_ref.fwd[DT](x_, C, xs, w_, ws, cap_, lse, wz);                                      \
            return;                                                                                                   \
        }                                                                                                             \
        const float cap = (float)cap_, inv = cap > 0 ? 1.0f / cap : 0.0f;                                             \
        __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;                                                               \
        int64_t i = 0;                                                                                                \
        for (; i + 32 <= C; i += 32)                                                                                  \
            m0 = _mm512_max_ps(m0, LD(x + i, 0xffff)), m1 = _mm512_max_ps(m1, LD(x + i + 16, 0xffff));                \
        for (; i < C; i += 16) {                                                                                      \
            __mmask16 k = tail16(C - i);                                                                              \
            m0 = _mm512_mask_max_ps(m0, k, m0, LD(x + i, k));                                                         \
        }                                                                                                             \
        __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)));                                      \
        if (cap > 0) mv = cap16(mv, cap, inv); /* as each z is capped */                                              \
        __m512 s = _mm512_setzero_ps(), t = s;                                                                        \
        for (i = 0; i < C; i += 16) {                                                                                 \
            __mmask16 k = tail16(C - i);                                                                              \
            __m512 z = LD(x + i, k);                                                                                  \
            if (cap > 0) z = cap16(z, cap, inv);                                                                      \
            s = _mm512_add_ps(s, _mm512_maskz_mov_ps(k, exp16z(_mm512_sub_ps(z, mv))));                               \
            z = _mm512_maskz_mov_ps(k, z);                                                                            \
            if (wz) t = w ? _mm512_fmadd_ps(LD(w + i, k), z, t) : _mm512_add_ps(t, z);                                \
        }                                                                                                             \
        *lse = (double)_mm512_cvtss_f32(mv) + log((double)_mm512_reduce_add_ps(s));                                   \
        if (wz) *wz = _mm512_reduce_add_ps(t);                                                                        \
    }                                                                                                                 \
    static void cross_entropy_bwd_##name(void *dx_, const void *x_, int64_t C, int64_t dxs, int64_t xs,               \
                                         const void *w_, int64_t ws, double cap_, double lse_, double a_, double b_,  \
                                         int64_t t, double ct) {                                                      \
        E *dx = dx_;                                                                                                  \
        const E *x = x_, *w = w_;                                                                                     \
        if (dxs != 1 || xs != 1 || (w && ws != 1)) {                                                                  \
            cross_entropy_kernels_ref.bwd[DT](dx_, x_, C, dxs, xs, w_, ws, cap_, lse_, a_, b_, t, ct);                \
            return;                                                                                                   \
        }                                                                                                             \
        const float cap = (float)cap_, inv = cap > 0 ? 1.0f / cap : 0.0f;                                             \
        const __m512 lse = _mm512_set1_ps((float)lse_), a = _mm512_set1_ps((float)a_), b = _mm512_set1_ps((float)b_); \
        const __m512 one = _mm512_set1_ps(1.0f), iv = _mm512_set1_ps(inv);                                            \
        const int zero = a_ == 0 && b_ == 0 && ct == 0;                                                               \
        for (int64_t i = 0; i < C; i += 16) {                                                                         \
            __mmask16 k = tail16(C - i);                                                                              \
            __m512 g = _mm512_setzero_ps();                                                                           \
            if (!zero) {                                                                                              \
                __m512 z = LD(x + i, k);                                                                              \
                if (cap > 0) z = cap16(z, cap, inv);                                                                  \
                __m512 bw = w ? _mm512_mul_ps(b, LD(w + i, k)) : b;                                                   \
                g = _mm512_fmsub_ps(a, exp16z(_mm512_sub_ps(z, lse)), bw);                                            \
                if (t >= i && t < i + 16) /* the target's lane */                                                     \
                    g = _mm512_mask_sub_ps(g, (__mmask16)(1u << (t - i)), g, _mm512_set1_ps((float)ct));              \
                if (cap > 0) {                                                                                        \
                    __m512 zc = _mm512_mul_ps(z, iv);                                                                 \
                    g = _mm512_mul_ps(g, _mm512_fnmadd_ps(zc, zc, one));                                              \
                }                                                                                                     \
            }                                                                                                         \
            ST(dx + i, g, k);                                                                                         \
        }                                                                                                             \
    }

CROSS_ENTROPY_AVX512(f32, float, ld16_f32, st16_f32, OPF_F32)
CROSS_ENTROPY_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16, OPF_BF16)
CROSS_ENTROPY_AVX512(f16, uint16_t, ld16_f16, st16_f16, OPF_F16)

static void cross_entropy_fwd_f64(const void *x, int64_t C, int64_t xs, const void *w, int64_t ws, double cap,
                                  double *lse, double *wz) {
    cross_entropy_kernels_ref.fwd[OPF_F64](x, C, xs, w, ws, cap, lse, wz);
}

static void cross_entropy_bwd_f64(void *dx, const void *x, int64_t C, int64_t dxs, int64_t xs, const void *w,
                                  int64_t ws, double cap, double lse, double a, double b, int64_t t, double ct) {
    cross_entropy_kernels_ref.bwd[OPF_F64](dx, x, C, dxs, xs, w, ws, cap, lse, a, b, t, ct);
}

const cross_entropy_kernels cross_entropy_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .fwd = {[OPF_F32] = cross_entropy_fwd_f32,
            [OPF_F64] = cross_entropy_fwd_f64,
            [OPF_BF16] = cross_entropy_fwd_bf16,
            [OPF_F16] = cross_entropy_fwd_f16},
    .bwd = {[OPF_F32] = cross_entropy_bwd_f32,
            [OPF_F64] = cross_entropy_bwd_f64,
            [OPF_BF16] = cross_entropy_bwd_bf16,
            [OPF_F16] = cross_entropy_bwd_f16},
};
