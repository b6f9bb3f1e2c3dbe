/*
 * softmax / log_softmax, AVX2 + FMA + F16C. Built with -mavx2 -mfma -mf16c;
 * called only when cpuid reports all three. float32, bfloat16 and float16
 * compute in float32 (halves round once, on the store); float64 runs the
 * reference (gradcheck).
 *
 * exp is exp2_8z(d * log2(e)) of math_avx2.h on d = x - max <= 0: exactly 0
 * for d = -inf (masked entries), NaN kept, < 1 ulp for the polynomial; the
 * rounding of d * log2(e) adds a relative error of |d| * 2^-24, so ~1e-6 at
 * the smallest outputs that still matter (d ~ -20), none at the largest.
 *
 * Rows (w == 1, unit strides), float32: max; e = exp(x - max) stored in y
 * while summed; y *= 1/sum (one exp per element, y re-read from cache).
 * Halves cannot hold e unrounded in y: a row keeps its first SOFTMAX_STACK_FLOATS
 * exps in a float32 buffer on the stack, and a longer row computes the rest's
 * exp twice (in the sum, then y = exp * (1/sum)): the same bits either way.
 * log_softmax: max; sum of exp; y = (x - max) - log(sum).
 * Strided axis (w > 1): the same per 8 unit-stride lanes, the reduction
 * walking down the axis. Tails of fewer than 8 go through an 8-float buffer
 * (loads padded with -inf / 0), lanes left over (< 8) through the reference.
 */
#include <immintrin.h>
#include <math.h>

#include "rows_avx2.h"
#include "softmax.h"

/* The stack buffer of the 16-bit rows: 64 KiB, well inside any thread's stack. */
#define SOFTMAX_STACK_FLOATS 16384

/* ---- rows ------------------------------------------------------------------- */

#define SOFTMAX_ROWS(name, E, LD, ST, E_IN_Y)                                                                        \
    static float row_max_##name(const E *x, int64_t n) {                                                             \
        const __m256 ninf = _mm256_set1_ps(-INFINITY);                                                               \
        __m256 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;                                                           \
        int64_t i = 0;                                                                                               \
        for (; i + 32 <= n; i += 32) {                                                                               \
            m0 = _mm256_max_ps(m0, LD(x + i));                                                                       \
            m1 = _mm256_max_ps(m1, LD(x + i + 8));                                                                   \
            m2 = _mm256_max_ps(m2, LD(x + i + 16));                                                                  \
            m3 = _mm256_max_ps(m3, LD(x + i + 24));                                                                  \
        }                                                                                                            \
        for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(m0, LD(x + i));                                                \
        if (i < n) m1 = _mm256_max_ps(m1, ldn_##name(x + i, n - i, -INFINITY));                                      \
        return hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));                                   \
    }                                                                                                                \
    /* sum of exp(x - m); the first `kept` exps are also stored in e (float32; a multiple of 32 or n) */             \
    static float row_sumexp_##name(float *e, int64_t kept, const E *x, int64_t n, float m) {                         \
        const __m256 mv = _mm256_set1_ps(m);                                                                         \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                                                  \
        int64_t i = 0;                                                                                               \
        for (; i + 32 <= n; i += 32) {                                                                               \
            __m256 e0 = exp8z(_mm256_sub_ps(LD(x + i), mv)), e1 = exp8z(_mm256_sub_ps(LD(x + i + 8), mv));           \
            __m256 e2 = exp8z(_mm256_sub_ps(LD(x + i + 16), mv)), e3 = exp8z(_mm256_sub_ps(LD(x + i + 24), mv));     \
            s0 = _mm256_add_ps(s0, e0), s1 = _mm256_add_ps(s1, e1);                                                  \
            s2 = _mm256_add_ps(s2, e2), s3 = _mm256_add_ps(s3, e3);                                                  \
            if (i < kept) st_f32(e + i, e0), st_f32(e + i + 8, e1), st_f32(e + i + 16, e2), st_f32(e + i + 24, e3);  \
        }                                                                                                            \
        for (; i + 8 <= n; i += 8) {                                                                                 \
            __m256 ev = exp8z(_mm256_sub_ps(LD(x + i), mv));                                                         \
            s0 = _mm256_add_ps(s0, ev);                                                                              \
            if (i < kept) st_f32(e + i, ev);                                                                         \
        }                                                                                                            \
        if (i < n) {                                                                                                 \
            __m256 ev = exp8z(_mm256_sub_ps(ldn_##name(x + i, n - i, -INFINITY), mv));                               \
            s1 = _mm256_add_ps(s1, ev);                                                                              \
            if (i < kept) stn_f32(e + i, n - i, ev);                                                                 \
        }                                                                                                            \
        return hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));                                   \
    }                                                                                                                \
    static void row_fwd_##name(E *y, const E *x, int64_t n, int is_log) {                                            \
        float m = row_max_##name(x, n);                                                                              \
        const __m256 mv = _mm256_set1_ps(m);                                                                         \
        int64_t i = 0;                                                                                               \
        if (is_log) {                                                                                                \
            const __m256 ls = _mm256_set1_ps(logf(row_sumexp_##name(NULL, 0, x, n, m)));                             \
            for (; i + 8 <= n; i += 8) ST(y + i, _mm256_sub_ps(_mm256_sub_ps(LD(x + i), mv), ls));                   \
            if (i < n) stn_##name(y + i, n - i, _mm256_sub_ps(_mm256_sub_ps(ldn_##name(x + i, n - i, 0), mv), ls));  \
        } else { /* e in y (float32) or on the stack: the first SOFTMAX_STACK_FLOATS of a longer row */              \
            float stack[E_IN_Y ? 1 : SOFTMAX_STACK_FLOATS], *e = E_IN_Y ? (float *)(void *)y : stack;                \
            const int64_t kept = E_IN_Y || n <= SOFTMAX_STACK_FLOATS ? n : SOFTMAX_STACK_FLOATS;                     \
            const __m256 r = _mm256_set1_ps(1.0f / row_sumexp_##name(e, kept, x, n, m));                             \
            for (; i + 8 <= kept; i += 8) ST(y + i, _mm256_mul_ps(ld_f32(e + i), r));                                \
            if (i < kept) stn_##name(y + i, kept - i, _mm256_mul_ps(ldn_f32(e + i, kept - i, 0), r)), i = kept;      \
            for (; i + 8 <= n; i += 8) ST(y + i, _mm256_mul_ps(exp8z(_mm256_sub_ps(LD(x + i), mv)), r));             \
            if (i < n)                                                                                               \
                stn_##name(y + i, n - i,                                                                             \
                           _mm256_mul_ps(exp8z(_mm256_sub_ps(ldn_##name(x + i, n - i, -INFINITY), mv)), r));         \
        }                                                                                                            \
    }                                                                                                                \
    static void row_bwd_##name(E *dx, const E *dy, const E *y, int64_t n, int is_log) {                              \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;                                                                    \
        int64_t i = 0;                                                                                               \
        if (is_log) {                                                                                                \
            for (; i + 16 <= n; i += 16) s0 = _mm256_add_ps(s0, LD(dy + i)), s1 = _mm256_add_ps(s1, LD(dy + i + 8)); \
            for (; i + 8 <= n; i += 8) s0 = _mm256_add_ps(s0, LD(dy + i));                                           \
            if (i < n) s1 = _mm256_add_ps(s1, ldn_##name(dy + i, n - i, 0));                                         \
            const __m256 s = _mm256_set1_ps(hsum8(_mm256_add_ps(s0, s1)));                                           \
            for (i = 0; i + 8 <= n; i += 8) ST(dx + i, _mm256_fnmadd_ps(exp8z(LD(y + i)), s, LD(dy + i)));           \
            if (i < n)                                                                                               \
                stn_##name(dx + i, n - i,                                                                            \
                           _mm256_fnmadd_ps(exp8z(ldn_##name(y + i, n - i, 0)), s, ldn_##name(dy + i, n - i, 0)));   \
        } else {                                                                                                     \
            for (; i + 16 <= n; i += 16) {                                                                           \
                s0 = _mm256_fmadd_ps(LD(dy + i), LD(y + i), s0);                                                     \
                s1 = _mm256_fmadd_ps(LD(dy + i + 8), LD(y + i + 8), s1);                                             \
            }                                                                                                        \
            for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(LD(dy + i), LD(y + i), s0);                              \
            if (i < n) s1 = _mm256_fmadd_ps(ldn_##name(dy + i, n - i, 0), ldn_##name(y + i, n - i, 0), s1);          \
            const __m256 s = _mm256_set1_ps(hsum8(_mm256_add_ps(s0, s1)));                                           \
            for (i = 0; i + 8 <= n; i += 8) ST(dx + i, _mm256_mul_ps(LD(y + i), _mm256_sub_ps(LD(dy + i), s)));      \
            if (i < n)                                                                                               \
                stn_##name(                                                                                          \
                    dx + i, n - i,                                                                                   \
                    _mm256_mul_ps(ldn_##name(y + i, n - i, 0), _mm256_sub_ps(ldn_##name(dy + i, n - i, 0), s)));     \
        }                                                                                                            \
    }

/* ---- 8 lanes down a strided axis -------------------------------------------- */

#define SOFTMAX_LANES_KERNEL(name, E, LD, ST)                                                                          \
    static void lanes_fwd_##name(E *y, const E *x, int64_t n, int64_t ys, int64_t xs, int is_log) {                    \
        __m256 m = _mm256_set1_ps(-INFINITY), s = _mm256_setzero_ps();                                                 \
        for (int64_t k = 0; k < n; k++) m = _mm256_max_ps(m, LD(x + k * xs));                                          \
        for (int64_t k = 0; k < n; k++) s = _mm256_add_ps(s, exp8z(_mm256_sub_ps(LD(x + k * xs), m)));                 \
        if (is_log) {                                                                                                  \
            float b[8];                                                                                                \
            _mm256_storeu_ps(b, s);                                                                                    \
            for (int i = 0; i < 8; i++) b[i] = logf(b[i]);                                                             \
            const __m256 ls = _mm256_loadu_ps(b);                                                                      \
            for (int64_t k = 0; k < n; k++) ST(y + k * ys, _mm256_sub_ps(_mm256_sub_ps(LD(x + k * xs), m), ls));       \
        } else {                                                                                                       \
            const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), s);                                                   \
            for (int64_t k = 0; k < n; k++) ST(y + k * ys, _mm256_mul_ps(exp8z(_mm256_sub_ps(LD(x + k * xs), m)), r)); \
        }                                                                                                              \
    }                                                                                                                  \
    static void lanes_bwd_##name(E *dx, const E *dy, const E *y, int64_t n, int64_t dxs, int64_t dys, int64_t ys,      \
                                 int is_log) {                                                                         \
        __m256 s = _mm256_setzero_ps();                                                                                \
        if (is_log) {                                                                                                  \
            for (int64_t k = 0; k < n; k++) s = _mm256_add_ps(s, LD(dy + k * dys));                                    \
            for (int64_t k = 0; k < n; k++)                                                                            \
                ST(dx + k * dxs, _mm256_fnmadd_ps(exp8z(LD(y + k * ys)), s, LD(dy + k * dys)));                        \
        } else {                                                                                                       \
            for (int64_t k = 0; k < n; k++) s = _mm256_fmadd_ps(LD(dy + k * dys), LD(y + k * ys), s);                  \
            for (int64_t k = 0; k < n; k++)                                                                            \
                ST(dx + k * dxs, _mm256_mul_ps(LD(y + k * ys), _mm256_sub_ps(LD(dy + k * dys), s)));                   \
        }                                                                                                              \
    }

/* ---- the line kernels of the contract ----------------------------------------- */

#define SOFTMAX_AVX2(name, E, LD, ST, E_IN_Y, DT)                                                                   \
    SOFTMAX_ROWS(name, E, LD, ST, E_IN_Y)                                                                           \
    SOFTMAX_LANES_KERNEL(name, E, LD, ST)                                                                           \
    static void sm_fwd_##name(void *y_, const void *x_, int64_t n, int64_t w, int64_t ys, int64_t xs, int is_log) { \
        E *y = y_;                                                                                                  \
        const E *x = x_;                                                                                            \
        if (w == 1 && ys == 1 && xs == 1) {                                                                         \
            row_fwd_##name(y, x, n, is_log);                                                                        \
            return;                                                                                                 \
        }                                                                                                           \
        int64_t l = 0;                                                                                              \
        if (w > 1)                                                                                                  \
            for (; l + 8 <= w; l += 8) lanes_fwd_##name(y + l, x + l, n, ys, xs, is_log);                           \
        if (l < w) softmax_kernels_ref.fwd[DT](y + l, x + l, n, w - l, ys, xs, is_log);                             \
    }                                                                                                               \
    static void sm_bwd_##name(void *dx_, const void *dy_, const void *y_, int64_t n, int64_t w, int64_t dxs,        \
                              int64_t dys, int64_t ys, int is_log) {                                                \
        E *dx = dx_;                                                                                                \
        const E *dy = dy_, *y = y_;                                                                                 \
        if (w == 1 && dxs == 1 && dys == 1 && ys == 1) {                                                            \
            row_bwd_##name(dx, dy, y, n, is_log);                                                                   \
            return;                                                                                                 \
        }                                                                                                           \
        int64_t l = 0;                                                                                              \
        if (w > 1)                                                                                                  \
            for (; l + 8 <= w; l += 8) lanes_bwd_##name(dx + l, dy + l, y + l, n, dxs, dys, ys, is_log);            \
        if (l < w) softmax_kernels_ref.bwd[DT](dx + l, dy + l, y + l, n, w - l, dxs, dys, ys, is_log);              \
    }

SOFTMAX_AVX2(f32, float, ld_f32, st_f32, 1, OPF_F32)
SOFTMAX_AVX2(bf16, uint16_t, ld_bf16, st_bf16, 0, OPF_BF16)
SOFTMAX_AVX2(f16, uint16_t, ld_f16, st_f16, 0, OPF_F16)

static void sm_fwd_f64(void *y, const void *x, int64_t n, int64_t w, int64_t ys, int64_t xs, int is_log) {
    softmax_kernels_ref.fwd[OPF_F64](y, x, n, w, ys, xs, is_log);
}

static void sm_bwd_f64(void *dx, const void *dy, const void *y, int64_t n, int64_t w, int64_t dxs, int64_t dys,
                       int64_t ys, int is_log) {
    softmax_kernels_ref.bwd[OPF_F64](dx, dy, y, n, w, dxs, dys, ys, is_log);
}

const softmax_kernels softmax_kernels_avx2 = {
    .name = "avx2",
    .isa = OPF_ISA_AVX2,
    .fwd = {[OPF_F32] = sm_fwd_f32, [OPF_F64] = sm_fwd_f64, [OPF_BF16] = sm_fwd_bf16, [OPF_F16] = sm_fwd_f16},
    .bwd = {[OPF_F32] = sm_bwd_f32, [OPF_F64] = sm_bwd_f64, [OPF_BF16] = sm_bwd_bf16, [OPF_F16] = sm_bwd_f16},
};
