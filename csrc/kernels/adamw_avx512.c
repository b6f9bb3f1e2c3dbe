/*
 * adamw, AVX-512 (F, BW, VL, DQ): 16 lanes, tails masked (the same instructions as the body, so
 * every lane rounds as the reference does). The step moves 28 bytes per float32 element (read
 * param, grad, m, v; write param, m, v) for two divisions and a square root: it is bound by memory
 * bandwidth, and two vectors per iteration are enough to keep the loads in flight.
 */
#include <immintrin.h>

#include "adamw.h"
#include "rows_avx512.h"

typedef struct coef16 {
    __m512 sign, decay, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size;
    __mmask16 from_grad;
} coef16;

static inline coef16 coef16_of(const adamw_coef *c) {
    return (coef16){_mm512_set1_ps(c->sign),
                    _mm512_set1_ps(c->decay),
                    _mm512_set1_ps(c->lerp_coeff),
                    _mm512_set1_ps(c->beta2),
                    _mm512_set1_ps(c->c2),
                    _mm512_set1_ps(c->bc2_sqrt),
                    _mm512_set1_ps(c->eps),
                    _mm512_set1_ps(c->neg_step_size),
                    c->lerp_from_grad ? (__mmask16)0xffff : (__mmask16)0};
}

/* adamw_elem of adamw.c on 16 lanes: updates *m and *v, returns the new parameter */
static inline __m512 step16(__m512 p, __m512 *m, __m512 *v, __m512 g, const coef16 *c) {
    g = _mm512_mul_ps(g, c->sign);
    p = _mm512_mul_ps(p, c->decay);
    const __m512 base = _mm512_mask_blend_ps(c->from_grad, *m, g);
    *m = _mm512_fmadd_ps(c->coeff, _mm512_sub_ps(g, *m), base);
    *v = _mm512_fmadd_ps(_mm512_mul_ps(c->c2, g), g, _mm512_mul_ps(*v, c->beta2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(*v), c->bc2_sqrt), c->eps);
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->neg_step_size, *m), denom));
}

#define ADAMW_AVX512(name, E, LD, ST)                                                                       \
    static inline void block16_##name(E *p, float *m, float *v, const E *g, __mmask16 k, const coef16 *c) { \
        __m512 mv = ld16_f32(m, k), vv = ld16_f32(v, k);                                                    \
        const __m512 pv = step16(LD(p, k), &mv, &vv, LD(g, k), c);                                          \
        st16_f32(m, mv, k);                                                                                 \
        st16_f32(v, vv, k);                                                                                 \
        ST(p, pv, k);                                                                                       \
    }                                                                                                       \
    static void adamw_step_##name(void *param, float *m, float *v, const void *grad, int64_t n,             \
                                  const adamw_coef *coef) {                                                 \
        E *p = param;                                                                                       \
        const E *g = grad;                                                                                  \
        const coef16 c = coef16_of(coef);                                                                   \
        int64_t i = 0;                                                                                      \
        for (; i + 32 <= n; i += 32) {                                                                      \
            block16_##name(p + i, m + i, v + i, g + i, 0xffff, &c);                                         \
            block16_##name(p + i + 16, m + i + 16, v + i + 16, g + i + 16, 0xffff, &c);                     \
        }                                                                                                   \
        for (; i < n; i += 16) block16_##name(p + i, m + i, v + i, g + i, tail16(n - i), &c);               \
    }

ADAMW_AVX512(f32, float, ld16_f32, st16_f32)
ADAMW_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16)

const adamw_kernels adamw_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .step = {[OPF_F32] = adamw_step_f32, [OPF_BF16] = adamw_step_bf16},
};
