/*
 * <immintrin.h> for the emulated AVX-512 test build (make ctest-emulated): the
 * AVX-512 kernel files compiled for an AVX2 CPU, every 512-bit intrinsic they
 * use mapped onto SIMDe's portable implementation (Debian's libsimde-dev), so
 * that their logic (tails, masks, blocking, packing) is tested on machines
 * without AVX-512. It says nothing of speed, and of codegen only that the
 * sources compile; a real AVX-512 CPU runs the real build.
 *
 * The real header comes first (AVX2, F16C, FMA stay native). SIMDe's own native
 * aliases would redeclare gcc's __m512 types, so the names are mapped here one
 * by one: a kernel that uses an intrinsic missing below fails to compile in
 * this build ("target specific option mismatch"), and gets a line here.
 * Intrinsics SIMDe 0.7 lacks are written out below, with the instruction's
 * semantics: masked loads and stores touch only their lanes, a streaming store
 * faults on an address that is not 64-byte aligned, as the CPU's does.
 */
#ifndef OPFORGE_TEST_EMU_IMMINTRIN_H
#define OPFORGE_TEST_EMU_IMMINTRIN_H

#include_next <immintrin.h>

#include <simde/x86/avx512.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define __m512 simde__m512
#define __m512i simde__m512i
#define __m512d simde__m512d
#define __m512bh simde__m512bh

/* ---- provided by SIMDe -------------------------------------------------------------------- */
#define _mm512_abs_ps simde_mm512_abs_ps
#define _mm512_add_epi32 simde_mm512_add_epi32
#define _mm512_add_pd simde_mm512_add_pd
#define _mm512_add_ps simde_mm512_add_ps
#define _mm512_and_si512 simde_mm512_and_si512
#define _mm512_castps256_ps512 simde_mm512_castps256_ps512
#define _mm512_castps512_ps128 simde_mm512_castps512_ps128
#define _mm512_castps512_ps256 simde_mm512_castps512_ps256
#define _mm512_castps_si512 simde_mm512_castps_si512
#define _mm512_castsi256_si512 simde_mm512_castsi256_si512
#define _mm512_castsi512_ps simde_mm512_castsi512_ps
#define _mm512_cmp_ps_mask simde_mm512_cmp_ps_mask
#define _mm512_div_pd simde_mm512_div_pd
#define _mm512_div_ps simde_mm512_div_ps
#define _mm512_dpbf16_ps simde_mm512_dpbf16_ps
#define _mm512_extractf32x4_ps simde_mm512_extractf32x4_ps
#define _mm512_fmadd_ps simde_mm512_fmadd_ps
#define _mm512_fmsub_ps simde_mm512_fmsub_ps
#define _mm512_fnmadd_ps simde_mm512_fnmadd_ps
#define _mm512_insertf32x8 simde_mm512_insertf32x8
#define _mm512_inserti64x4 simde_mm512_inserti64x4
#define _mm512_load_ps simde_mm512_load_ps
#define _mm512_loadu_ps simde_mm512_loadu_ps
#define _mm512_loadu_si512 simde_mm512_loadu_si512
#define _mm512_mask_add_ps simde_mm512_mask_add_ps
#define _mm512_mask_blend_ps simde_mm512_mask_blend_ps
#define _mm512_mask_max_ps simde_mm512_mask_max_ps
#define _mm512_mask_mov_epi32 simde_mm512_mask_mov_epi32
#define _mm512_mask_sub_ps simde_mm512_mask_sub_ps
#define _mm512_max_ps simde_mm512_max_ps
#define _mm512_min_ps simde_mm512_min_ps
#define _mm512_maskz_mov_epi32 simde_mm512_maskz_mov_epi32
#define _mm512_maskz_mov_ps simde_mm512_maskz_mov_ps
#define _mm512_maskz_sub_ps simde_mm512_maskz_sub_ps
#define _mm512_mul_pd simde_mm512_mul_pd
#define _mm512_mul_ps simde_mm512_mul_ps
#define _mm512_or_si512 simde_mm512_or_si512
#define _mm512_permutex2var_epi64 simde_mm512_permutex2var_epi64
#define _mm512_roundscale_ps simde_mm512_roundscale_ps
#define _mm512_scalef_ps simde_mm512_scalef_ps
#define _mm512_set_epi64 simde_mm512_set_epi64
#define _mm512_set1_epi32 simde_mm512_set1_epi32
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#define _mm512_shuffle_i32x4 simde_mm512_shuffle_i32x4
#define _mm512_shuffle_ps simde_mm512_shuffle_ps
#define _mm512_set1_epi64 simde_mm512_set1_epi64
#define _mm512_set1_pd simde_mm512_set1_pd
#define _mm512_set1_ps simde_mm512_set1_ps
#define _mm512_setzero_ps simde_mm512_setzero_ps
#define _mm512_setzero_si512 simde_mm512_setzero_si512
#define _mm512_slli_epi32 simde_mm512_slli_epi32
#define _mm512_sqrt_pd simde_mm512_sqrt_pd
#define _mm512_sqrt_ps simde_mm512_sqrt_ps
#define _mm512_srli_epi32 simde_mm512_srli_epi32
#define _mm512_storeu_ps simde_mm512_storeu_ps
#define _mm512_storeu_si512 simde_mm512_storeu_si512
#define _mm512_sub_ps simde_mm512_sub_ps
#define _mm512_unpackhi_epi16 simde_mm512_unpackhi_epi16
#define _mm512_unpackhi_epi32 simde_mm512_unpackhi_epi32
#define _mm512_unpackhi_epi64 simde_mm512_unpackhi_epi64
#define _mm512_unpackhi_ps simde_mm512_unpackhi_ps
#define _mm512_unpacklo_epi16 simde_mm512_unpacklo_epi16
#define _mm512_unpacklo_epi32 simde_mm512_unpacklo_epi32
#define _mm512_unpacklo_epi64 simde_mm512_unpacklo_epi64
#define _mm512_unpacklo_ps simde_mm512_unpacklo_ps
#define _mm512_xor_si512 simde_mm512_xor_si512

/* ---- written out here ---------------------------------------------------------------------- */
static inline simde__m512 emu_maskz_loadu_ps(uint16_t k, const void *p) {
    simde__m512_private r;
    for (int i = 0; i < 16; i++) r.f32[i] = (k >> i) & 1 ? ((const float *)p)[i] : 0.0f;
    return simde__m512_from_private(r);
}
static inline simde__m512 emu_mask_loadu_ps(simde__m512 src, uint16_t k, const void *p) {
    simde__m512_private r = simde__m512_to_private(src);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) r.f32[i] = ((const float *)p)[i];
    return simde__m512_from_private(r);
}
static inline void emu_mask_storeu_epi32(void *p, uint16_t k, simde__m512i a) {
    simde__m512i_private v = simde__m512i_to_private(a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((int32_t *)p)[i] = v.i32[i];
}
static inline simde__m512d emu_maskz_loadu_pd(uint8_t k, const void *p) {
    simde__m512d_private r;
    for (int i = 0; i < 8; i++) r.f64[i] = (k >> i) & 1 ? ((const double *)p)[i] : 0.0;
    return simde__m512d_from_private(r);
}
static inline void emu_mask_storeu_ps(void *p, uint16_t k, simde__m512 a) {
    simde__m512_private v = simde__m512_to_private(a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((float *)p)[i] = v.f32[i];
}
static inline void emu_mask_storeu_pd(void *p, uint8_t k, simde__m512d a) {
    simde__m512d_private v = simde__m512d_to_private(a);
    for (int i = 0; i < 8; i++)
        if ((k >> i) & 1) ((double *)p)[i] = v.f64[i];
}
static inline __m256i emu_maskz_loadu_epi16(uint16_t k, const void *p) {
    uint16_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (k >> i) & 1 ? ((const uint16_t *)p)[i] : 0;
    return _mm256_loadu_si256((const __m256i *)r);
}
static inline simde__m512i emu_maskz_loadu_epi16_512(uint32_t k, const void *p) {
    simde__m512i_private r;
    for (int i = 0; i < 32; i++) r.u16[i] = (k >> i) & 1 ? ((const uint16_t *)p)[i] : 0;
    return simde__m512i_from_private(r);
}
static inline void emu_mask_storeu_epi16(void *p, uint16_t k, __m256i a) {
    uint16_t v[16];
    _mm256_storeu_si256((__m256i *)v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((uint16_t *)p)[i] = v[i];
}
static inline void emu_stream_ps(void *p, simde__m512 a) {
    if ((uintptr_t)p % 64) abort(); /* #GP on the CPU */
    simde_mm512_storeu_ps(p, a);
}
/* the order of gcc's _mm512_reduce_*_ps: halves, then quarters, ... */
static inline float emu_reduce_add_ps(simde__m512 a) {
    simde__m512_private v = simde__m512_to_private(a);
    float t[8];
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = (w == 8 ? v.f32[i] + v.f32[i + 8] : t[i] + t[i + w]);
    return t[0];
}
static inline float emu_reduce_max_ps(simde__m512 a) {
    simde__m512_private v = simde__m512_to_private(a);
    float t[8];
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) {
            const float x = w == 8 ? v.f32[i] : t[i], y = w == 8 ? v.f32[i + 8] : t[i + w];
            t[i] = x > y ? x : y; /* maxps: the second operand unless the first is greater */
        }
    return t[0];
}
static inline float emu_cvtss_f32(simde__m512 a) { return simde__m512_to_private(a).f32[0]; }
static inline simde__m256 emu_extractf32x8_ps(simde__m512 a, int i) { return simde__m512_to_private(a).m256[i & 1]; }
static inline simde__m512 emu_cvtph_ps(__m256i h) {
    simde__m512_private r;
    r.m256[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    r.m256[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return simde__m512_from_private(r);
}
#define emu_cvtps_ph(a, rounding)                                                                         \
    _mm256_set_m128i(_mm256_cvtps_ph(simde__m512_to_private(a).m256[1], (rounding) & 7),                  \
                     _mm256_cvtps_ph(simde__m512_to_private(a).m256[0], (rounding) & 7))
static inline simde__m512i emu_cvtepu16_epi32(__m256i h) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
    r.m256i[1] = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
    return simde__m512i_from_private(r);
}
static inline simde__m512i emu_cvtps_epi32(simde__m512 a) { /* rounds as MXCSR says: to nearest even */
    simde__m512_private v = simde__m512_to_private(a);
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtps_epi32(v.m256[0]);
    r.m256i[1] = _mm256_cvtps_epi32(v.m256[1]);
    return simde__m512i_from_private(r);
}
static inline __m256i emu_cvtepi32_epi16(simde__m512i a) { /* truncates */
    simde__m512i_private v = simde__m512i_to_private(a);
    int16_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (int16_t)v.i32[i];
    return _mm256_loadu_si256((const __m256i *)r);
}
static inline simde__m512 emu_permute_ps(simde__m512 a, int imm) { /* within each 128-bit lane */
    simde__m512_private v = simde__m512_to_private(a), r;
    for (int i = 0; i < 16; i++) r.f32[i] = v.f32[(i & ~3) + ((imm >> 2 * (i & 3)) & 3)];
    return simde__m512_from_private(r);
}

#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#define _mm512_mask_loadu_ps emu_mask_loadu_ps
#define _mm512_maskz_loadu_pd emu_maskz_loadu_pd
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#define _mm512_mask_storeu_pd emu_mask_storeu_pd
#define _mm512_mask_storeu_epi32 emu_mask_storeu_epi32
#define _mm256_maskz_loadu_epi16 emu_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 emu_maskz_loadu_epi16_512
#define _mm256_mask_storeu_epi16 emu_mask_storeu_epi16
#define _mm512_stream_ps emu_stream_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps
#define _mm512_cvtss_f32 emu_cvtss_f32
#define _mm512_extractf32x8_ps emu_extractf32x8_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#define _mm512_cvtps_ph emu_cvtps_ph
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_cvtps_epi32 emu_cvtps_epi32
#define _mm512_cvtepi32_epi16 emu_cvtepi32_epi16
#define _mm512_permute_ps emu_permute_ps

#endif
