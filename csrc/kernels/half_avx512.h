/*
 * 16-lane conversions between float32 and bfloat16 / float16, AVX-512 (F, BW). Included
 * by files built with the avx512 flags only. Rounding matches opforge/half.h:
 * nearest even, NaN -> 0x7fc0 for bfloat16.
 */
#ifndef OPFORGE_KERNELS_HALF_AVX512_H
#define OPFORGE_KERNELS_HALF_AVX512_H

#include <immintrin.h>

#include "opforge/half.h"

/* 16 floats rounded to bfloat16 (to nearest even, NaN quiet), each in the low half of its 32-bit lane */
static inline __m512i bf16_lanes(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

/* 16 bfloat16 to float32, exact: a bfloat16 is the high half of a float32 */
static inline __m512 bf16_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i round16x16(__m512 v, opf_dtype dt) {
    if (dt != OPF_BF16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    return _mm512_cvtepi32_epi16(bf16_lanes(v));
}

#endif
