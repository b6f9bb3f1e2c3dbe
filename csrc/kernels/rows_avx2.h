/*
 * Row helpers of the AVX2 softmax-like kernels (softmax_avx2.c,
 * cross_entropy_avx2.c), built with -mavx2 -mfma -mf16c: the scalar and
 * r < 8 element loads and stores of each element type, through a buffer
 * (loads padded with fill); the 8-float ones are half_avx2.h's, exp8z and
 * the horizontal max and sum math_avx2.h's.
 */
#ifndef OPFORGE_KERNELS_ROWS_AVX2_H
#define OPFORGE_KERNELS_ROWS_AVX2_H

#include <immintrin.h>
#include <math.h>

#include "half_avx2.h"
#include "math_avx2.h"
#include "opforge/half.h"

static inline float ld1_f32(const float *p) { return *p; }
static inline void st1_f32(float *p, float v) { *p = v; }
static inline float ld1_bf16(const uint16_t *p) { return opf_bf16_to_f32(*p); }
static inline void st1_bf16(uint16_t *p, float v) { *p = opf_f32_to_bf16(v); }
static inline float ld1_f16(const uint16_t *p) { return opf_f16_to_f32(*p); }
static inline void st1_f16(uint16_t *p, float v) { *p = opf_f32_to_f16(v); }

#define SOFTMAX_TAIL_IO(name, E)                                             \
    static inline __m256 ldn_##name(const E *p, int64_t r, float fill) {     \
        float b[8];                                                          \
        for (int i = 0; i < 8; i++) b[i] = i < r ? ld1_##name(p + i) : fill; \
        return _mm256_loadu_ps(b);                                           \
    }                                                                        \
    static inline void stn_##name(E *p, int64_t r, __m256 v) {               \
        float b[8];                                                          \
        _mm256_storeu_ps(b, v);                                              \
        for (int i = 0; i < r; i++) st1_##name(p + i, b[i]);                 \
    }
SOFTMAX_TAIL_IO(f32, float)
SOFTMAX_TAIL_IO(bf16, uint16_t)
SOFTMAX_TAIL_IO(f16, uint16_t)

#endif
