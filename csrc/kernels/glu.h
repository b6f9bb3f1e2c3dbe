/*
 * Gated linear units, the MLP activations of Llama (SwiGLU) and Gemma / T5
 * (GeGLU):
 *     out   = act(gate) * up                     act = silu, gelu or gelu_tanh
 *   backward (recomputes act from gate, nothing else saved):
 *     dgate = grad * up * act'(gate)
 *     dup   = grad * act(gate)
 * gate, up, out (..., F) of one shape; act is an act_kind of act.h (ACT_SILU,
 * ACT_GELU, ACT_GELU_TANH).
 *
 * Kernel contract (every ISA, every dtype): n elements; each operand advances
 * by its own stride (in elements, any value incl. 0); dgate and dup share
 * one stride. bfloat16 / float16 compute in float32 and round once; float64
 * computes in double through libm. The vector paths handle any stride (a
 * strided run is gathered 8 or 16 at a time) and finish a run with the same
 * vector code on a padded block, so an element's value never depends on where
 * a thread's range begins or ends: results are the same at any thread count.
 * Unit-stride runs writing more than 8 MiB store past the caches (non-temporal).
 * Pure functions: no allocation, no threads; the caller splits the range.
 */
#ifndef OPFORGE_KERNELS_GLU_H
#define OPFORGE_KERNELS_GLU_H

#include <stdint.h>

#include "act.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

/* out[i*os] = act(gate[i*gs]) * up[i*us] */
typedef void (*glu_fwd_fn)(void *out, const void *gate, const void *up, int64_t n, int64_t os, int64_t gs, int64_t us,
                           act_kind act);
/* dgate[i*ds], dup[i*ds] from grad[i*rs], gate[i*gs], up[i*us] */
typedef void (*glu_bwd_fn)(void *dgate, void *dup, const void *grad, const void *gate, const void *up, int64_t n,
                           int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act);

typedef struct glu_kernels {
    OPF_VARIANT_HEAD;
    glu_fwd_fn fwd[OPF_DTYPE_COUNT];
    glu_bwd_fn bwd[OPF_DTYPE_COUNT];
} glu_kernels;

extern const glu_kernels glu_kernels_ref;
extern const glu_kernels glu_kernels_avx2;   /* glu_avx2.c */
extern const glu_kernels glu_kernels_avx512; /* glu_avx512.c */
extern const opf_variants glu_variants;

/* Kernels for isa; an ISA this build lacks falls back to the next one below. */
const glu_kernels *glu_kernels_for(opf_isa isa);

/* Elements per parallel task: an exp or erf per element makes a task of this
 * many outlast the pool hand-off by far. */
#define GLU_GRAIN 16384

/* Whole tensors described by nd. Forward: operand 0 = out, 1 = gate, 2 = up.
 * Backward: operand 0 = dgate (dup has the same strides), 1 = grad, 2 = gate,
 * 3 = up. Split over opf_parallel_for. */
void glu_fwd(const glu_kernels *k, opf_dtype dt, const opf_nd *nd, void *out, const void *gate, const void *up,
             act_kind act);
void glu_bwd(const glu_kernels *k, opf_dtype dt, const opf_nd *nd, void *dgate, void *dup, const void *grad,
             const void *gate, const void *up, act_kind act);

#endif
