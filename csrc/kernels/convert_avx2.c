/* Conversions, AVX2 + F16C: 8 lanes, the scalar reference for the tail. */
#include <immintrin.h>

#include "convert.h"
#include "half_avx2.h"

static void to_f32_avx2(float *dst, const uint16_t *src, opf_dtype dt, int64_t n) {
    int64_t i = 0;
    if (dt == OPF_BF16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld_bf16(src + i));
    else
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld_f16(src + i));
    convert_kernels_ref.to_f32(dst + i, src + i, dt, n - i);
}

static void from_f32_avx2(uint16_t *dst, const float *src, opf_dtype dt, int64_t n) {
    int64_t i = 0;
    if (dt == OPF_BF16)
        for (; i + 8 <= n; i += 8) st_bf16(dst + i, _mm256_loadu_ps(src + i));
    else
        for (; i + 8 <= n; i += 8) st_f16(dst + i, _mm256_loadu_ps(src + i));
    convert_kernels_ref.from_f32(dst + i, src + i, dt, n - i);
}

const convert_kernels convert_kernels_avx2 = {
    .name = "avx2", .isa = OPF_ISA_AVX2, .to_f32 = to_f32_avx2, .from_f32 = from_f32_avx2};
