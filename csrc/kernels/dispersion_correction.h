/*
 * dispersion_correction: y = x * alpha + sqrt(x)
 *   backward:            dx = dy * alpha + dy / (2 * sqrt(x))
 * written exactly as autograd of the reference evaluates it, so that x = 0
 * gives +-inf (or nan for dy = 0) and x < 0 gives nan, as torch.sqrt does.
 *
 * Kernel contract (every ISA, every dtype): n elements; y / dx advance by ys,
 * x by xs, dy by dys (strides in elements, any value incl. 0). The vector path
 * runs when every stride is 1, a scalar loop otherwise. Half types (bf16, f16)
 * compute in fp32. alpha is rounded to the compute type first, as torch does.
 * Pure functions: no allocation, no threads; the caller splits the range.
 */
#ifndef OPFORGE_KERNELS_DISPERSION_CORRECTION_H
#define OPFORGE_KERNELS_DISPERSION_CORRECTION_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

typedef void (*dispersion_correction_fwd_fn)(void *y, const void *x, int64_t n, int64_t ys, int64_t xs, double alpha);
typedef void (*dispersion_correction_bwd_fn)(void *dx, const void *dy, const void *x, int64_t n, int64_t dxs,
                                             int64_t dys, int64_t xs, double alpha);

typedef struct dispersion_correction_kernels {
    OPF_VARIANT_HEAD;
    dispersion_correction_fwd_fn fwd[OPF_DTYPE_COUNT];
    dispersion_correction_bwd_fn bwd[OPF_DTYPE_COUNT];
} dispersion_correction_kernels;

extern const dispersion_correction_kernels dispersion_correction_kernels_ref;
extern const dispersion_correction_kernels dispersion_correction_kernels_avx2;   /* dispersion_correction_avx2.c */
extern const dispersion_correction_kernels dispersion_correction_kernels_avx512; /* dispersion_correction_avx512.c */
extern const opf_variants dispersion_correction_variants;

/* Kernels for isa; an ISA this build lacks falls back to the next one below. */
const dispersion_correction_kernels *dispersion_correction_kernels_for(opf_isa isa);

/* Elements per parallel task: big enough that a task outlasts the pool hand-off. */
#define DISPERSION_CORRECTION_GRAIN 32768

/* Whole tensors: y (or dx) and the inputs described by nd (operand 0 is the
 * output; forward: 1 = x; backward: 1 = dy, 2 = x). Splits nd over
 * opf_parallel_for. */
void dispersion_correction_fwd(const dispersion_correction_kernels *k, opf_dtype dt, const opf_nd *nd, void *y,
                               const void *x, double alpha);
void dispersion_correction_bwd(const dispersion_correction_kernels *k, opf_dtype dt, const opf_nd *nd, void *dx,
                               const void *dy, const void *x, double alpha);

#endif
