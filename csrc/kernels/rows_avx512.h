/*
 * Rows on 16 lanes for every AVX-512 kernel (built with the avx512 flags: F,
 * BW, VL, DQ), the twin of rows_avx2.h: the mask of a row's tail and the
 * loads and stores of each element type. Every load and store takes a lane
 * mask (tails are masked, never a scalar loop); loads give 0 in masked-off
 * lanes. The vector math is math_avx512.h's.
 */
#ifndef OPFORGE_KERNELS_ROWS_AVX512_H
#define OPFORGE_KERNELS_ROWS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "half_avx512.h"

/* the first `left` lanes: none when left <= 0, all when left >= 16 */
static inline __mmask16 tail16(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* the sum of the lanes of four accumulators (a reduction's chains), (a + b) + (c + d) */
static inline float sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

static inline __m512 ld16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void st16_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 ld16_bf16(const uint16_t *p, __mmask16 m) { return bf16_widen16(_mm256_maskz_loadu_epi16(m, p)); }
static inline void st16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_BF16));
}
static inline __m512 ld16_f16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline void st16_f16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_F16));
}

/* ---- bfloat16 pairs (two K steps in one 32-bit lane, the low half first), the form the AVX512-BF16
 * and AMX-BF16 products read ---- */

/* 16 pairs (x[2i], x[2i+1]) of n <= 32 consecutive floats (zeros past n), as 16 32-bit lanes: 16 floats
 * rounded and narrowed to 16 bfloat16 in order are 8 such pairs */
static inline __m512i pairs_of32(const float *x, int64_t n) {
    const __m256i p0 = _mm512_cvtepi32_epi16(bf16_lanes(_mm512_maskz_loadu_ps(tail16(n), x)));
    const __m256i p1 = _mm512_cvtepi32_epi16(bf16_lanes(_mm512_maskz_loadu_ps(tail16(n - 16), x + 16)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(p0), p1, 1);
}

/* B (k x n) from 16-bit rows (B(p, j) = b[p * rs + j]) as 32-column slivers of `pairs` >= (k + 1) / 2
 * pair rows each (pair q of column j at sliver[q * 32 + j]), zeros past k and n: two rows' 32 columns
 * interleaved by 16-bit unpacks (pairs of columns 8L .. 8L + 3 and 8L + 4 .. 8L + 7 per 128-bit lane L),
 * then put in column order */
static inline void b16_slivers(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n, int64_t pairs) {
    const int64_t kp = (k + 1) / 2;
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0),
                  second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t j = 0; j < n; j += 32) {
        uint32_t *sliver = bp + j / 32 * pairs * 32;
        const int64_t left = n - j;
        const __mmask32 m = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
        for (int64_t q = 0; q < kp; q++) {
            const uint16_t *r0 = b + 2 * q * rs + j;
            const __m512i lo = _mm512_maskz_loadu_epi16(m, r0),
                          hi = 2 * q + 1 < k ? _mm512_maskz_loadu_epi16(m, r0 + rs) : _mm512_setzero_si512();
            const __m512i a = _mm512_unpacklo_epi16(lo, hi), c = _mm512_unpackhi_epi16(lo, hi);
            _mm512_storeu_si512(sliver + q * 32, _mm512_permutex2var_epi64(a, first, c));
            _mm512_storeu_si512(sliver + q * 32 + 16, _mm512_permutex2var_epi64(a, second, c));
        }
        for (int64_t q = kp; q < pairs; q++) {
            _mm512_storeu_si512(sliver + q * 32, _mm512_setzero_si512());
            _mm512_storeu_si512(sliver + q * 32 + 16, _mm512_setzero_si512());
        }
    }
}

#endif
