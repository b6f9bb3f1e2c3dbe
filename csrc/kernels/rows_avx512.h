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

#endif
