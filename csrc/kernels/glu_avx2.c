/*
 * Gated linear units, AVX2 + FMA + F16C: 8 lanes through act_avx2.h's
 * activations (act8 forward, act_pair8 backward; exp / erf / tanh to ~1-2
 * ulp). Strided operands are gathered into an 8-element block and the end of
 * a run is padded to one, so every element goes through the same vector code
 * whatever its stride or position (results independent of the thread split).
 * float64 runs the reference (libm in double: the gradcheck path).
 */
#include <immintrin.h>

#include "act_avx2.h"
#include "glu.h"
#include "half_avx2.h"

/* LDn / STn: m <= 8 elements at stride s, through a zero-padded block unless
 * the 8 lie side by side. */
#define GLU_BLOCK_IO(name, E, LD, ST)                                     \
    static inline __m256 ldn_##name(const E *p, int64_t s, int64_t m) {   \
        if (m == 8 && s == 1) return LD(p);                               \
        E b[8] = {0};                                                     \
        for (int64_t e = 0; e < m; e++) b[e] = p[e * s];                  \
        return LD(b);                                                     \
    }                                                                     \
    static inline void stn_##name(E *p, int64_t s, int64_t m, __m256 v) { \
        if (m == 8 && s == 1) {                                           \
            ST(p, v);                                                     \
            return;                                                       \
        }                                                                 \
        E b[8];                                                           \
        ST(b, v);                                                         \
        for (int64_t e = 0; e < m; e++) p[e * s] = b[e];                  \
    }

GLU_BLOCK_IO(f32, float, ld_f32, st_f32)
GLU_BLOCK_IO(bf16, uint16_t, ld_bf16, st_bf16)
GLU_BLOCK_IO(f16, uint16_t, ld_f16, st_f16)

/* Unit-stride runs that write more than this stream their output past the caches: such an output cannot
 * stay cached anyway, and a non-temporal store skips reading each line before overwriting it (a quarter
 * of the forward's memory traffic, two sevenths of the backward's). The elements before the first
 * aligned block go through the same vector code as a padded block, so values do not change. A backward
 * written over gate and up (glu_backward_) stores as usual: it has just read those lines, and a
 * non-temporal store would write them back and store them again (2048 x 1408 float32 on the Xeon with
 * AMX: 1.47x the time of the out-of-place call with non-temporal stores, 0.96x with plain ones). */
#define GLU_STREAM_MIN_BYTES ((int64_t)8 << 20)

/* elements before the first 8-element block of p aligned for a non-temporal store */
static inline int64_t glu_head(const void *p, size_t es) {
    const uintptr_t align = 8 * es;
    return (int64_t)((align - (uintptr_t)p % align) % align / es);
}

#define GLU_AVX2(name, E)                                                                                           \
    static void glu_fwd_##name(void *out_, const void *gate_, const void *up_, int64_t n, int64_t os, int64_t gs,   \
                               int64_t us, act_kind act) {                                                          \
        E *out = out_;                                                                                              \
        const E *gate = gate_, *up = up_;                                                                           \
        int64_t i = 0;                                                                                              \
        if (os == 1 && gs == 1 && us == 1 && n * (int64_t)sizeof(E) >= GLU_STREAM_MIN_BYTES) {                      \
            const int64_t head = glu_head(out, sizeof(E));                                                          \
            if (head > 0)                                                                                           \
                stn_##name(out, 1, head,                                                                            \
                           _mm256_mul_ps(act8(act, ldn_##name(gate, 1, head)), ldn_##name(up, 1, head)));           \
            for (i = head; i + 8 <= n; i += 8)                                                                      \
                nt_##name(out + i, _mm256_mul_ps(act8(act, ld_##name(gate + i)), ld_##name(up + i)));               \
            _mm_sfence();                                                                                           \
        }                                                                                                           \
        for (; i < n; i += 8) {                                                                                     \
            int64_t m = n - i < 8 ? n - i : 8;                                                                      \
            __m256 a = act8(act, ldn_##name(gate + i * gs, gs, m));                                                 \
            stn_##name(out + i * os, os, m, _mm256_mul_ps(a, ldn_##name(up + i * us, us, m)));                      \
        }                                                                                                           \
    }                                                                                                               \
    static inline void glu_bwd8_##name(E *dgate, E *dup, const E *grad, const E *gate, const E *up, int64_t m,      \
                                       int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act, int nt) {      \
        __m256 g = ldn_##name(grad, rs, m), da;                                                                     \
        __m256 a = act_pair8(act, ldn_##name(gate, gs, m), &da);                                                    \
        __m256 u = ldn_##name(up, us, m);                                                                           \
        __m256 dg = _mm256_mul_ps(_mm256_mul_ps(g, u), da), du = _mm256_mul_ps(g, a);                               \
        if (nt) {                                                                                                   \
            nt_##name(dgate, dg);                                                                                   \
            nt_##name(dup, du);                                                                                     \
        } else {                                                                                                    \
            stn_##name(dgate, ds, m, dg);                                                                           \
            stn_##name(dup, ds, m, du);                                                                             \
        }                                                                                                           \
    }                                                                                                               \
    static void glu_bwd_##name(void *dgate_, void *dup_, const void *grad_, const void *gate_, const void *up_,     \
                               int64_t n, int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act) {           \
        E *dgate = dgate_, *dup = dup_;                                                                             \
        const E *grad = grad_, *gate = gate_, *up = up_;                                                            \
        int64_t i = 0;                                                                                              \
        if (ds == 1 && rs == 1 && gs == 1 && us == 1 && 2 * n * (int64_t)sizeof(E) >= GLU_STREAM_MIN_BYTES &&       \
            glu_head(dgate, sizeof(E)) == glu_head(dup, sizeof(E)) && dgate != gate) {                              \
            const int64_t head = glu_head(dgate, sizeof(E));                                                        \
            if (head > 0) glu_bwd8_##name(dgate, dup, grad, gate, up, head, 1, 1, 1, 1, act, 0);                    \
            for (i = head; i + 8 <= n; i += 8)                                                                      \
                glu_bwd8_##name(dgate + i, dup + i, grad + i, gate + i, up + i, 8, 1, 1, 1, 1, act, 1);             \
            _mm_sfence();                                                                                           \
        }                                                                                                           \
        for (; i < n; i += 8) {                                                                                     \
            int64_t m = n - i < 8 ? n - i : 8;                                                                      \
            glu_bwd8_##name(dgate + i * ds, dup + i * ds, grad + i * rs, gate + i * gs, up + i * us, m, ds, rs, gs, \
                            us, act, 0);                                                                            \
        }                                                                                                           \
    }

GLU_AVX2(f32, float)
GLU_AVX2(bf16, uint16_t)
GLU_AVX2(f16, uint16_t)

/* float64: the reference's libm loop */
static void glu_fwd_f64(void *out, const void *gate, const void *up, int64_t n, int64_t os, int64_t gs, int64_t us,
                        act_kind act) {
    glu_kernels_ref.fwd[OPF_F64](out, gate, up, n, os, gs, us, act);
}

static void glu_bwd_f64(void *dgate, void *dup, const void *grad, const void *gate, const void *up, int64_t n,
                        int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act) {
    glu_kernels_ref.bwd[OPF_F64](dgate, dup, grad, gate, up, n, ds, rs, gs, us, act);
}

const glu_kernels glu_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .fwd = {[OPF_F32] = glu_fwd_f32, [OPF_F64] = glu_fwd_f64, [OPF_BF16] = glu_fwd_bf16, [OPF_F16] = glu_fwd_f16},
    .bwd = {[OPF_F32] = glu_bwd_f32, [OPF_F64] = glu_bwd_f64, [OPF_BF16] = glu_bwd_bf16, [OPF_F16] = glu_bwd_f16},
};
