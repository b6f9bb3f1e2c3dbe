/*
 * Decoding attention kernels, AVX-512 (F, BW, VL, DQ): the 16-lane twins of attention_decode_avx2.c.
 * Scores are dot products along the head dim (two keys x up to four rows per pass), the softmax runs
 * along a row's keys with exp2_16z (math_avx512.h), P V broadcasts each probability over 64-float
 * slivers of V rows, two output rows at a time. K and V rows are float32, bfloat16 or float16
 * (converted on load, the type a constant of each instantiation) and prefetched ATTENTION_DECODE_PF keys ahead.
 * Every tail is a masked load or store.
 */
#include <immintrin.h>
#include <math.h>

#include "attention_decode.h"
#include "math_avx512.h"
#include "rows_avx512.h"

static inline __attribute__((always_inline)) __m512 ld16(const int kt, const void *p, int64_t at, __mmask16 m) {
    if (kt == ATTENTION_DECODE_T_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + at);
    return kt == ATTENTION_DECODE_T_BF16 ? ld16_bf16((const uint16_t *)p + at, m)
                                         : ld16_f16((const uint16_t *)p + at, m);
}

/* s(i, j) for rows i < nr (nr <= 4) and keys j < nk (nk <= 2), nr and nk constants at each call */
static inline __attribute__((always_inline)) void dots(const int kt, const int nr, const int nk, float *s, int64_t lds,
                                                       const float *q, int64_t d, const void *k, int64_t k0,
                                                       int64_t ldk) {
    __m512 acc[2][4];
#pragma GCC unroll 2
    for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) acc[j][i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
        const __mmask16 m = tail16(d - e);
        __m512 kv[2];
#pragma GCC unroll 2
        for (int j = 0; j < nk; j++) kv[j] = ld16(kt, k, k0 + j * ldk + e, m);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + i * d + e);
#pragma GCC unroll 2
            for (int j = 0; j < nk; j++) acc[j][i] = _mm512_fmadd_ps(qv, kv[j], acc[j][i]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) s[i * lds + j] = _mm512_reduce_add_ps(acc[j][i]);
}

#define DOTS_ROWS(NK)                                                                     \
    switch (r - i < 4 ? r - i : 4) {                                                      \
    case 4: dots(kt, 4, NK, s + i * lds + j, lds, q + i * d, d, k, j * ldk, ldk); break;  \
    case 3: dots(kt, 3, NK, s + i * lds + j, lds, q + i * d, d, k, j * ldk, ldk); break;  \
    case 2: dots(kt, 2, NK, s + i * lds + j, lds, q + i * d, d, k, j * ldk, ldk); break;  \
    default: dots(kt, 1, NK, s + i * lds + j, lds, q + i * d, d, k, j * ldk, ldk); break; \
    }

static inline __attribute__((always_inline)) void scores_t(const int kt, float *s, int64_t lds, const float *q,
                                                           int64_t r, int64_t d, const void *k, int64_t ldk,
                                                           int64_t bk) {
    int64_t j = 0;
    for (; j + 2 <= bk; j += 2) {
        attention_decode_prefetch(kt, k, (j + ATTENTION_DECODE_PF) * ldk, d);
        attention_decode_prefetch(kt, k, (j + ATTENTION_DECODE_PF + 1) * ldk, d);
        for (int64_t i = 0; i < r; i += 4) DOTS_ROWS(2)
    }
    if (j < bk)
        for (int64_t i = 0; i < r; i += 4) DOTS_ROWS(1)
}

static void scores_avx512(float *s, int64_t lds, const float *q, int64_t r, int64_t d, const void *k, int64_t ldk,
                          int64_t bk, opf_dtype kdt) {
    ATTENTION_DECODE_BY_TYPE(kdt, scores_t, s, lds, q, r, d, k, ldk, bk);
}

static float softmax_row_avx512(float *x, int64_t bk, int64_t keys, float *m, float *l, float unit) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail16(keys - j), x + j));
    const float mx = fmaxf(*m, _mm512_reduce_max_ps(vmax));
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < bk; j += 16) _mm512_mask_storeu_ps(x + j, tail16(bk - j), _mm512_setzero_ps());
        return 1.0f;
    }
    const __m512 base = _mm512_set1_ps(mx), vunit = _mm512_set1_ps(unit);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < bk; j += 16) {
        const __mmask16 in = tail16(bk - j), keep = keys > j ? tail16(keys - j) : 0;
        const __m512 e = _mm512_maskz_mov_ps(
            keep, exp2_16z(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, x + j), base), vunit)));
        _mm512_mask_storeu_ps(x + j, in, e);
        sum = _mm512_add_ps(sum, e);
    }
    const float alpha = exp2f((*m - mx) * unit);
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mx;
    return alpha;
}

/* o rows i < nr (nr <= 2), columns [0, 16 nv) (masked: the first vector's lanes in `mask` only, nv =
 * 1), += p v after scaling by alpha; v's rows from element v0, prefetched ahead when pf; kt, nr, nv,
 * masked constants at each call */
static inline __attribute__((always_inline)) void pv_tile(const int kt, const int nr, const int nv, const int masked,
                                                          float *o, int64_t dv, const float *alpha, const float *p,
                                                          int64_t ldp, int64_t bk, const void *v, int64_t v0,
                                                          int64_t ldv, __mmask16 mask, int pf) {
    const __mmask16 m = masked ? mask : (__mmask16)0xffff;
    __m512 acc[2][4];
#pragma GCC unroll 2
    for (int i = 0; i < nr; i++) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) acc[i][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, o + i * dv + 16 * c), a);
    }
    for (int64_t j = 0; j < bk; j++) {
        if (pf) attention_decode_prefetch(kt, v, v0 + (j + ATTENTION_DECODE_PF) * ldv, 16 * nv);
        __m512 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) vv[c] = ld16(kt, v, v0 + j * ldv + 16 * c, m);
#pragma GCC unroll 2
        for (int i = 0; i < nr; i++) {
            const __m512 pij = _mm512_set1_ps(p[i * ldp + j]);
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) acc[i][c] = _mm512_fmadd_ps(pij, vv[c], acc[i][c]);
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) _mm512_mask_storeu_ps(o + i * dv + 16 * c, m, acc[i][c]);
}

/* the first row pair prefetches the block's successors; the others find the block in cache */
#define PV_COLS(NR)                                                                                                  \
    do {                                                                                                             \
        int64_t e = 0;                                                                                               \
        for (; e + 64 <= dv; e += 64) pv_tile(kt, NR, 4, 0, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, 0xffff, i == 0); \
        for (; e + 16 <= dv; e += 16) pv_tile(kt, NR, 1, 0, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, 0xffff, i == 0); \
        if (e < dv) pv_tile(kt, NR, 1, 1, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, tail16(dv - e), i == 0);           \
    } while (0)

static inline __attribute__((always_inline)) void pv_t(const int kt, float *o, const float *alpha, const float *p,
                                                       int64_t ldp, int64_t r, int64_t bk, const void *v, int64_t ldv,
                                                       int64_t dv) {
    for (int64_t i = 0; i < r; i += 2) {
        float *oi = o + i * dv;
        const float *ai = alpha + i, *pi = p + i * ldp;
        if (r - i >= 2)
            PV_COLS(2);
        else
            PV_COLS(1);
    }
}

static void pv_avx512(float *o, const float *alpha, const float *p, int64_t ldp, int64_t r, int64_t bk, const void *v,
                      int64_t ldv, int64_t dv, opf_dtype vdt) {
    ATTENTION_DECODE_BY_TYPE(vdt, pv_t, o, alpha, p, ldp, r, bk, v, ldv, dv);
}

const attention_decode_kernels attention_decode_kernels_avx512 = {.name = "avx512",
                                                                  .isa = OPF_ISA_AVX512,
                                                                  .cvt = &convert_kernels_avx512,
                                                                  .scores = scores_avx512,
                                                                  .softmax_row = softmax_row_avx512,
                                                                  .pv = pv_avx512};
