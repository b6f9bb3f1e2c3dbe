/*
 * Decoding attention kernels, AVX2 + FMA. A decode step is a few query rows against many keys, so the
 * scores are dot products along the head dim (two keys x up to four rows per pass: each K load feeds
 * four FMAs, each query load two), reduced four at a time with hadd; the softmax runs along a row's
 * keys with exp2_8z (math_avx2.h); P V broadcasts each probability over 32-float slivers of V rows,
 * two output rows at a time. K and V rows are float32, bfloat16 or float16 (converted on load, the
 * type a constant of each instantiation) and prefetched ATTENTION_DECODE_PF keys ahead. Tails of the head dims
 * are masked loads and stores (16-bit: through a zeroed 8-lane copy).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attention_decode.h"
#include "half_avx2.h"
#include "math_avx2.h"

static inline __attribute__((always_inline)) __m256 ld8(const int kt, const void *p, int64_t at) {
    if (kt == ATTENTION_DECODE_T_F32) return _mm256_loadu_ps((const float *)p + at);
    return kt == ATTENTION_DECODE_T_BF16 ? ld_bf16((const uint16_t *)p + at) : ld_f16((const uint16_t *)p + at);
}

/* the first n (< 8) elements, 0 in the other lanes */
static inline __attribute__((always_inline)) __m256 ld8_tail(const int kt, const void *p, int64_t at, int64_t n) {
    if (kt == ATTENTION_DECODE_T_F32) return _mm256_maskload_ps((const float *)p + at, lanes_below(n));
    uint16_t h[8] = {0};
    memcpy(h, (const uint16_t *)p + at, sizeof(uint16_t) * (size_t)n);
    return ld8(kt, h, 0);
}

/* the four sums of a0..a3's lanes, in that order */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s(i, j) for rows i < nr (nr <= 4) and keys j < nk (nk <= 2), nr and nk constants at each call */
static inline __attribute__((always_inline)) void dots(const int kt, const int nr, const int nk, float *s, int64_t lds,
                                                       const float *q, int64_t d, const void *k, int64_t k0,
                                                       int64_t ldk) {
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) {
        __m256 kv[2];
#pragma GCC unroll 2
        for (int j = 0; j < nk; j++) kv[j] = ld8(kt, k, k0 + j * ldk + e);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m256 qv = _mm256_loadu_ps(q + i * d + e);
#pragma GCC unroll 2
            for (int j = 0; j < nk; j++) acc[j][i] = _mm256_fmadd_ps(qv, kv[j], acc[j][i]);
        }
    }
    if (e < d) {
        const __m256i mask = lanes_below(d - e);
        __m256 kv[2];
#pragma GCC unroll 2
        for (int j = 0; j < nk; j++) kv[j] = ld8_tail(kt, k, k0 + j * ldk + e, d - e);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m256 qv = _mm256_maskload_ps(q + i * d + e, mask);
#pragma GCC unroll 2
            for (int j = 0; j < nk; j++) acc[j][i] = _mm256_fmadd_ps(qv, kv[j], acc[j][i]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < nk; j++) {
        float sums[4];
        _mm_storeu_ps(sums, hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) s[i * lds + j] = sums[i];
    }
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

static void scores_avx2(float *s, int64_t lds, const float *q, int64_t r, int64_t d, const void *k, int64_t ldk,
                        int64_t bk, opf_dtype kdt) {
    ATTENTION_DECODE_BY_TYPE(kdt, scores_t, s, lds, q, r, d, k, ldk, bk);
}

static float softmax_row_avx2(float *x, int64_t bk, int64_t keys, float *m, float *l, float unit) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vmax = ninf;
    int64_t j = 0;
    for (; j + 8 <= keys; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + j));
    if (j < keys) {
        const __m256 keep = _mm256_castsi256_ps(lanes_below(keys - j));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + j), keep));
    }
    const float mx = fmaxf(*m, hmax8(vmax));
    if (mx == -INFINITY) {
        for (j = 0; j < bk; j++) x[j] = 0.0f;
        return 1.0f;
    }
    const __m256 base = _mm256_set1_ps(mx), vunit = _mm256_set1_ps(unit);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= bk; j += 8) {
        __m256 e = exp2_8z(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), base), vunit));
        if (j + 8 > keys) e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes_below(keys - j)));
        _mm256_storeu_ps(x + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < bk) {
        const __m256i in = lanes_below(bk - j);
        __m256 e = exp2_8z(_mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(x + j, in), base), vunit));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes_below(keys - j)));
        _mm256_maskstore_ps(x + j, in, e);
        sum = _mm256_add_ps(sum, e);
    }
    const float alpha = exp2f((*m - mx) * unit);
    *l = *l * alpha + hsum8(sum);
    *m = mx;
    return alpha;
}

/* o rows i < nr (nr <= 2), columns [0, 8 nv) of the pointers given (masked: the first vector's first
 * `left` lanes only, nv = 1), += p v after scaling by alpha; v's rows from element v0, prefetched ahead
 * when pf; kt, nr, nv, masked constants at each call */
static inline __attribute__((always_inline)) void pv_tile(const int kt, const int nr, const int nv, const int masked,
                                                          float *o, int64_t dv, const float *alpha, const float *p,
                                                          int64_t ldp, int64_t bk, const void *v, int64_t v0,
                                                          int64_t ldv, int64_t left, int pf) {
    const __m256i mask = masked ? lanes_below(left) : _mm256_setzero_si256();
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int i = 0; i < nr; i++) {
        const __m256 a = _mm256_set1_ps(alpha[i]);
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++)
            acc[i][c] =
                _mm256_mul_ps(masked ? _mm256_maskload_ps(o + i * dv, mask) : _mm256_loadu_ps(o + i * dv + 8 * c), a);
    }
    for (int64_t j = 0; j < bk; j++) {
        if (pf) attention_decode_prefetch(kt, v, v0 + (j + ATTENTION_DECODE_PF) * ldv, 8 * nv);
        __m256 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++)
            vv[c] = masked ? ld8_tail(kt, v, v0 + j * ldv, left) : ld8(kt, v, v0 + j * ldv + 8 * c);
#pragma GCC unroll 2
        for (int i = 0; i < nr; i++) {
            const __m256 pij = _mm256_broadcast_ss(p + i * ldp + j);
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) acc[i][c] = _mm256_fmadd_ps(pij, vv[c], acc[i][c]);
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            if (masked)
                _mm256_maskstore_ps(o + i * dv, mask, acc[i][c]);
            else
                _mm256_storeu_ps(o + i * dv + 8 * c, acc[i][c]);
        }
}

/* the first row pair prefetches the block's successors; the others find the block in cache */
#define PV_COLS(NR)                                                                                             \
    do {                                                                                                        \
        int64_t e = 0;                                                                                          \
        for (; e + 32 <= dv; e += 32) pv_tile(kt, NR, 4, 0, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, 0, i == 0); \
        for (; e + 8 <= dv; e += 8) pv_tile(kt, NR, 1, 0, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, 0, i == 0);   \
        if (e < dv) pv_tile(kt, NR, 1, 1, oi + e, dv, ai, pi, ldp, bk, v, e, ldv, dv - e, i == 0);              \
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

static void pv_avx2(float *o, const float *alpha, const float *p, int64_t ldp, int64_t r, int64_t bk, const void *v,
                    int64_t ldv, int64_t dv, opf_dtype vdt) {
    ATTENTION_DECODE_BY_TYPE(vdt, pv_t, o, alpha, p, ldp, r, bk, v, ldv, dv);
}

const attention_decode_kernels attention_decode_kernels_avx2 = {.name = "avx2",
                                                                .isa = OPF_ISA_AVX2,
                                                                .cvt = &convert_kernels_avx2,
                                                                .scores = scores_avx2,
                                                                .softmax_row = softmax_row_avx2,
                                                                .pv = pv_avx2};
