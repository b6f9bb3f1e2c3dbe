/*
 * Gated linear units, AVX-512 (F, BW, VL, DQ): 16 lanes through act16 of
 * act_avx512.h (exp / erf / tanh to ~1-2 ulp). Unit-stride tails use
 * masked loads and stores; strided operands are gathered into a 16-element
 * block, so every element goes through the same code whatever its stride or
 * position (results independent of the thread split). float64 runs the
 * reference (libm in double: the gradcheck path).
 */
#include <immintrin.h>

#include "act_avx512.h"
#include "glu.h"
#include "rows_avx512.h"

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

GLU_BLOCK_IO(f32, float, ld16_f32, st16_f32)
GLU_BLOCK_IO(bf16, uint16_t, ld16_bf16, st16_bf16)
GLU_BLOCK_IO(f16, uint16_t, ld16_f16, st16_f16)

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
            glu_head(dgate, sizeof(E)) == glu_head(dup, sizeof(E)) && dgate != gate) {                               \
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
