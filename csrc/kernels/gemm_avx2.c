/*
 * GEMM micro-kernel, AVX2 + FMA: 6 x 16 floats of C in 12 ymm accumulators,
 * one broadcast of A and two loads of B per k (15 of 16 registers). Full tiles
 * run the epilogue (beta, bias, pre-activation store, activation) in
 * registers; partial tiles go through the scalar epilogue.
 *
 * Blocks (Zen 3 / Skylake-class): a B sliver KC x 16 = 16 KiB stays in L1,
 * an A block MC x KC = 120 KiB in L2, a B panel KC x NC = 3 MiB in L3.
 */
#include <immintrin.h>
#include <math.h>

#include "gemm.h"
#include "half_avx2.h"
#include "math_avx2.h"

/* ---- vector math for the activations (fp32 accuracy, ~1-2 ulp) ------------------------ */

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|): no overflow, exact sign */
static inline __m256 tanh8(__m256 u) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, u);
    __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_or_ps(t, _mm256_and_ps(u, sign));
}

/* erf(x), Abramowitz-Stegun 7.1.26 refined: |error| < 1.5e-7 */
static inline __m256 erf8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    __m256 a = _mm256_andnot_ps(sign, x);
    __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    __m256 y = _mm256_fnmadd_ps(p, exp8(_mm256_mul_ps(_mm256_mul_ps(a, a), _mm256_set1_ps(-1.0f))), one);
    return _mm256_or_ps(y, _mm256_and_ps(x, sign));
}

static inline __m256 act8(int act, __m256 v) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    switch (act) {
    case GEMM_ACT_RELU: /* max(v, 0) with NaN kept: blend where v < 0 */
        return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    case GEMM_ACT_GELU:
        return _mm256_mul_ps(_mm256_mul_ps(half, v),
                             _mm256_add_ps(one, erf8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f)))));
    case GEMM_ACT_GELU_TANH: {
        __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        return _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, tanh8(u)));
    }
    case GEMM_ACT_SILU:
        return _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
    default: return v;
    }
}

static inline void store8(float *c, float *pre, __m256 v, const gemm_tile *t, const float *bias_n,
                          float bias_m) {
    if (t->load_c) v = _mm256_fmadd_ps(_mm256_set1_ps(t->beta), _mm256_loadu_ps(c), v);
    if (bias_n) v = _mm256_add_ps(v, _mm256_loadu_ps(bias_n));
    if (t->bias_m) v = _mm256_add_ps(v, _mm256_set1_ps(bias_m));
    if (pre) _mm256_storeu_ps(pre, v);
    _mm256_storeu_ps(c, act8(t->act, v));
}

#define MR 6
#define NR 16

static void ukernel_avx2_6x16(int64_t kc, const float *ap, const float *bp, float *c, int64_t rsc, int m,
                              int n, const gemm_tile *t) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int i = 0; i < m; i++) { /* the tile is read or written after the loop: start fetching it now */
        _mm_prefetch((const char *)(c + i * rsc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * rsc + 15), _MM_HINT_T0);
    }
    for (int64_t p = 0; p < kc; p++, ap += MR, bp += NR) {
        __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8), a;
        a = _mm256_broadcast_ss(ap + 0); c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(ap + 1); c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(ap + 2); c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(ap + 3); c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(ap + 4); c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(ap + 5); c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    if (m == MR && n == NR) {
        for (int i = 0; i < MR; i++) {
            float *pre = t->pre ? t->pre + i * t->rsp : NULL;
            float bm = t->bias_m ? t->bias_m[i] : 0.0f;
            store8(c + i * rsc, pre, acc[i][0], t, t->bias_n, bm);
            store8(c + i * rsc + 8, pre ? pre + 8 : NULL, acc[i][1], t, t->bias_n ? t->bias_n + 8 : NULL, bm);
        }
        return;
    }
    float buf[MR * NR];
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(buf + i * NR, acc[i][0]);
        _mm256_storeu_ps(buf + i * NR + 8, acc[i][1]);
    }
    gemm_tile_store(buf, NR, c, rsc, m, n, t);
}

static inline __m256 act_grad8(int act, __m256 x) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    switch (act) {
    case GEMM_ACT_RELU: return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ), one);
    case GEMM_ACT_GELU: {
        __m256 cdf = _mm256_mul_ps(half, _mm256_add_ps(one, erf8(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)))));
        __m256 pdf = _mm256_mul_ps(exp8(_mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_mul_ps(x, x))),
                                   _mm256_set1_ps(0.3989422804014327f));
        return _mm256_fmadd_ps(x, pdf, cdf);
    }
    case GEMM_ACT_GELU_TANH: {
        const __m256 k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
        __m256 x2 = _mm256_mul_ps(x, x);
        __m256 t = tanh8(_mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x2), x, x)));
        __m256 left = _mm256_mul_ps(half, _mm256_add_ps(one, t));
        __m256 dt = _mm256_fnmadd_ps(t, t, one);
        __m256 inner = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(3.0f), c), x2, one));
        return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), dt), inner, left);
    }
    case GEMM_ACT_SILU: {
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        return _mm256_mul_ps(s, _mm256_fmadd_ps(x, _mm256_sub_ps(one, s), one));
    }
    default: return one;
    }
}

static void act_grad_avx2(float *out, const float *g, const float *pre, int64_t n, int act) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), act_grad8(act, _mm256_loadu_ps(pre + i))));
    for (; i < n; i++) out[i] = g[i] * gemm_act_grad_f32(act, pre[i]);
}

static void to_f32_avx2(float *dst, const uint16_t *src, int dt, int64_t n) {
    int64_t i = 0;
    if (dt == OPF_BF16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld_bf16(src + i));
    else
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld_f16(src + i));
    gemm_kernels_ref.to_f32(dst + i, src + i, dt, n - i);
}

static void from_f32_avx2(uint16_t *dst, const float *src, int dt, int64_t n) {
    int64_t i = 0;
    if (dt == OPF_BF16)
        for (; i + 8 <= n; i += 8) st_bf16(dst + i, _mm256_loadu_ps(src + i));
    else
        for (; i + 8 <= n; i += 8) st_f16(dst + i, _mm256_loadu_ps(src + i));
    gemm_kernels_ref.from_f32(dst + i, src + i, dt, n - i);
}

const gemm_kernels gemm_kernels_avx2 = {"avx2_6x16", MR, NR, 120, 384, 3072, ukernel_avx2_6x16, act_grad_avx2,
                                        to_f32_avx2, from_f32_avx2};
