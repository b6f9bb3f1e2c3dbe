/*
 * softmax / log_softmax, AVX-512 (F, BW, VL, DQ): the AVX2 file's passes on
 * 16 lanes, tails masked, four accumulators per reduction. float32 stores
 * exp(x - max) in y while summing and scales it in a third pass; halves keep
 * it in a float32 stack buffer (the first SOFTMAX_STACK_FLOATS of a row;
 * exp is computed again past them); float64 runs the reference. The strided-axis
 * path takes 16 unit-stride lanes per pass, the lanes left over masked.
 */
#include <immintrin.h>
#include <math.h>

#include "math_avx512.h"
#include "rows_avx512.h"
#include "softmax.h"

/* The stack buffer of the 16-bit rows: 64 KiB, well inside any thread's stack (as the AVX2 file's). */
#define SOFTMAX_STACK_FLOATS 16384

#define SOFTMAX_ROWS(name, E, LD, ST, E_IN_Y)                                                                          \
    static float row_max_##name(const E *x, int64_t n) {                                                               \
        const __m512 ninf = _mm512_set1_ps(-INFINITY);                                                                 \
        __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;                                                             \
        int64_t i = 0;                                                                                                 \
        for (; i + 64 <= n; i += 64) {                                                                                 \
            m0 = _mm512_max_ps(m0, LD(x + i, 0xffff));                                                                 \
            m1 = _mm512_max_ps(m1, LD(x + i + 16, 0xffff));                                                            \
            m2 = _mm512_max_ps(m2, LD(x + i + 32, 0xffff));                                                            \
            m3 = _mm512_max_ps(m3, LD(x + i + 48, 0xffff));                                                            \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 k = tail16(n - i);                                                                               \
            m0 = _mm512_mask_max_ps(m0, k, m0, LD(x + i, k));                                                          \
        }                                                                                                              \
        return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));                      \
    }                                                                                                                  \
    /* sum of exp(x - m); the first `kept` exps are also stored in e (float32; a multiple of 64 or n) */               \
    static float row_sumexp_##name(float *e, int64_t kept, const E *x, int64_t n, __m512 mv) {                         \
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                                                    \
        int64_t i = 0;                                                                                                 \
        for (; i + 64 <= n; i += 64) {                                                                                 \
            __m512 e0 = exp16z(_mm512_sub_ps(LD(x + i, 0xffff), mv));                                                  \
            __m512 e1 = exp16z(_mm512_sub_ps(LD(x + i + 16, 0xffff), mv));                                             \
            __m512 e2 = exp16z(_mm512_sub_ps(LD(x + i + 32, 0xffff), mv));                                             \
            __m512 e3 = exp16z(_mm512_sub_ps(LD(x + i + 48, 0xffff), mv));                                             \
            s0 = _mm512_add_ps(s0, e0), s1 = _mm512_add_ps(s1, e1);                                                    \
            s2 = _mm512_add_ps(s2, e2), s3 = _mm512_add_ps(s3, e3);                                                    \
            if (i < kept) {                                                                                            \
                _mm512_storeu_ps(e + i, e0), _mm512_storeu_ps(e + i + 16, e1);                                         \
                _mm512_storeu_ps(e + i + 32, e2), _mm512_storeu_ps(e + i + 48, e3);                                    \
            }                                                                                                          \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 k = tail16(n - i);                                                                               \
            __m512 ev = _mm512_maskz_mov_ps(k, exp16z(_mm512_sub_ps(LD(x + i, k), mv)));                               \
            s0 = _mm512_add_ps(s0, ev);                                                                                \
            if (i < kept) _mm512_mask_storeu_ps(e + i, k, ev);                                                         \
        }                                                                                                              \
        return sum4x16(s0, s1, s2, s3);                                                                                \
    }                                                                                                                  \
    static void row_fwd_##name(E *y, const E *x, int64_t n, int is_log) {                                              \
        const __m512 mv = _mm512_set1_ps(row_max_##name(x, n));                                                        \
        int64_t i;                                                                                                     \
        if (is_log) {                                                                                                  \
            const __m512 ls = _mm512_set1_ps(logf(row_sumexp_##name(NULL, 0, x, n, mv)));                              \
            for (i = 0; i < n; i += 16) {                                                                              \
                __mmask16 k = tail16(n - i);                                                                           \
                ST(y + i, _mm512_sub_ps(_mm512_sub_ps(LD(x + i, k), mv), ls), k);                                      \
            }                                                                                                          \
        } else { /* e in y (float32) or on the stack: the first SOFTMAX_STACK_FLOATS of a longer row */                \
            _Alignas(64) float stack[E_IN_Y ? 1 : SOFTMAX_STACK_FLOATS];                                               \
            float *e = E_IN_Y ? (float *)(void *)y : stack;                                                            \
            const int64_t kept = E_IN_Y || n < SOFTMAX_STACK_FLOATS ? n : SOFTMAX_STACK_FLOATS;                        \
            const __m512 r = _mm512_set1_ps(1.0f / row_sumexp_##name(e, kept, x, n, mv));                              \
            for (i = 0; i < kept; i += 16) {                                                                           \
                __mmask16 k = tail16(kept - i);                                                                        \
                ST(y + i, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, e + i), r), k);                                       \
            }                                                                                                          \
            for (; i < n; i += 16) {                                                                                   \
                __mmask16 k = tail16(n - i);                                                                           \
                ST(y + i, _mm512_mul_ps(exp16z(_mm512_sub_ps(LD(x + i, k), mv)), r), k);                               \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    /* sum of dy (log) or of dy * y, four chains */                                                                    \
    static float row_dot_##name(const E *dy, const E *y, int64_t n, int is_log) {                                      \
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                                                    \
        int64_t i = 0;                                                                                                 \
        if (is_log) {                                                                                                  \
            for (; i + 64 <= n; i += 64) {                                                                             \
                s0 = _mm512_add_ps(s0, LD(dy + i, 0xffff)), s1 = _mm512_add_ps(s1, LD(dy + i + 16, 0xffff));           \
                s2 = _mm512_add_ps(s2, LD(dy + i + 32, 0xffff)), s3 = _mm512_add_ps(s3, LD(dy + i + 48, 0xffff));      \
            }                                                                                                          \
            for (; i < n; i += 16) s0 = _mm512_add_ps(s0, LD(dy + i, tail16(n - i)));                                  \
        } else {                                                                                                       \
            for (; i + 64 <= n; i += 64) {                                                                             \
                s0 = _mm512_fmadd_ps(LD(dy + i, 0xffff), LD(y + i, 0xffff), s0);                                       \
                s1 = _mm512_fmadd_ps(LD(dy + i + 16, 0xffff), LD(y + i + 16, 0xffff), s1);                             \
                s2 = _mm512_fmadd_ps(LD(dy + i + 32, 0xffff), LD(y + i + 32, 0xffff), s2);                             \
                s3 = _mm512_fmadd_ps(LD(dy + i + 48, 0xffff), LD(y + i + 48, 0xffff), s3);                             \
            }                                                                                                          \
            for (; i < n; i += 16) {                                                                                   \
                __mmask16 k = tail16(n - i);                                                                           \
                s0 = _mm512_fmadd_ps(LD(dy + i, k), LD(y + i, k), s0);                                                 \
            }                                                                                                          \
        }                                                                                                              \
        return sum4x16(s0, s1, s2, s3);                                                                                \
    }                                                                                                                  \
    static void row_bwd_##name(E *dx, const E *dy, const E *y, int64_t n, int is_log) {                                \
        const __m512 s = _mm512_set1_ps(row_dot_##name(dy, y, n, is_log));                                             \
        int64_t i = 0;                                                                                                 \
        if (is_log) {                                                                                                  \
            for (; i + 16 <= n; i += 16)                                                                               \
                ST(dx + i, _mm512_fnmadd_ps(exp16z(LD(y + i, 0xffff)), s, LD(dy + i, 0xffff)), 0xffff);                \
        } else {                                                                                                       \
            for (; i + 32 <= n; i += 32) {                                                                             \
                __m512 d0 = _mm512_mul_ps(LD(y + i, 0xffff), _mm512_sub_ps(LD(dy + i, 0xffff), s));                    \
                __m512 d1 = _mm512_mul_ps(LD(y + i + 16, 0xffff), _mm512_sub_ps(LD(dy + i + 16, 0xffff), s));          \
                ST(dx + i, d0, 0xffff), ST(dx + i + 16, d1, 0xffff);                                                   \
            }                                                                                                          \
        }                                                                                                              \
        for (; i < n; i += 16) {                                                                                       \
            __mmask16 k = tail16(n - i);                                                                               \
            __m512 g = LD(dy + i, k), yv = LD(y + i, k);                                                               \
            ST(dx + i, is_log ? _mm512_fnmadd_ps(exp16z(yv), s, g) : _mm512_mul_ps(yv, _mm512_sub_ps(g, s)), k);       \
        }                                                                                                              \
    }                                                                                                                  \
    /* up to 16 unit-stride lanes (mask k) down a strided axis */                                                      \
    static void lanes_fwd_##name(E *y, const E *x, int64_t n, int64_t ys, int64_t xs, int is_log, __mmask16 k) {       \
        __m512 m = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps();                                                 \
        for (int64_t j = 0; j < n; j++) m = _mm512_max_ps(m, LD(x + j * xs, k));                                       \
        for (int64_t j = 0; j < n; j++) s = _mm512_add_ps(s, exp16z(_mm512_sub_ps(LD(x + j * xs, k), m)));             \
        if (is_log) {                                                                                                  \
            float b[16];                                                                                               \
            _mm512_storeu_ps(b, s);                                                                                    \
            for (int i = 0; i < 16; i++) b[i] = logf(b[i]);                                                            \
            const __m512 ls = _mm512_loadu_ps(b);                                                                      \
            for (int64_t j = 0; j < n; j++) ST(y + j * ys, _mm512_sub_ps(_mm512_sub_ps(LD(x + j * xs, k), m), ls), k); \
        } else {                                                                                                       \
            const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), s);                                                   \
            for (int64_t j = 0; j < n; j++)                                                                            \
                ST(y + j * ys, _mm512_mul_ps(exp16z(_mm512_sub_ps(LD(x + j * xs, k), m)), r), k);                      \
        }                                                                                                              \
    }                                                                                                                  \
    static void lanes_bwd_##name(E *dx, const E *dy, const E *y, int64_t n, int64_t dxs, int64_t dys, int64_t ys,      \
                                 int is_log, __mmask16 k) {                                                            \
        __m512 s = _mm512_setzero_ps();                                                                                \
        for (int64_t j = 0; j < n; j++)                                                                                \
            s = is_log ? _mm512_add_ps(s, LD(dy + j * dys, k))                                                         \
                       : _mm512_fmadd_ps(LD(dy + j * dys, k), LD(y + j * ys, k), s);                                   \
        for (int64_t j = 0; j < n; j++) {                                                                              \
            __m512 g = LD(dy + j * dys, k), yv = LD(y + j * ys, k);                                                    \
            ST(dx + j * dxs, is_log ? _mm512_fnmadd_ps(exp16z(yv), s, g) : _mm512_mul_ps(yv, _mm512_sub_ps(g, s)), k); \
        }                                                                                                              \
    }

#define SOFTMAX_AVX512(name, E, LD, ST, E_IN_Y, DT)                                                                 \
    SOFTMAX_ROWS(name, E, LD, ST, E_IN_Y)                                                                           \
    static void sm_fwd_##name(void *y_, const void *x_, int64_t n, int64_t w, int64_t ys, int64_t xs, int is_log) { \
        E *y = y_;                                                                                                  \
        const E *x = x_;                                                                                            \
        if (w == 1 && ys == 1 && xs == 1)                                                                           \
            row_fwd_##name(y, x, n, is_log);                                                                        \
        else if (w == 1)                                                                                            \
            softmax_kernels_ref.fwd[DT](y, x, n, 1, ys, xs, is_log);                                                \
        else                                                                                                        \
            for (int64_t l = 0; l < w; l += 16) lanes_fwd_##name(y + l, x + l, n, ys, xs, is_log, tail16(w - l));   \
    }                                                                                                               \
    static void sm_bwd_##name(void *dx_, const void *dy_, const void *y_, int64_t n, int64_t w, int64_t dxs,        \
                              int64_t dys, int64_t ys, int is_log) {                                                \
        E *dx = dx_;                                                                                                \
        const E *dy = dy_, *y = y_;                                                                                 \
        if (w == 1 && dxs == 1 && dys == 1 && ys == 1)                                                              \
            row_bwd_##name(dx, dy, y, n, is_log);                                                                   \
        else if (w == 1)                                                                                            \
            softmax_kernels_ref.bwd[DT](dx, dy, y, n, 1, dxs, dys, ys, is_log);                                     \
        else                                                                                                        \
            for (int64_t l = 0; l < w; l += 16)                                                                     \
                lanes_bwd_##name(dx + l, dy + l, y + l, n, dxs, dys, ys, is_log, tail16(w - l));                    \
    }

SOFTMAX_AVX512(f32, float, ld16_f32, st16_f32, 1, OPF_F32)
SOFTMAX_AVX512(bf16, uint16_t, ld16_bf16, st16_bf16, 0, OPF_BF16)
SOFTMAX_AVX512(f16, uint16_t, ld16_f16, st16_f16, 0, OPF_F16)

static void sm_fwd_f64(void *y, const void *x, int64_t n, int64_t w, int64_t ys, int64_t xs, int is_log) {
    softmax_kernels_ref.fwd[OPF_F64](y, x, n, w, ys, xs, is_log);
}

static void sm_bwd_f64(void *dx, const void *dy, const void *y, int64_t n, int64_t w, int64_t dxs, int64_t dys,
                       int64_t ys, int is_log) {
    softmax_kernels_ref.bwd[OPF_F64](dx, dy, y, n, w, dxs, dys, ys, is_log);
}

const softmax_kernels softmax_kernels_avx512 = {
    .name = "avx512",
    .isa = OPF_ISA_AVX512,
    .fwd = {[OPF_F32] = sm_fwd_f32, [OPF_F64] = sm_fwd_f64, [OPF_BF16] = sm_fwd_bf16, [OPF_F16] = sm_fwd_f16},
    .bwd = {[OPF_F32] = sm_bwd_f32, [OPF_F64] = sm_bwd_f64, [OPF_BF16] = sm_bwd_bf16, [OPF_F16] = sm_bwd_f16},
};
