/*
 * Rotary position embedding, AVX-512 (F, BW, VL, DQ): 16 lanes, the AVX2
 * file's structure with masked loads and stores for the end of each half (or
 * of R). Multiplies and adds stay separate (no FMA): float32 matches the
 * reference bit for bit. Rows with a non-unit stride, and float64, run the
 * reference.
 */
#include <immintrin.h>
#include <string.h>

#include "rope.h"
#include "rows_avx512.h"

static inline __m512 xor16(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

#define ROPE_AVX512(name, E, LD, ST)                                                                                  \
    static void rope_row_##name(void *out_, const void *x_, const void *cos_, const void *sin_, int64_t d, int64_t r, \
                                int64_t os, int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse) {       \
        if (os != 1 || xs != 1 || cs != 1 || ss != 1) {                                                               \
            rope_kernels_ref.row[OPF_##name](out_, x_, cos_, sin_, d, r, os, xs, cs, ss, interleaved, inverse);       \
            return;                                                                                                   \
        }                                                                                                             \
        E *out = out_;                                                                                                \
        const E *x = x_, *c = cos_, *s = sin_;                                                                        \
        const __m512 neg = _mm512_set1_ps(-0.0f);                                                                     \
        if (interleaved) {                                                                                            \
            /* the sign of rot on even lanes (forward) or odd lanes (transpose) */                                    \
            const __m512 even = _mm512_castsi512_ps(_mm512_set1_epi64((long long)0x80000000ull));                     \
            const __m512 odd = _mm512_castsi512_ps(_mm512_set1_epi64((long long)0x8000000000000000ull));              \
            const __m512 flip = inverse ? odd : even;                                                                 \
            for (int64_t j = 0; j < r; j += 16) {                                                                     \
                __mmask16 m = tail16(r - j);                                                                          \
                __m512 xv = LD(x + j, m), cv = LD(c + j, m), sv = LD(s + j, m);                                       \
                __m512 rx = xor16(_mm512_permute_ps(xv, 0xb1), flip);                                                 \
                if (inverse) sv = _mm512_permute_ps(sv, 0xb1);                                                        \
                ST(out + j, _mm512_add_ps(_mm512_mul_ps(xv, cv), _mm512_mul_ps(rx, sv)), m);                          \
            }                                                                                                         \
        } else {                                                                                                      \
            const int64_t h = r / 2;                                                                                  \
            for (int64_t j = 0; j < h; j += 16) {                                                                     \
                __mmask16 m = tail16(h - j);                                                                          \
                __m512 x1 = LD(x + j, m), x2 = LD(x + h + j, m);                                                      \
                __m512 c1 = LD(c + j, m), c2 = LD(c + h + j, m);                                                      \
                __m512 s1 = LD(s + j, m), s2 = LD(s + h + j, m);                                                      \
                __m512 a = inverse ? s2 : xor16(s1, neg), b = inverse ? xor16(s1, neg) : s2;                          \
                ST(out + j, _mm512_add_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(x2, a)), m);                           \
                ST(out + h + j, _mm512_add_ps(_mm512_mul_ps(x2, c2), _mm512_mul_ps(x1, b)), m);                       \
            }                                                                                                         \
        }                                                                                                             \
        if (d > r) memcpy(out + r, x + r, (size_t)(d - r) * sizeof(E));                                               \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
ROPE_AVX512(f32, float, ld16_f32, st16_f32)
ROPE_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16)
ROPE_AVX512(f16, uint16_t, ld16_f16, st16_f16)

static void rope_row_f64(void *out, const void *x, const void *cos, const void *sin, int64_t d, int64_t r, int64_t os,
                         int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse) {
    rope_kernels_ref.row[OPF_F64](out, x, cos, sin, d, r, os, xs, cs, ss, interleaved, inverse);
}

const rope_kernels rope_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .row = {[OPF_F32] = rope_row_f32, [OPF_F64] = rope_row_f64, [OPF_BF16] = rope_row_bf16, [OPF_F16] = rope_row_f16},
};
