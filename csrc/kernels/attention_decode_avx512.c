/*
 * Decoding attention kernels, AVX-512 (F, BW, VL, DQ): the 16-lane twins of attention_decode_avx2.c.
 * Scores are dot products along the head dim (four keys x up to four rows per pass; a full pass's 16
 * sums reduced as one tree, sums16), the softmax runs along a row's keys with exp2_16z (math_avx512.h),
 * P V broadcasts each probability over 64-float slivers of V rows, four output rows at a time. K and V
 * rows are float32, bfloat16 or float16 (converted on load, the type a constant of each instantiation)
 * and prefetched ATTENTION_DECODE_PF keys ahead. Every tail is a masked load or store.
 *
 * On a 2-core Xeon with AVX-512 (cpuid model 167, 2 threads; alternating processes, B1 H32 Hkv8 D128,
 * 1 or 4 new tokens, 512 or 4096 keys) the tree and the four-row P V ran 1.07-1.29x the two keys x four
 * rows of one reduction a score and the two-row P V whose V loads the compiler had repeated per row.
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

/* The lane sums of 16 vectors v[4 j + i] (i, j < 4), in one fixed order, as a tree: 128-bit quarter i
 * of the result holds the sums of v[i], v[4 + i], v[8 + i], v[12 + i]. 45 shuffles and adds for the 16
 * sums, where one reduction each takes ~8. */
static inline __m512 sums16(const __m512 a[4][4]) {
    const __m512 *v = &a[0][0];
    __m512 x[8], y[4];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) /* quarters: v[2t]'s halves added (2), v[2t + 1]'s (2) */
        x[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0xee));
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) /* quarter u: four partial sums of v[4t + u] */
        y[t] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0xdd));
    /* quarter u of t0: [a0 b0 a1 b1], a = v[u]'s, b = v[4 + u]'s; t1 the same of v[8 + u], v[12 + u] */
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
    const __m512i d0 = _mm512_castps_si512(t0), d1 = _mm512_castps_si512(t1);
    return _mm512_add_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi64(d0, d1)),
                         _mm512_castsi512_ps(_mm512_unpackhi_epi64(d0, d1)));
}

/* s(i, j) for rows i < nr (nr <= 4) and keys j < nk (nk <= 4), nr and nk constants at each call. Four rows x
 * four keys (the blocks' bulk) are summed by sums16, each row's four scores one 128-bit store; other
 * shapes (tails) one reduction a score. */
static inline __attribute__((always_inline)) void dots(const int kt, const int nr, const int nk, float *s, int64_t lds,
                                                       const float *q, int64_t d, const void *k, int64_t k0,
                                                       int64_t ldk) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) acc[j][i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
        const __mmask16 m = tail16(d - e);
        __m512 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < nk; j++) kv[j] = ld16(kt, k, k0 + j * ldk + e, m);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + i * d + e);
#pragma GCC unroll 4
            for (int j = 0; j < nk; j++) acc[j][i] = _mm512_fmadd_ps(qv, kv[j], acc[j][i]);
        }
    }
    if (nr == 4 && nk == 4) {
        const __m512 sum = sums16(acc);
        _mm_storeu_ps(s, _mm512_castps512_ps128(sum));
        _mm_storeu_ps(s + lds, _mm512_extractf32x4_ps(sum, 1));
        _mm_storeu_ps(s + 2 * lds, _mm512_extractf32x4_ps(sum, 2));
        _mm_storeu_ps(s + 3 * lds, _mm512_extractf32x4_ps(sum, 3));
        return;
    }
#pragma GCC unroll 4
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
    for (; j + 4 <= bk; j += 4) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) attention_decode_prefetch(kt, k, (j + ATTENTION_DECODE_PF + u) * ldk, d);
        for (int64_t i = 0; i < r; i += 4) DOTS_ROWS(4)
    }
    for (; j < bk; j++) {
        attention_decode_prefetch(kt, k, (j + ATTENTION_DECODE_PF) * ldk, d);
        for (int64_t i = 0; i < r; i += 4) DOTS_ROWS(1)
    }
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

/* o rows i < nr (nr <= 4), columns [0, 16 nv) (masked: the first vector's lanes in `mask` only, nv =
 * 1), += p v after scaling by alpha; v's rows from element v0, prefetched ahead when pf; kt, nr, nv,
 * masked constants at each call. Each V vector is loaded once into a register for the nr rows (the
 * compiler would otherwise fold a load into every row's multiply-add: twice the loads, and the loads,
 * not the multiply-adds, would set the pace). */
static inline __attribute__((always_inline)) void pv_tile(const int kt, const int nr, const int nv, const int masked,
                                                          float *o, int64_t dv, const float *alpha, const float *p,
                                                          int64_t ldp, int64_t bk, const void *v, int64_t v0,
                                                          int64_t ldv, __mmask16 mask, int pf) {
    const __mmask16 m = masked ? mask : (__mmask16)0xffff;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) acc[i][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, o + i * dv + 16 * c), a);
    }
    for (int64_t j = 0; j < bk; j++) {
        if (pf) attention_decode_prefetch(kt, v, v0 + (j + ATTENTION_DECODE_PF) * ldv, 16 * nv);
        __m512 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            vv[c] = ld16(kt, v, v0 + j * ldv + 16 * c, m);
#ifndef OPF_EMULATE_AVX512
            __asm__("" : "+v"(vv[c])); /* a register: loaded once for the nr rows */
#endif
        }
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m512 pij = _mm512_set1_ps(p[i * ldp + j]);
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) acc[i][c] = _mm512_fmadd_ps(pij, vv[c], acc[i][c]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) _mm512_mask_storeu_ps(o + i * dv + 16 * c, m, acc[i][c]);
}

/* the first rows prefetch the block's successors; the others find the block in cache */
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
    for (int64_t i = 0; i < r; i += 4) {
        float *oi = o + i * dv;
        const float *ai = alpha + i, *pi = p + i * ldp;
        switch (r - i < 4 ? r - i : 4) {
        case 4: PV_COLS(4); break;
        case 3: PV_COLS(3); break;
        case 2: PV_COLS(2); break;
        default: PV_COLS(1); break;
        }
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
