/* Conversions, AVX-512: 16 lanes, masked tails (rounding as opforge/half.h). */
#include <immintrin.h>

#include "convert.h"
#include "rows_avx512.h"

static void to_f32_avx512(float *dst, const uint16_t *src, opf_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail16(n - i);
        __m256i h = _mm256_maskz_loadu_epi16(m, src + i);
        __m512 v = dt == OPF_BF16 ? bf16_widen16(h) : _mm512_cvtph_ps(h);
        _mm512_mask_storeu_ps(dst + i, m, v);
    }
}

static void from_f32_avx512(uint16_t *dst, const float *src, opf_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail16(n - i);
        _mm256_mask_storeu_epi16(dst + i, m, round16x16(_mm512_maskz_loadu_ps(m, src + i), dt));
    }
}

const convert_kernels convert_kernels_avx512 = {
    .name = "avx512", .isa = OPF_ISA_AVX512, .to_f32 = to_f32_avx512, .from_f32 = from_f32_avx512};
