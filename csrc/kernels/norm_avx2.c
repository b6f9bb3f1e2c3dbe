/*
 * Normalisation row kernels, AVX2 + FMA + F16C. Built with -mavx2 -mfma -mf16c;
 * called only when cpuid reports all three. Rows whose operands all have hidden
 * stride 1 are vectorised 8 lanes at a time (the last partial vector through a
 * zero-padded copy, so the sums see zeros there); other rows and float64 go to
 * the reference. Each row makes two passes (three for layer_norm's forward):
 * a row of up to 4096 float32 stays in L1/L2 between them, so memory sees x
 * once. Elementwise products are rounded as the reference rounds them (mul, no
 * FMA); only the order of each row's sums differs.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "half_avx2.h"
#include "math_avx2.h"
#include "norm.h"

/* v rounded to the element type and back: the value a stored s holds */
static inline __m256 rt_f32(__m256 v) { return v; }
static inline __m256 rt_bf16(__m256 v) { return bf16_widen8(bf16_round(v)); }
static inline __m256 rt_f16(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

/* dw[i..i+8) += v, n lanes */
static inline void acc_add(float *dw, __m256 v, int64_t n) {
    if (n >= 8) {
        _mm256_storeu_ps(dw, _mm256_add_ps(_mm256_loadu_ps(dw), v));
        return;
    }
    __m256i m = lanes_below(n);
    _mm256_maskstore_ps(dw, m, _mm256_add_ps(_mm256_maskload_ps(dw, m), v));
}

/* Loads and stores of n < 8 elements go through a zero-padded copy (PAD8_IO of half_avx2.h). */
#define NORM_PARTIAL(name, E)                                                                     \
    PAD8_IO(name, E)                                                                              \
    static inline __m256 wn_##name(const E *w, int64_t n, int offset) {                           \
        return offset ? _mm256_add_ps(_mm256_set1_ps(1.0f), ldn_##name(w, n)) : ldn_##name(w, n); \
    }

#define NORM_AVX2(name, E, LD, ST, RT)                                                                              \
    NORM_PARTIAL(name, E)                                                                                           \
    static void rms_fwd_##name(void *y_, void *s_, float *rstd, const void *x_, int64_t xcs, const void *r_,        \
                               int64_t rcs, const void *w_, int64_t wcs, int64_t n, double eps, int offset) {       \
        if (xcs != 1 || (r_ && rcs != 1) || (w_ && wcs != 1)) {                                                     \
            norm_kernels_ref.rms_fwd[OPF_##name](y_, s_, rstd, x_, xcs, r_, rcs, w_, wcs, n, eps, offset);          \
            return;                                                                                                 \
        }                                                                                                           \
        E *y = y_, *s = s_;                                                                                         \
        const E *x = x_, *r = r_, *w = w_;                                                                          \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                 \
        int64_t i = 0;                                                                                              \
        if (r) {                                                                                                    \
            for (; i < n; i += 8) {                                                                                 \
                __m256 v = RT(_mm256_add_ps(ldn_##name(x + i, n - i), ldn_##name(r + i, n - i)));                   \
                stn_##name(s + i, v, n - i);                                                                        \
                a0 = _mm256_fmadd_ps(v, v, a0);                                                                     \
            }                                                                                                       \
        } else {                                                                                                    \
            for (; i + 32 <= n; i += 32) {                                                                          \
                __m256 v0 = LD(x + i), v1 = LD(x + i + 8), v2 = LD(x + i + 16), v3 = LD(x + i + 24);                \
                a0 = _mm256_fmadd_ps(v0, v0, a0);                                                                   \
                a1 = _mm256_fmadd_ps(v1, v1, a1);                                                                   \
                a2 = _mm256_fmadd_ps(v2, v2, a2);                                                                   \
                a3 = _mm256_fmadd_ps(v3, v3, a3);                                                                   \
            }                                                                                                       \
            for (; i < n; i += 8) {                                                                                 \
                __m256 v = ldn_##name(x + i, n - i);                                                                \
                a0 = _mm256_fmadd_ps(v, v, a0);                                                                     \
            }                                                                                                       \
        }                                                                                                           \
        float ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));                              \
        const float rs = 1.0f / sqrtf(ss / (float)n + (float)eps);                                                  \
        *rstd = rs;                                                                                                 \
        const E *src = r ? s : x;                                                                                   \
        const __m256 vr = _mm256_set1_ps(rs);                                                                       \
        for (i = 0; i < n; i += 8) {                                                                                \
            __m256 o = _mm256_mul_ps(ldn_##name(src + i, n - i), vr);                                               \
            if (w) o = _mm256_mul_ps(o, wn_##name(w + i, n - i, offset));                                           \
            stn_##name(y + i, o, n - i);                                                                            \
        }                                                                                                           \
    }                                                                                                               \
    static void rms_bwd_##name(void *dx_, void *dr_, void *dw_, const void *g_, int64_t gcs, const void *gs_,       \
                               int64_t gscs, const void *x_, int64_t xcs, float rstd, const void *w_, int64_t wcs,  \
                               int64_t n, double eps, int offset) {                                                 \
        if (gcs != 1 || (gs_ && gscs != 1) || xcs != 1 || (w_ && wcs != 1)) {                                       \
            norm_kernels_ref.rms_bwd[OPF_##name](dx_, dr_, dw_, g_, gcs, gs_, gscs, x_, xcs, rstd, w_, wcs, n, eps, \
                                                 offset);                                                           \
            return;                                                                                                 \
        }                                                                                                           \
        E *dx = dx_, *dr = dr_;                                                                                     \
        float *dw = dw_;                                                                                            \
        const E *g = g_, *gs = gs_, *x = x_, *w = w_;                                                               \
        const __m256 vr = _mm256_set1_ps(rstd), one = _mm256_set1_ps(1.0f);                                         \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                                   \
        int64_t i = 0;                                                                                              \
        for (; i + 16 <= n; i += 16) {                                                                              \
            __m256 w0 = w ? wn_##name(w + i, 8, offset) : one, w1 = w ? wn_##name(w + i + 8, 8, offset) : one;      \
            __m256 g0 = LD(g + i), g1 = LD(g + i + 8), xh0 = _mm256_mul_ps(LD(x + i), vr);                          \
            __m256 xh1 = _mm256_mul_ps(LD(x + i + 8), vr);                                                          \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_mul_ps(g0, w0), xh0));                                      \
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_mul_ps(g1, w1), xh1));                                      \
            if (dw) acc_add(dw + i, _mm256_mul_ps(g0, xh0), 8), acc_add(dw + i + 8, _mm256_mul_ps(g1, xh1), 8);     \
        }                                                                                                           \
        for (; i < n; i += 8) {                                                                                     \
            __m256 we = w ? wn_##name(w + i, n - i, offset) : one;                                                  \
            __m256 gi = ldn_##name(g + i, n - i), xh = _mm256_mul_ps(ldn_##name(x + i, n - i), vr);                 \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_mul_ps(gi, we), xh));                                       \
            if (dw) acc_add(dw + i, _mm256_mul_ps(gi, xh), n - i);                                                  \
        }                                                                                                           \
        const __m256 vc = _mm256_set1_ps(hsum8(_mm256_add_ps(a0, a1)) / (float)n);                                  \
        for (i = 0; i < n; i += 8) {                                                                                \
            __m256 we = w ? wn_##name(w + i, n - i, offset) : one;                                                  \
            __m256 gi = ldn_##name(g + i, n - i), xh = _mm256_mul_ps(ldn_##name(x + i, n - i), vr);                 \
            __m256 d = _mm256_mul_ps(vr, _mm256_sub_ps(_mm256_mul_ps(gi, we), _mm256_mul_ps(xh, vc)));              \
            if (gs) d = _mm256_add_ps(d, ldn_##name(gs + i, n - i));                                                \
            stn_##name(dx + i, d, n - i);                                                                           \
            if (dr) stn_##name(dr + i, d, n - i);                                                                   \
        }                                                                                                           \
        (void)eps;                                                                                                  \
    }                                                                                                               \
    static void ln_fwd_##name(void *y_, float *mean, float *rstd, const void *x_, int64_t xcs, const void *w_,      \
                              int64_t wcs, const void *b_, int64_t bcs, int64_t n, double eps) {                    \
        if (xcs != 1 || (w_ && wcs != 1) || (b_ && bcs != 1)) {                                                     \
            norm_kernels_ref.ln_fwd[OPF_##name](y_, mean, rstd, x_, xcs, w_, wcs, b_, bcs, n, eps);                 \
            return;                                                                                                 \
        }                                                                                                           \
        E *y = y_;                                                                                                  \
        const E *x = x_, *w = w_, *b = b_;                                                                          \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                                   \
        int64_t i = 0;                                                                                              \
        for (; i + 16 <= n; i += 16) {                                                                              \
            a0 = _mm256_add_ps(a0, LD(x + i));                                                                      \
            a1 = _mm256_add_ps(a1, LD(x + i + 8));                                                                  \
        }                                                                                                           \
        for (; i < n; i += 8) a0 = _mm256_add_ps(a0, ldn_##name(x + i, n - i));                                     \
        const float mu = hsum8(_mm256_add_ps(a0, a1)) / (float)n;                                                   \
        const __m256 vm = _mm256_set1_ps(mu);                                                                       \
        a0 = a1 = _mm256_setzero_ps();                                                                              \
        for (i = 0; i + 16 <= n; i += 16) {                                                                         \
            __m256 d0 = _mm256_sub_ps(LD(x + i), vm), d1 = _mm256_sub_ps(LD(x + i + 8), vm);                        \
            a0 = _mm256_fmadd_ps(d0, d0, a0);                                                                       \
            a1 = _mm256_fmadd_ps(d1, d1, a1);                                                                       \
        }                                                                                                           \
        for (; i < n; i += 8) {                                                                                     \
            __m256 d = _mm256_sub_ps(ldn_##name(x + i, n - i), vm);                                                 \
            if (n - i < 8) d = _mm256_and_ps(d, _mm256_castsi256_ps(lanes_below(n - i)));                           \
            a0 = _mm256_fmadd_ps(d, d, a0);                                                                         \
        }                                                                                                           \
        const float rs = 1.0f / sqrtf(hsum8(_mm256_add_ps(a0, a1)) / (float)n + (float)eps);                        \
        *mean = mu, *rstd = rs;                                                                                     \
        const __m256 vr = _mm256_set1_ps(rs);                                                                       \
        for (i = 0; i < n; i += 8) {                                                                                \
            __m256 o = _mm256_mul_ps(_mm256_sub_ps(ldn_##name(x + i, n - i), vm), vr);                              \
            if (w) o = _mm256_mul_ps(o, ldn_##name(w + i, n - i));                                                  \
            if (b) o = _mm256_add_ps(o, ldn_##name(b + i, n - i));                                                  \
            stn_##name(y + i, o, n - i);                                                                            \
        }                                                                                                           \
    }                                                                                                               \
    static void ln_bwd_##name(void *dx_, void *dw_, void *db_, const void *g_, int64_t gcs, const void *x_,         \
                              int64_t xcs, float mean, float rstd, const void *w_, int64_t wcs, int64_t n,          \
                              double eps) {                                                                         \
        if (gcs != 1 || xcs != 1 || (w_ && wcs != 1)) {                                                             \
            norm_kernels_ref.ln_bwd[OPF_##name](dx_, dw_, db_, g_, gcs, x_, xcs, mean, rstd, w_, wcs, n, eps);      \
            return;                                                                                                 \
        }                                                                                                           \
        E *dx = dx_;                                                                                                \
        float *dw = dw_, *db = db_;                                                                                 \
        const E *g = g_, *x = x_, *w = w_;                                                                          \
        const __m256 vm = _mm256_set1_ps(mean), vr = _mm256_set1_ps(rstd), one = _mm256_set1_ps(1.0f);              \
        __m256 sg = _mm256_setzero_ps(), sgx = sg;                                                                  \
        for (int64_t i = 0; i < n; i += 8) { /* the sums, and dw, db while g and x come in */                       \
            __m256 gi = ldn_##name(g + i, n - i);                                                                   \
            __m256 gw = _mm256_mul_ps(gi, w ? ldn_##name(w + i, n - i) : one);                                      \
            __m256 xh = _mm256_mul_ps(_mm256_sub_ps(ldn_##name(x + i, n - i), vm), vr);                             \
            sg = _mm256_add_ps(sg, gw);                                                                             \
            sgx = _mm256_add_ps(sgx, _mm256_mul_ps(gw, xh));                                                        \
            if (dw) acc_add(dw + i, _mm256_mul_ps(gi, xh), n - i);                                                  \
            if (db) acc_add(db + i, gi, n - i);                                                                     \
        }                                                                                                           \
        const __m256 va = _mm256_set1_ps(hsum8(sg) / (float)n), vc = _mm256_set1_ps(hsum8(sgx) / (float)n);         \
        for (int64_t i = 0; i < n; i += 8) {                                                                        \
            __m256 xh = _mm256_mul_ps(_mm256_sub_ps(ldn_##name(x + i, n - i), vm), vr);                             \
            __m256 gw = _mm256_mul_ps(ldn_##name(g + i, n - i), w ? ldn_##name(w + i, n - i) : one);                \
            __m256 d = _mm256_mul_ps(vr, _mm256_sub_ps(_mm256_sub_ps(gw, va), _mm256_mul_ps(xh, vc)));              \
            stn_##name(dx + i, d, n - i);                                                                           \
        }                                                                                                           \
        (void)eps;                                                                                                  \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
NORM_AVX2(f32, float, ld_f32, st_f32, rt_f32)
NORM_AVX2(bf16, uint16_t, ld_bf16, st_bf16, rt_bf16)
NORM_AVX2(f16, uint16_t, ld_f16, st_f16, rt_f16)

#define NORM_TABLE(fn) \
    { [OPF_F32] = fn##_f32, [OPF_BF16] = fn##_bf16, [OPF_F16] = fn##_f16 }

/* float64 (gradcheck's dtype) is left NULL: the drivers run the reference's */
const norm_kernels norm_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .rms_fwd = NORM_TABLE(rms_fwd),
    .rms_bwd = NORM_TABLE(rms_bwd),
    .ln_fwd = NORM_TABLE(ln_fwd),
    .ln_bwd = NORM_TABLE(ln_bwd),
};
