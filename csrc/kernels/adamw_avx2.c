/*
 * adamw, AVX2 + FMA (+ F16C for the conversion header): 8 lanes; the tail of each run goes through
 * the reference, which rounds as these lanes do (the lerp's FMA is fmaf there).
 */
#include <immintrin.h>

#include "adamw.h"
#include "half_avx2.h"

typedef struct coef8 {
    __m256 sign, decay, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size, from_grad;
} coef8;

static inline coef8 coef8_of(const adamw_coef *c) {
    return (coef8){_mm256_set1_ps(c->sign),
                   _mm256_set1_ps(c->decay),
                   _mm256_set1_ps(c->lerp_coeff),
                   _mm256_set1_ps(c->beta2),
                   _mm256_set1_ps(c->c2),
                   _mm256_set1_ps(c->bc2_sqrt),
                   _mm256_set1_ps(c->eps),
                   _mm256_set1_ps(c->neg_step_size),
                   _mm256_castsi256_ps(_mm256_set1_epi32(c->lerp_from_grad ? -1 : 0))};
}

/* adamw_elem of adamw.c on 8 lanes: updates *m and *v, returns the new parameter */
static inline __m256 step8(__m256 p, __m256 *m, __m256 *v, __m256 g, const coef8 *c) {
    g = _mm256_mul_ps(g, c->sign);
    p = _mm256_mul_ps(p, c->decay);
    const __m256 base = _mm256_blendv_ps(*m, g, c->from_grad);
    *m = _mm256_fmadd_ps(c->coeff, _mm256_sub_ps(g, *m), base);
    *v = _mm256_fmadd_ps(_mm256_mul_ps(c->c2, g), g, _mm256_mul_ps(*v, c->beta2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(*v), c->bc2_sqrt), c->eps);
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->neg_step_size, *m), denom));
}

#define ADAMW_AVX2(name, E, LD, ST, DT)                                                         \
    static void adamw_step_##name(void *param, float *m, float *v, const void *grad, int64_t n, \
                                  const adamw_coef *coef) {                                     \
        E *p = param;                                                                           \
        const E *g = grad;                                                                      \
        const coef8 c = coef8_of(coef);                                                         \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8) {                                                            \
            __m256 mv = ld_f32(m + i), vv = ld_f32(v + i);                                      \
            const __m256 pv = step8(LD(p + i), &mv, &vv, LD(g + i), &c);                        \
            st_f32(m + i, mv);                                                                  \
            st_f32(v + i, vv);                                                                  \
            ST(p + i, pv);                                                                      \
        }                                                                                       \
        adamw_kernels_ref.step[DT](p + i, m + i, v + i, g + i, n - i, coef);                    \
    }

ADAMW_AVX2(f32, float, ld_f32, st_f32, OPF_F32)
ADAMW_AVX2(bf16, uint16_t, ld_bf16, st_bf16, OPF_BF16)

const adamw_kernels adamw_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .step = {[OPF_F32] = adamw_step_f32, [OPF_BF16] = adamw_step_bf16},
};
