/*
 * Normalisation row kernels, AVX-512 (F, BW, VL, DQ). The AVX2 file's
 * structure with 16 lanes, two or four accumulators per sum (a row of 4096
 * float32 lives in L1, where one chain would wait on each add); the last
 * partial vector of a row is a masked load (zeros in the other lanes, so the
 * sums see zeros) and a masked store. Rows
 * with a hidden stride other than 1, and float64, go to the reference.
 */
#include <immintrin.h>
#include <math.h>

#include "norm.h"
#include "rows_avx512.h"

/* v rounded to the element type and back: the value a stored s holds */
static inline __m512 rt_f32(__m512 v) { return v; }
static inline __m512 rt_bf16(__m512 v) { return bf16_widen16(round16x16(v, OPF_BF16)); }
static inline __m512 rt_f16(__m512 v) { return _mm512_cvtph_ps(round16x16(v, OPF_F16)); }

/* dw[0..16) += v in the lanes of m */
static inline void acc_add(float *dw, __m512 v, __mmask16 m) {
    _mm512_mask_storeu_ps(dw, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, dw), v));
}

#define NORM_AVX512(name, E, LD, ST, RT)                                                                               \
    static inline __m512 wn_##name(const E *w, __mmask16 m, int offset) {                                              \
        return offset ? _mm512_add_ps(_mm512_set1_ps(1.0f), LD(w, m)) : LD(w, m);                                      \
    }                                                                                                                  \
    static void rms_fwd_##name(void *y_, void *s_, float *rstd, const void *x_, int64_t xcs, const void *r_,           \
                               int64_t rcs, const void *w_, int64_t wcs, int64_t n, double eps, int offset) {          \
        if (xcs != 1 || (r_ && rcs != 1) || (w_ && wcs != 1)) {                                                        \
            norm_kernels_ref.rms_fwd[OPF_##name](y_, s_, rstd, x_, xcs, r_, rcs, w_, wcs, n, eps, offset);             \
            return;                                                                                                    \
        }                                                                                                              \
        E *y = y_, *s = s_;                                                                                            \
        const E *x = x_, *r = r_, *w = w_;                                                                             \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                                                      \
        int64_t i = 0;                                                                                                 \
        if (r) {                                                                                                       \
            for (; i + 32 <= n; i += 32) {                                                                             \
                __m512 v0 = RT(_mm512_add_ps(LD(x + i, 0xffff), LD(r + i, 0xffff)));                                   \
                __m512 v1 = RT(_mm512_add_ps(LD(x + i + 16, 0xffff), LD(r + i + 16, 0xffff)));                         \
                ST(s + i, v0, 0xffff), ST(s + i + 16, v1, 0xffff);                                                     \
                a0 = _mm512_fmadd_ps(v0, v0, a0);                                                                      \
                a1 = _mm512_fmadd_ps(v1, v1, a1);                                                                      \
            }                                                                                                          \
            for (; i < n; i += 16) {                                                                                   \
                __mmask16 m = tail16(n - i);                                                                           \
                __m512 v = RT(_mm512_add_ps(LD(x + i, m), LD(r + i, m)));                                              \
                ST(s + i, v, m);                                                                                       \
                a0 = _mm512_fmadd_ps(v, v, a0);                                                                        \
            }                                                                                                          \
        } else {                                                                                                       \
            for (; i + 32 <= n; i += 32) {                                                                             \
                __m512 v0 = LD(x + i, 0xffff), v1 = LD(x + i + 16, 0xffff);                                            \
                a0 = _mm512_fmadd_ps(v0, v0, a0);                                                                      \
                a1 = _mm512_fmadd_ps(v1, v1, a1);                                                                      \
            }                                                                                                          \
            for (; i < n; i += 16) {                                                                                   \
                __m512 v = LD(x + i, tail16(n - i));                                                                   \
                a0 = _mm512_fmadd_ps(v, v, a0);                                                                        \
            }                                                                                                          \
        }                                                                                                              \
        const float rs = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) / (float)n + (float)eps);            \
        *rstd = rs;                                                                                                    \
        const E *src = r ? s : x;                                                                                      \
        const __m512 vr = _mm512_set1_ps(rs);                                                                          \
        for (i = 0; i < n; i += 16) {                                                                                  \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 o = _mm512_mul_ps(LD(src + i, m), vr);                                                              \
            if (w) o = _mm512_mul_ps(o, wn_##name(w + i, m, offset));                                                  \
            ST(y + i, o, m);                                                                                           \
        }                                                                                                              \
    }                                                                                                                  \
    static void rms_bwd_##name(void *dx_, void *dr_, void *dw_, const void *g_, int64_t gcs, const void *gs_,          \
                               int64_t gscs, const void *x_, int64_t xcs, float rstd, const void *w_, int64_t wcs,     \
                               int64_t n, double eps, int offset) {                                                    \
        if (gcs != 1 || (gs_ && gscs != 1) || xcs != 1 || (w_ && wcs != 1)) {                                          \
            norm_kernels_ref.rms_bwd[OPF_##name](dx_, dr_, dw_, g_, gcs, gs_, gscs, x_, xcs, rstd, w_, wcs, n, eps,    \
                                                 offset);                                                              \
            return;                                                                                                    \
        }                                                                                                              \
        E *dx = dx_, *dr = dr_;                                                                                        \
        float *dw = dw_;                                                                                               \
        const E *g = g_, *gs = gs_, *x = x_, *w = w_;                                                                  \
        const __m512 vr = _mm512_set1_ps(rstd), one = _mm512_set1_ps(1.0f);                                            \
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;                                                                \
        int64_t i = 0;                                                                                                 \
        for (; i + 32 <= n; i += 32) {                                                                                 \
            __m512 we0 = w ? wn_##name(w + i, 0xffff, offset) : one;                                                   \
            __m512 we1 = w ? wn_##name(w + i + 16, 0xffff, offset) : one;                                              \
            __m512 g0 = LD(g + i, 0xffff), g1 = LD(g + i + 16, 0xffff);                                                \
            __m512 xh0 = _mm512_mul_ps(LD(x + i, 0xffff), vr), xh1 = _mm512_mul_ps(LD(x + i + 16, 0xffff), vr);        \
            acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(_mm512_mul_ps(g0, we0), xh0));                                    \
            acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(_mm512_mul_ps(g1, we1), xh1));                                    \
            if (dw)                                                                                                    \
                acc_add(dw + i, _mm512_mul_ps(g0, xh0), 0xffff), acc_add(dw + i + 16, _mm512_mul_ps(g1, xh1), 0xffff); \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 we = w ? wn_##name(w + i, m, offset) : one;                                                         \
            __m512 gi = LD(g + i, m), xh = _mm512_mul_ps(LD(x + i, m), vr);                                            \
            acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(_mm512_mul_ps(gi, we), xh));                                      \
            if (dw) acc_add(dw + i, _mm512_mul_ps(gi, xh), m);                                                         \
        }                                                                                                              \
        const __m512 vc = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) / (float)n);                  \
        for (i = 0; i < n; i += 16) {                                                                                  \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 we = w ? wn_##name(w + i, m, offset) : one;                                                         \
            __m512 gi = LD(g + i, m), xh = _mm512_mul_ps(LD(x + i, m), vr);                                            \
            __m512 d = _mm512_mul_ps(vr, _mm512_sub_ps(_mm512_mul_ps(gi, we), _mm512_mul_ps(xh, vc)));                 \
            if (gs) d = _mm512_add_ps(d, LD(gs + i, m));                                                               \
            ST(dx + i, d, m);                                                                                          \
            if (dr) ST(dr + i, d, m);                                                                                  \
        }                                                                                                              \
        (void)eps;                                                                                                     \
    }                                                                                                                  \
    static void ln_fwd_##name(void *y_, float *mean, float *rstd, const void *x_, int64_t xcs, const void *w_,         \
                              int64_t wcs, const void *b_, int64_t bcs, int64_t n, double eps) {                       \
        if (xcs != 1 || (w_ && wcs != 1) || (b_ && bcs != 1)) {                                                        \
            norm_kernels_ref.ln_fwd[OPF_##name](y_, mean, rstd, x_, xcs, w_, wcs, b_, bcs, n, eps);                    \
            return;                                                                                                    \
        }                                                                                                              \
        E *y = y_;                                                                                                     \
        const E *x = x_, *w = w_, *b = b_;                                                                             \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                    \
        int64_t i = 0;                                                                                                 \
        for (; i + 64 <= n; i += 64) {                                                                                 \
            a0 = _mm512_add_ps(a0, LD(x + i, 0xffff)), a1 = _mm512_add_ps(a1, LD(x + i + 16, 0xffff));                 \
            a2 = _mm512_add_ps(a2, LD(x + i + 32, 0xffff)), a3 = _mm512_add_ps(a3, LD(x + i + 48, 0xffff));            \
        }                                                                                                              \
        for (; i < n; i += 16) a0 = _mm512_add_ps(a0, LD(x + i, tail16(n - i)));                                       \
        const float mu = sum4x16(a0, a1, a2, a3) / (float)n;                                                           \
        const __m512 vm = _mm512_set1_ps(mu);                                                                          \
        a0 = a1 = a2 = a3 = _mm512_setzero_ps();                                                                       \
        for (i = 0; i + 64 <= n; i += 64) {                                                                            \
            __m512 d0 = _mm512_sub_ps(LD(x + i, 0xffff), vm), d1 = _mm512_sub_ps(LD(x + i + 16, 0xffff), vm);          \
            __m512 d2 = _mm512_sub_ps(LD(x + i + 32, 0xffff), vm), d3 = _mm512_sub_ps(LD(x + i + 48, 0xffff), vm);     \
            a0 = _mm512_fmadd_ps(d0, d0, a0), a1 = _mm512_fmadd_ps(d1, d1, a1);                                        \
            a2 = _mm512_fmadd_ps(d2, d2, a2), a3 = _mm512_fmadd_ps(d3, d3, a3);                                        \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 d = _mm512_maskz_sub_ps(m, LD(x + i, m), vm);                                                       \
            a0 = _mm512_fmadd_ps(d, d, a0);                                                                            \
        }                                                                                                              \
        const float rs = 1.0f / sqrtf(sum4x16(a0, a1, a2, a3) / (float)n + (float)eps);                                \
        *mean = mu, *rstd = rs;                                                                                        \
        const __m512 vr = _mm512_set1_ps(rs);                                                                          \
        for (i = 0; i < n; i += 16) {                                                                                  \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 o = _mm512_mul_ps(_mm512_sub_ps(LD(x + i, m), vm), vr);                                             \
            if (w) o = _mm512_mul_ps(o, LD(w + i, m));                                                                 \
            if (b) o = _mm512_add_ps(o, LD(b + i, m));                                                                 \
            ST(y + i, o, m);                                                                                           \
        }                                                                                                              \
    }                                                                                                                  \
    static void ln_bwd_##name(void *dx_, void *dw_, void *db_, const void *g_, int64_t gcs, const void *x_,            \
                              int64_t xcs, float mean, float rstd, const void *w_, int64_t wcs, int64_t n,             \
                              double eps) {                                                                            \
        if (gcs != 1 || xcs != 1 || (w_ && wcs != 1)) {                                                                \
            norm_kernels_ref.ln_bwd[OPF_##name](dx_, dw_, db_, g_, gcs, x_, xcs, mean, rstd, w_, wcs, n, eps);         \
            return;                                                                                                    \
        }                                                                                                              \
        E *dx = dx_;                                                                                                   \
        float *dw = dw_, *db = db_;                                                                                    \
        const E *g = g_, *x = x_, *w = w_;                                                                             \
        const __m512 vm = _mm512_set1_ps(mean), vr = _mm512_set1_ps(rstd), one = _mm512_set1_ps(1.0f);                 \
        __m512 sg0 = _mm512_setzero_ps(), sg1 = sg0, sgx0 = sg0, sgx1 = sg0;                                           \
        int64_t i = 0;                                                                                                 \
        for (; i + 32 <= n; i += 32) {                                                                                 \
            __m512 g0 = LD(g + i, 0xffff), g1 = LD(g + i + 16, 0xffff);                                                \
            __m512 gw0 = _mm512_mul_ps(g0, w ? LD(w + i, 0xffff) : one);                                               \
            __m512 gw1 = _mm512_mul_ps(g1, w ? LD(w + i + 16, 0xffff) : one);                                          \
            __m512 xh0 = _mm512_mul_ps(_mm512_sub_ps(LD(x + i, 0xffff), vm), vr);                                      \
            __m512 xh1 = _mm512_mul_ps(_mm512_sub_ps(LD(x + i + 16, 0xffff), vm), vr);                                 \
            sg0 = _mm512_add_ps(sg0, gw0), sg1 = _mm512_add_ps(sg1, gw1);                                              \
            sgx0 = _mm512_add_ps(sgx0, _mm512_mul_ps(gw0, xh0));                                                       \
            sgx1 = _mm512_add_ps(sgx1, _mm512_mul_ps(gw1, xh1));                                                       \
            if (dw)                                                                                                    \
                acc_add(dw + i, _mm512_mul_ps(g0, xh0), 0xffff), acc_add(dw + i + 16, _mm512_mul_ps(g1, xh1), 0xffff); \
            if (db) acc_add(db + i, g0, 0xffff), acc_add(db + i + 16, g1, 0xffff);                                     \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 gi = LD(g + i, m), gw = _mm512_mul_ps(gi, w ? LD(w + i, m) : one);                                  \
            __m512 xh = _mm512_mul_ps(_mm512_sub_ps(LD(x + i, m), vm), vr);                                            \
            sg0 = _mm512_add_ps(sg0, gw);                                                                              \
            sgx0 = _mm512_add_ps(sgx0, _mm512_mul_ps(gw, xh));                                                         \
            if (dw) acc_add(dw + i, _mm512_mul_ps(gi, xh), m);                                                         \
            if (db) acc_add(db + i, gi, m);                                                                            \
        }                                                                                                              \
        const __m512 va = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(sg0, sg1)) / (float)n);                    \
        const __m512 vc = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(sgx0, sgx1)) / (float)n);                  \
        for (i = 0; i < n; i += 16) {                                                                                  \
            __mmask16 m = tail16(n - i);                                                                               \
            __m512 gi = LD(g + i, m), xh = _mm512_mul_ps(_mm512_sub_ps(LD(x + i, m), vm), vr);                         \
            __m512 gw = _mm512_mul_ps(gi, w ? LD(w + i, m) : one);                                                     \
            ST(dx + i, _mm512_mul_ps(vr, _mm512_sub_ps(_mm512_sub_ps(gw, va), _mm512_mul_ps(xh, vc))), m);             \
        }                                                                                                              \
        (void)eps;                                                                                                     \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
NORM_AVX512(f32, float, ld16_f32, st16_f32, rt_f32)
NORM_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16, rt_bf16)
NORM_AVX512(f16, uint16_t, ld16_f16, st16_f16, rt_f16)

#define NORM_TABLE(fn) \
    { [OPF_F32] = fn##_f32, [OPF_BF16] = fn##_bf16, [OPF_F16] = fn##_f16 }

/* float64 (gradcheck's dtype) is left NULL: the drivers run the reference's */
const norm_kernels norm_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .rms_fwd = NORM_TABLE(rms_fwd),
    .rms_bwd = NORM_TABLE(rms_bwd),
    .ln_fwd = NORM_TABLE(ln_fwd),
    .ln_bwd = NORM_TABLE(ln_bwd),
};
