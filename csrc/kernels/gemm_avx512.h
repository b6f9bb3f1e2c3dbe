/*
 * AVX-512 pieces the AVX-512 and AMX GEMM kernels share: the 16-lane
 * epilogue (beta, bias, pre-activation, activation, 16-bit rounding) and the
 * tile prefetch. Include from files built with the avx512
 * flags only.
 */
#ifndef OPFORGE_KERNELS_GEMM_AVX512_H
#define OPFORGE_KERNELS_GEMM_AVX512_H

#include <immintrin.h>

#include "act_avx2.h"
#include "gemm.h"
#include "half_avx512.h"

/* The skinny product of the AVX-512 tables (gemm_skinny_fn; gemm_avx512.c) */
void gemm_skinny_avx512(int64_t m, int64_t k, const float *a, const void *b, int b16, int64_t ldb, int64_t j0,
                        int64_t j1, float *out, int64_t ldo);
/* ... and its pair form (gemm_skinny_pairs_fn), for the tables with AVX512-BF16 */
void gemm_skinny_avx512bf16(int64_t m, int64_t k, const uint16_t *a16, int64_t lda, const uint16_t *b, int64_t ldb,
                            int64_t j0, int64_t j1, float *out, int64_t ldo);

/* 16 columns of one row: c / pre are float32 (NULL when unused), c16 / pre16 16-bit */
static inline void store16(float *c, float *pre, uint16_t *c16, uint16_t *pre16, __m512 v, const gemm_tile *t,
                           const float *bias_n, float bias_m) {
    if (t->alpha) v = _mm512_mul_ps(v, _mm512_set1_ps(*t->alpha));
    if (t->load_c) v = _mm512_fmadd_ps(_mm512_set1_ps(t->beta), _mm512_loadu_ps(c), v);
    if (bias_n) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_n));
    if (t->bias_m) v = _mm512_add_ps(v, _mm512_set1_ps(bias_m));
    if (pre) _mm512_storeu_ps(pre, v);
    if (pre16) _mm256_storeu_si256((__m256i *)pre16, round16x16(v, t->dt16));
    if (t->act != ACT_NONE)
        v = _mm512_insertf32x8(_mm512_castps256_ps512(act8(t->act, _mm512_castps512_ps256(v))),
                               act8(t->act, _mm512_extractf32x8_ps(v, 1)), 1);
    if (c16)
        _mm256_storeu_si256((__m256i *)c16, round16x16(v, t->dt16));
    else
        _mm512_storeu_ps(c, v);
}

/* Row i of a full 32-column tile (lo: columns 0-15, hi: 16-31) through the epilogue */
static inline void store_row32(float *c, int64_t rsc, int i, __m512 lo, __m512 hi, const gemm_tile *t) {
    float *ci = t->c16 && !t->load_c ? NULL : c + i * rsc, *pre = t->pre ? t->pre + i * t->rsp : NULL;
    uint16_t *c16 = t->c16 ? t->c16 + i * rsc : NULL, *pre16 = t->pre16 ? t->pre16 + i * t->rsp : NULL;
    float bm = t->bias_m ? t->bias_m[i] : 0.0f;
    store16(ci, pre, c16, pre16, lo, t, t->bias_n, bm);
    store16(ci ? ci + 16 : NULL, pre ? pre + 16 : NULL, c16 ? c16 + 16 : NULL, pre16 ? pre16 + 16 : NULL, hi, t,
            t->bias_n ? t->bias_n + 16 : NULL, bm);
}

/* the tile is read or written after the K loop: start fetching it now */
static inline void prefetch_tile(const float *c, int64_t rsc, int m, const gemm_tile *t) {
    for (int i = 0; i < m; i++) {
        if (t->c16) {
            _mm_prefetch((const char *)(t->c16 + i * rsc), _MM_HINT_T0);
            _mm_prefetch((const char *)(t->c16 + i * rsc + 31), _MM_HINT_T0);
        }
        if (!t->c16 || t->load_c) {
            _mm_prefetch((const char *)(c + i * rsc), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + i * rsc + 31), _MM_HINT_T0);
        }
    }
}

#endif
