/*
 * softmax and log_softmax along one dim, forward and backward.
 *   softmax:     y_i = exp(x_i - m) / s,        m = max_j x_j, s = sum_j exp(x_j - m)
 *   log_softmax: y_i = x_i - m - log(s)
 *   backward (from the saved output y only):
 *     softmax:     dx_i = y_i * (dy_i - sum_j dy_j y_j)
 *     log_softmax: dx_i = dy_i - exp(y_i) * sum_j dy_j
 * Entries of -inf give exactly 0 (softmax) / -inf (log_softmax) and finite
 * gradients; a row of -inf only gives NaN (-inf - -inf), a +inf or NaN in a
 * row makes the whole row NaN: all as torch's F.softmax / F.log_softmax.
 *
 * Line kernel contract (every ISA, every dtype): one call handles w >= 1
 * adjacent lines of n elements. Element k of lane l of an operand is at
 * p[l + k * stride] (strides in elements, any value): with w == 1 that is one
 * strided row (vector path when every stride is 1), with w > 1 the lanes are
 * unit-stride and the reduction runs down a strided axis with the lanes
 * vectorised. Halves (bf16, f16) compute in float32 and round once; float64
 * computes in double. Pure functions: no allocation, no threads.
 */
#ifndef OPFORGE_KERNELS_SOFTMAX_H
#define OPFORGE_KERNELS_SOFTMAX_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

typedef void (*softmax_fwd_fn)(void *y, const void *x, int64_t n, int64_t w, int64_t ys, int64_t xs, int log);
typedef void (*softmax_bwd_fn)(void *dx, const void *dy, const void *y, int64_t n, int64_t w, int64_t dxs, int64_t dys,
                               int64_t ys, int log);

typedef struct softmax_kernels {
    OPF_VARIANT_HEAD;
    softmax_fwd_fn fwd[OPF_DTYPE_COUNT];
    softmax_bwd_fn bwd[OPF_DTYPE_COUNT];
} softmax_kernels;

extern const softmax_kernels softmax_kernels_ref;
extern const softmax_kernels softmax_kernels_avx2;   /* softmax_avx2.c */
extern const softmax_kernels softmax_kernels_avx512; /* softmax_avx512.c */
extern const opf_variants softmax_variants;

const softmax_kernels *softmax_kernels_for(opf_isa isa);

/* Elements per parallel task. */
#define SOFTMAX_GRAIN 32768
/* Lanes per line-kernel call on the strided-axis path. */
#define SOFTMAX_LANES 64

/* A whole tensor: the op runs along `dim` of an ndim tensor of `sizes`.
 * Operand 0 is the output (y, or dx), 1 the input (x, or dy), 2 the saved y
 * (backward only); each has its own strides. */
typedef struct softmax_problem {
    opf_dtype dt;
    int log; /* 1: log_softmax */
    int ndim, dim;
    const int64_t *sizes;
    void *out;
    const void *in, *y;
    const int64_t *strides[3];
} softmax_problem;

/* Splits the lines over opf_parallel_for: when `dim` has stride 1 in every
 * operand, one row per call; otherwise, when some other dim has stride 1 in
 * every operand, up to SOFTMAX_LANES of its lines per call (the reduction
 * strided, the lanes vectorised); otherwise one strided line per call. */
void softmax_fwd(const softmax_kernels *k, const softmax_problem *p);
void softmax_bwd(const softmax_kernels *k, const softmax_problem *p);

#endif
