/*
 * 8-wide loads and stores of float32 and the 16-bit float types (converted to
 * and from float32), AVX2 + F16C, with non-temporal twins of the stores.
 * Included by *_avx2.c files only (they are the ones built with -mavx2 -mf16c).
 * Rounding matches opforge/half.h: nearest even, NaN -> 0x7fc0 for bfloat16.
 */
#ifndef OPFORGE_KERNELS_HALF_AVX2_H
#define OPFORGE_KERNELS_HALF_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m256 ld_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void st_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }

/* 8 bfloat16 to float32, exact: a bfloat16 is the high half of a float32 */
static inline __m256 bf16_widen8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 ld_bf16(const uint16_t *p) { return bf16_widen8(_mm_loadu_si128((const __m128i *)p)); }

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

/* Non-temporal twins of the stores (aligned addresses only): for outputs too large to stay cached, a
 * streaming store skips reading each line before overwriting it */
static inline void nt_f32(float *p, __m256 v) { _mm256_stream_ps(p, v); }
static inline void nt_bf16(uint16_t *p, __m256 v) { _mm_stream_si128((__m128i *)p, bf16_round(v)); }
static inline void nt_f16(uint16_t *p, __m256 v) {
    _mm_stream_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

/* ldn_NAME / stn_NAME: n elements of type E, a whole vector from n = 8 on, else through a zero-padded
 * 8-element copy, so that a row's tail goes through the same vector code as its body (and its sums see
 * zeros). A macro, instantiated by the files that use it: glu_avx2.c's ldn / stn are strided and
 * rows_avx2.h's padded with a fill. */
#define PAD8_IO(name, E)                                       \
    static inline __m256 ldn_##name(const E *p, int64_t n) {   \
        if (n >= 8) return ld_##name(p);                       \
        E b[8] = {0};                                          \
        memcpy(b, p, (size_t)n * sizeof(E));                   \
        return ld_##name(b);                                   \
    }                                                          \
    static inline void stn_##name(E *p, __m256 v, int64_t n) { \
        if (n >= 8) {                                          \
            st_##name(p, v);                                   \
            return;                                            \
        }                                                      \
        E b[8];                                                \
        st_##name(b, v);                                       \
        memcpy(p, b, (size_t)n * sizeof(E));                   \
    }

#endif
