/*
 * cross_entropy rows, AVX2 + FMA + F16C (built with -mavx2 -mfma -mf16c).
 * float32, bfloat16 and float16 compute in float32; float64 runs the
 * reference. Forward: max of the raw logits (the capped max is tanh of it:
 * tanh is increasing), then one pass summing exp(z - max) (and w_j z_j when
 * label smoothing needs it); lse = max + log(sum) in double. Backward: one
 * pass, dx = (a exp(z - lse) - b w - ct [j == t]) (1 - (z/c)^2). exp is
 * exp8z of math_avx2.h (exact 0 at -inf, NaN kept), and so is tanh8.
 * Non-unit strides go through the reference.
 */
#include <immintrin.h>
#include <math.h>

#include "cross_entropy.h"
#include "math_avx2.h"
#include "rows_avx2.h"

static inline __m256 cap8(__m256 x, float cap, float inv) {
    return _mm256_mul_ps(_mm256_set1_ps(cap), tanh8(_mm256_mul_ps(x, _mm256_set1_ps(inv))));
}

/* lane l set */
static inline __m256 lane_is(int64_t l) {
    return _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_set1_epi32((int)l), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

#define CROSS_ENTROPY_AVX2(name, E, LD, ST, DT)                                                                       \
    static void cross_entropy_fwd_##name(const void *x_, int64_t C, int64_t xs, const void *w_, int64_t ws,           \
                                         double cap_, double *lse, double *wz) {                                      \
        const E *x = x_, *w = w_;                                                                                     \
        if (xs != 1 || (w && ws != 1)) {                                                                              \
            cross_entropy_kernels_ref.fwd[DT](x_, C, xs, w_, ws, cap_, lse, wz);                                      \
            return;                                                                                                   \
        }                                                                                                             \
        const float cap = (float)cap_, inv = cap > 0 ? 1.0f / cap : 0.0f;                                             \
        const __m256 ninf = _mm256_set1_ps(-INFINITY);                                                                \
        __m256 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;                                                            \
        int64_t i = 0;                                                                                                \
        for (; i + 32 <= C; i += 32) {                                                                                \
            m0 = _mm256_max_ps(m0, LD(x + i)), m1 = _mm256_max_ps(m1, LD(x + i + 8));                                 \
            m2 = _mm256_max_ps(m2, LD(x + i + 16)), m3 = _mm256_max_ps(m3, LD(x + i + 24));                           \
        }                                                                                                             \
        for (; i + 8 <= C; i += 8) m0 = _mm256_max_ps(m0, LD(x + i));                                                 \
        if (i < C) m1 = _mm256_max_ps(m1, ldn_##name(x + i, C - i, -INFINITY));                                       \
        float m = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));                                 \
        if (cap > 0) m = _mm256_cvtss_f32(cap8(_mm256_set1_ps(m), cap, inv)); /* as each z is capped */               \
        const __m256 mv = _mm256_set1_ps(m);                                                                          \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, t0 = s0, t1 = s0;                                                   \
        for (i = 0; i + 16 <= C; i += 16) {                                                                           \
            __m256 z0 = LD(x + i), z1 = LD(x + i + 8);                                                                \
            if (cap > 0) z0 = cap8(z0, cap, inv), z1 = cap8(z1, cap, inv);                                            \
            s0 = _mm256_add_ps(s0, exp8z(_mm256_sub_ps(z0, mv)));                                                     \
            s1 = _mm256_add_ps(s1, exp8z(_mm256_sub_ps(z1, mv)));                                                     \
            if (wz && w) t0 = _mm256_fmadd_ps(LD(w + i), z0, t0), t1 = _mm256_fmadd_ps(LD(w + i + 8), z1, t1);        \
            if (wz && !w) t0 = _mm256_add_ps(t0, z0), t1 = _mm256_add_ps(t1, z1);                                     \
        }                                                                                                             \
        for (; i < C; i += 8) {                                                                                       \
            __m256 valid = _mm256_castsi256_ps(lanes_below(C - i)),                                                   \
                   z = C - i >= 8 ? LD(x + i) : ldn_##name(x + i, C - i, 0);                                          \
            if (cap > 0) z = cap8(z, cap, inv);                                                                       \
            s0 = _mm256_add_ps(s0, _mm256_and_ps(valid, exp8z(_mm256_sub_ps(z, mv))));                                \
            z = _mm256_and_ps(valid, z);                                                                              \
            if (wz && w) t0 = _mm256_fmadd_ps(C - i >= 8 ? LD(w + i) : ldn_##name(w + i, C - i, 0), z, t0);           \
            if (wz && !w) t0 = _mm256_add_ps(t0, z);                                                                  \
        }                                                                                                             \
        *lse = (double)m + log((double)hsum8(_mm256_add_ps(s0, s1)));                                                 \
        if (wz) *wz = hsum8(_mm256_add_ps(t0, t1));                                                                   \
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
        const __m256 lse = _mm256_set1_ps((float)lse_), a = _mm256_set1_ps((float)a_), b = _mm256_set1_ps((float)b_); \
        const __m256 one = _mm256_set1_ps(1.0f), iv = _mm256_set1_ps(inv);                                            \
        const int zero = a_ == 0 && b_ == 0 && ct == 0;                                                               \
        for (int64_t i = 0; i < C; i += 8) {                                                                          \
            const int64_t r = C - i;                                                                                  \
            __m256 g = _mm256_setzero_ps();                                                                           \
            if (!zero) {                                                                                              \
                __m256 x8 = r >= 8 ? LD(x + i) : ldn_##name(x + i, r, 0), z = x8;                                     \
                if (cap > 0) z = cap8(x8, cap, inv);                                                                  \
                __m256 bw = w ? _mm256_mul_ps(b, r >= 8 ? LD(w + i) : ldn_##name(w + i, r, 0)) : b;                   \
                g = _mm256_fmsub_ps(a, exp8z(_mm256_sub_ps(z, lse)), bw);                                             \
                if (t >= i && t < i + 8) /* the target's lane */                                                      \
                    g = _mm256_sub_ps(g, _mm256_and_ps(lane_is(t - i), _mm256_set1_ps((float)ct)));                   \
                if (cap > 0) {                                                                                        \
                    __m256 zc = _mm256_mul_ps(z, iv);                                                                 \
                    g = _mm256_mul_ps(g, _mm256_fnmadd_ps(zc, zc, one));                                              \
                }                                                                                                     \
            }                                                                                                         \
            if (r >= 8)                                                                                               \
                ST(dx + i, g);                                                                                        \
            else                                                                                                      \
                stn_##name(dx + i, r, g);                                                                             \
        }                                                                                                             \
    }

CROSS_ENTROPY_AVX2(f32, float, ld_f32, st_f32, OPF_F32)
CROSS_ENTROPY_AVX2(bf16, uint16_t, ld_bf16, st_bf16, OPF_BF16)
CROSS_ENTROPY_AVX2(f16, uint16_t, ld_f16, st_f16, OPF_F16)

static void cross_entropy_fwd_f64(const void *x, int64_t C, int64_t xs, const void *w, int64_t ws, double cap,
                                  double *lse, double *wz) {
    cross_entropy_kernels_ref.fwd[OPF_F64](x, C, xs, w, ws, cap, lse, wz);
}

static void cross_entropy_bwd_f64(void *dx, const void *x, int64_t C, int64_t dxs, int64_t xs, const void *w,
                                  int64_t ws, double cap, double lse, double a, double b, int64_t t, double ct) {
    cross_entropy_kernels_ref.bwd[OPF_F64](dx, x, C, dxs, xs, w, ws, cap, lse, a, b, t, ct);
}

const cross_entropy_kernels cross_entropy_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .fwd = {[OPF_F32] = cross_entropy_fwd_f32,
            [OPF_F64] = cross_entropy_fwd_f64,
            [OPF_BF16] = cross_entropy_fwd_bf16,
            [OPF_F16] = cross_entropy_fwd_f16},
    .bwd = {[OPF_F32] = cross_entropy_bwd_f32,
            [OPF_F64] = cross_entropy_bwd_f64,
            [OPF_BF16] = cross_entropy_bwd_bf16,
            [OPF_F16] = cross_entropy_bwd_f16},
};
