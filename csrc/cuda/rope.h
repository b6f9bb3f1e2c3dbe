/* The launcher of csrc/cuda/rope.cu: one call rotates q and k (or their gradients) into oq and ok,
 * as rope_run of csrc/kernels/rope.h does on the CPU (formulas there). Returns the blocks it
 * launched (0: nothing to do). */
#ifndef OPFORGE_CUDA_ROPE_H
#define OPFORGE_CUDA_ROPE_H

#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ROPE_CUDA_THREADS 256

/* Strides in elements, over (B, H, N, D) for the four head tensors; cos / sin rows at b * cb + n * cn
 * (cb = 0 broadcasts one batch) or, with pos, at pos[b * pb + n * pn] * cn, R elements at stride cr
 * (sin: sb, sn, sr). A position outside [0, table_rows) is not read: every output element of q and
 * k at that (b, n) is NaN (the device cannot raise the CPU op's error without a synchronisation). */
typedef struct rope_cuda_problem {
    int64_t b, hq, hk, n, d, r;
    int interleaved, inverse;
    const void *q, *k, *cos, *sin;
    void *oq, *ok;
    const int64_t *pos; /* NULL: rows by (b, n) */
    int64_t table_rows; /* rows of the cos / sin table, with pos */
    int64_t qs[4], ks[4], oqs[4], oks[4];
    int64_t cb, cn, cr, sb, sn, sr, pb, pn;
} rope_cuda_problem;

/* 1 when a launch takes the vector kernel (every row a 16-byte aligned unit-stride run whose halves
 * or pairs fill whole packs), 0 for the scalar one. */
int rope_cuda_vector(opf_dtype dt, const rope_cuda_problem *p);

unsigned rope_cuda(opf_dtype dt, const rope_cuda_problem *p, void *stream);

#ifdef __cplusplus
}
#endif

#endif
