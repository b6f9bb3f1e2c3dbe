/*
 * Rotary position embedding, AVX2 + F16C: 8 lanes. Half-split rows pair the
 * blocks at j and j + R/2; interleaved rows swap neighbours inside a register
 * (permute). The end of each half (or of R) is a zero-padded block through the
 * same code. Multiplies and adds stay separate (no FMA), so float32 matches
 * the reference bit for bit. Rows with a non-unit stride, and float64, run
 * the reference.
 */
#include <immintrin.h>
#include <string.h>

#include "half_avx2.h"
#include "rope.h"

PAD8_IO(f32, float)
PAD8_IO(bf16, uint16_t)
PAD8_IO(f16, uint16_t)

#define ROPE_AVX2(name, E)                                                                                            \
    static void rope_row_##name(void *out_, const void *x_, const void *cos_, const void *sin_, int64_t d, int64_t r, \
                                int64_t os, int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse) {       \
        if (os != 1 || xs != 1 || cs != 1 || ss != 1) {                                                               \
            rope_kernels_ref.row[OPF_##name](out_, x_, cos_, sin_, d, r, os, xs, cs, ss, interleaved, inverse);       \
            return;                                                                                                   \
        }                                                                                                             \
        E *out = out_;                                                                                                \
        const E *x = x_, *c = cos_, *s = sin_;                                                                        \
        const __m256 neg = _mm256_set1_ps(-0.0f);                                                                     \
        if (interleaved) {                                                                                            \
            /* the sign of rot on even lanes (forward) or odd lanes (transpose) */                                    \
            const __m256 flip = inverse ? _mm256_setr_ps(0, -0.0f, 0, -0.0f, 0, -0.0f, 0, -0.0f)                      \
                                        : _mm256_setr_ps(-0.0f, 0, -0.0f, 0, -0.0f, 0, -0.0f, 0);                     \
            for (int64_t j = 0; j < r; j += 8) {                                                                      \
                int64_t m = r - j < 8 ? r - j : 8;                                                                    \
                __m256 xv = ldn_##name(x + j, m), cv = ldn_##name(c + j, m), sv = ldn_##name(s + j, m);               \
                __m256 rx = _mm256_xor_ps(_mm256_permute_ps(xv, 0xb1), flip);                                         \
                if (inverse) sv = _mm256_permute_ps(sv, 0xb1);                                                        \
                stn_##name(out + j, _mm256_add_ps(_mm256_mul_ps(xv, cv), _mm256_mul_ps(rx, sv)), m);                  \
            }                                                                                                         \
        } else {                                                                                                      \
            const int64_t h = r / 2;                                                                                  \
            for (int64_t j = 0; j < h; j += 8) {                                                                      \
                int64_t m = h - j < 8 ? h - j : 8;                                                                    \
                __m256 x1 = ldn_##name(x + j, m), x2 = ldn_##name(x + h + j, m);                                      \
                __m256 c1 = ldn_##name(c + j, m), c2 = ldn_##name(c + h + j, m);                                      \
                __m256 s1 = ldn_##name(s + j, m), s2 = ldn_##name(s + h + j, m);                                      \
                /* forward: x1 c1 - x2 s1 and x2 c2 + x1 s2; transpose: x1 c1 + x2 s2 and x2 c2 - x1 s1 */            \
                __m256 a = inverse ? s2 : _mm256_xor_ps(s1, neg), b = inverse ? _mm256_xor_ps(s1, neg) : s2;          \
                stn_##name(out + j, _mm256_add_ps(_mm256_mul_ps(x1, c1), _mm256_mul_ps(x2, a)), m);                   \
                stn_##name(out + h + j, _mm256_add_ps(_mm256_mul_ps(x2, c2), _mm256_mul_ps(x1, b)), m);               \
            }                                                                                                         \
        }                                                                                                             \
        if (d > r) memcpy(out + r, x + r, (size_t)(d - r) * sizeof(E));                                               \
    }

#define OPF_f32 OPF_F32
#define OPF_bf16 OPF_BF16
#define OPF_f16 OPF_F16
ROPE_AVX2(f32, float)
ROPE_AVX2(bf16, uint16_t)
ROPE_AVX2(f16, uint16_t)

static void rope_row_f64(void *out, const void *x, const void *cos, const void *sin, int64_t d, int64_t r, int64_t os,
                         int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse) {
    rope_kernels_ref.row[OPF_F64](out, x, cos, sin, d, r, os, xs, cs, ss, interleaved, inverse);
}

const rope_kernels rope_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .row = {[OPF_F32] = rope_row_f32, [OPF_F64] = rope_row_f64, [OPF_BF16] = rope_row_bf16, [OPF_F16] = rope_row_f16},
};
