/*
 * 8-wide conversions between float32 and the 16-bit float types, AVX2 + F16C.
 * Included by *_avx2.c files only (they are the ones built with -mavx2 -mf16c).
 * Rounding matches opforge/half.h: nearest even, NaN -> 0x7fc0 for bfloat16.
 */
#ifndef OPFORGE_KERNELS_HALF_AVX2_H
#define OPFORGE_KERNELS_HALF_AVX2_H

#include <immintrin.h>
#include <stdint.h>

static inline __m256 ld_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m128i bf16_round(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void st_bf16(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, bf16_round(v)); }

static inline __m256 ld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline void st_f16(uint16_t *p, __m256 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

#endif
