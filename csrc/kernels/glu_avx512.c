/*
 * Gated linear units, AVX-512 (F, BW, VL, DQ): 16 lanes, the same
 * activations as act_avx2.h (exp to ~1-2 ulp, erf by Abramowitz-Stegun
 * 7.1.26 refined, tanh from exp) widened to 16 lanes. Unit-stride tails use
 * masked loads and stores; strided operands are gathered into a 16-element
 * block, so every element goes through the same code whatever its stride or
 * position (results independent of the thread split). float64 runs the
 * reference (libm in double: the gradcheck path).
 */
#include <immintrin.h>

#include "glu.h"
#include "half_avx512.h"

/* math_avx2.h's exp8 widened: NaN kept by the clamp's operand order, 0 below -87.68 (-inf included) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-88.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 sign_of(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}
static inline __m512 abs16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}
static inline __m512 or16(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) */
static inline __m512 tanh16(__m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp16(_mm512_mul_ps(abs16(u), _mm512_set1_ps(-2.0f)));
    return or16(_mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)), sign_of(u));
}

/* erf(x), |error| < 1.5e-7; *e = exp(-x^2) */
static inline __m512 erf16e(__m512 x, __m512 *e) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 a = abs16(x);
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    *e = exp16(_mm512_mul_ps(_mm512_mul_ps(a, a), _mm512_set1_ps(-1.0f)));
    return or16(_mm512_fnmadd_ps(p, *e, one), sign_of(x));
}

/* act(x); with da, also act'(x), sharing the exponential */
static inline __m512 act16(act_kind act, __m512 x, __m512 *da) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    switch (act) {
    case ACT_SILU: {
        __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        if (da) *da = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
        return _mm512_mul_ps(x, s);
    }
    case ACT_GELU: {
        __m512 e;
        __m512 cdf =
            _mm512_mul_ps(half, _mm512_add_ps(one, erf16e(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)), &e)));
        if (da) *da = _mm512_fmadd_ps(x, _mm512_mul_ps(e, _mm512_set1_ps(0.3989422804014327f)), cdf);
        return _mm512_mul_ps(x, cdf);
    }
    case ACT_GELU_TANH: {
        const __m512 k = _mm512_set1_ps(0.7978845608028654f), c = _mm512_set1_ps(0.044715f);
        __m512 x2 = _mm512_mul_ps(x, x);
        __m512 t = tanh16(_mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(c, x2), x, x)));
        __m512 left = _mm512_mul_ps(half, _mm512_add_ps(one, t));
        if (da) {
            __m512 dt = _mm512_fnmadd_ps(t, t, one);
            __m512 inner = _mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(3.0f), c), x2, one));
            *da = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(half, x), dt), inner, left);
        }
        return _mm512_mul_ps(x, left);
    }
    default:
        if (da) *da = one;
        return x;
    }
}

static inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

static inline __m512 ld_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void st_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 ld_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void st_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_BF16));
}
static inline __m512 ld_f16(const uint16_t *p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
static inline void st_f16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round16x16(v, OPF_F16));
}

/* m <= 16 elements at stride s: masked at unit stride, else through a block */
#define GLU_BLOCK_IO(name, E, LD, ST)                                     \
    static inline __m512 ldn_##name(const E *p, int64_t s, int64_t m) {   \
        if (s == 1) return LD(p, tail16(m));                              \
        E b[16];                                                          \
        for (int64_t e = 0; e < m; e++) b[e] = p[e * s];                  \
        return LD(b, tail16(m));                                          \
    }                                                                     \
    static inline void stn_##name(E *p, int64_t s, int64_t m, __m512 v) { \
        if (s == 1) {                                                     \
            ST(p, v, tail16(m));                                          \
            return;                                                       \
        }                                                                 \
        E b[16];                                                          \
        ST(b, v, 0xffff);                                                 \
        for (int64_t e = 0; e < m; e++) p[e * s] = b[e];                  \
    }

GLU_BLOCK_IO(f32, float, ld_f32, st_f32)
GLU_BLOCK_IO(bf16, uint16_t, ld_bf16, st_bf16)
GLU_BLOCK_IO(f16, uint16_t, ld_f16, st_f16)

/* Non-temporal stores of a whole aligned block (64 bytes for float32, 32 for the 16-bit types). */
static inline void nt_f32(float *p, __m512 v) { _mm512_stream_ps(p, v); }
static inline void nt_bf16(uint16_t *p, __m512 v) { _mm256_stream_si256((__m256i *)p, round16x16(v, OPF_BF16)); }
static inline void nt_f16(uint16_t *p, __m512 v) { _mm256_stream_si256((__m256i *)p, round16x16(v, OPF_F16)); }

/* Unit-stride runs that write more than this stream their output past the caches (see glu_avx2.c). */
#define GLU_STREAM_MIN_BYTES ((int64_t)8 << 20)

/* elements before the first 16-element block of p aligned for a non-temporal store */
static inline int64_t glu_head(const void *p, size_t es) {
    const uintptr_t align = 16 * es;
    return (int64_t)((align - (uintptr_t)p % align) % align / es);
}

#define GLU_AVX512(name, E)                                                                                          \
    static void glu_fwd_##name(void *out_, const void *gate_, const void *up_, int64_t n, int64_t os, int64_t gs,    \
                               int64_t us, act_kind act) {                                                           \
        E *out = out_;                                                                                               \
        const E *gate = gate_, *up = up_;                                                                            \
        int64_t i = 0;                                                                                               \
        if (os == 1 && gs == 1 && us == 1 && n * (int64_t)sizeof(E) >= GLU_STREAM_MIN_BYTES) {                       \
            const int64_t head = glu_head(out, sizeof(E));                                                           \
            if (head > 0)                                                                                            \
                stn_##name(out, 1, head,                                                                             \
                           _mm512_mul_ps(act16(act, ldn_##name(gate, 1, head), NULL), ldn_##name(up, 1, head)));     \
            for (i = head; i + 16 <= n; i += 16)                                                                     \
                nt_##name(out + i,                                                                                   \
                          _mm512_mul_ps(act16(act, ldn_##name(gate + i, 1, 16), NULL), ldn_##name(up + i, 1, 16)));  \
            _mm_sfence();                                                                                            \
        }                                                                                                            \
        for (; i < n; i += 16) {                                                                                     \
            int64_t m = n - i < 16 ? n - i : 16;                                                                     \
            __m512 a = act16(act, ldn_##name(gate + i * gs, gs, m), NULL);                                           \
            stn_##name(out + i * os, os, m, _mm512_mul_ps(a, ldn_##name(up + i * us, us, m)));                       \
        }                                                                                                            \
    }                                                                                                                \
    static inline void glu_bwd16_##name(E *dgate, E *dup, const E *grad, const E *gate, const E *up, int64_t m,      \
                                        int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act, int nt) {      \
        __m512 g = ldn_##name(grad, rs, m), da;                                                                      \
        __m512 a = act16(act, ldn_##name(gate, gs, m), &da);                                                         \
        __m512 u = ldn_##name(up, us, m);                                                                            \
        __m512 dg = _mm512_mul_ps(_mm512_mul_ps(g, u), da), du = _mm512_mul_ps(g, a);                                \
        if (nt) {                                                                                                    \
            nt_##name(dgate, dg);                                                                                    \
            nt_##name(dup, du);                                                                                      \
        } else {                                                                                                     \
            stn_##name(dgate, ds, m, dg);                                                                            \
            stn_##name(dup, ds, m, du);                                                                              \
        }                                                                                                            \
    }                                                                                                                \
    static void glu_bwd_##name(void *dgate_, void *dup_, const void *grad_, const void *gate_, const void *up_,      \
                               int64_t n, int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act) {            \
        E *dgate = dgate_, *dup = dup_;                                                                              \
        const E *grad = grad_, *gate = gate_, *up = up_;                                                             \
        int64_t i = 0;                                                                                               \
        if (ds == 1 && rs == 1 && gs == 1 && us == 1 && 2 * n * (int64_t)sizeof(E) >= GLU_STREAM_MIN_BYTES &&        \
            glu_head(dgate, sizeof(E)) == glu_head(dup, sizeof(E))) {                                                \
            const int64_t head = glu_head(dgate, sizeof(E));                                                         \
            if (head > 0) glu_bwd16_##name(dgate, dup, grad, gate, up, head, 1, 1, 1, 1, act, 0);                    \
            for (i = head; i + 16 <= n; i += 16)                                                                     \
                glu_bwd16_##name(dgate + i, dup + i, grad + i, gate + i, up + i, 16, 1, 1, 1, 1, act, 1);            \
            _mm_sfence();                                                                                            \
        }                                                                                                            \
        for (; i < n; i += 16) {                                                                                     \
            int64_t m = n - i < 16 ? n - i : 16;                                                                     \
            glu_bwd16_##name(dgate + i * ds, dup + i * ds, grad + i * rs, gate + i * gs, up + i * us, m, ds, rs, gs, \
                             us, act, 0);                                                                            \
        }                                                                                                            \
    }

GLU_AVX512(f32, float)
GLU_AVX512(bf16, uint16_t)
GLU_AVX512(f16, uint16_t)

/* float64: the reference's libm loop */
static void glu_fwd_f64(void *out, const void *gate, const void *up, int64_t n, int64_t os, int64_t gs, int64_t us,
                        act_kind act) {
    glu_kernels_ref.fwd[OPF_F64](out, gate, up, n, os, gs, us, act);
}

static void glu_bwd_f64(void *dgate, void *dup, const void *grad, const void *gate, const void *up, int64_t n,
                        int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act) {
    glu_kernels_ref.bwd[OPF_F64](dgate, dup, grad, gate, up, n, ds, rs, gs, us, act);
}

const glu_kernels glu_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .fwd = {[OPF_F32] = glu_fwd_f32, [OPF_F64] = glu_fwd_f64, [OPF_BF16] = glu_fwd_bf16, [OPF_F16] = glu_fwd_f16},
    .bwd = {[OPF_F32] = glu_bwd_f32, [OPF_F64] = glu_bwd_f64, [OPF_BF16] = glu_bwd_bf16, [OPF_F16] = glu_bwd_f16},
};
