/*
 * Rotary position embedding (RoPE) of queries and keys, in place of the
 * Hugging Face formula q * cos + rotate_half(q) * sin:
 *     out[j] = x[j] cos[j] + rot(x)[j] sin[j]          j < R
 *     out[j] = x[j]                                    R <= j < D (partial rotary)
 *   half-split (Llama / NeoX rotate_half), h = R / 2:
 *     rot(x)[j] = -x[j + h] (j < h),   x[j - h] (j >= h)
 *   interleaved (GPT-J rotate_every_two):
 *     rot(x)[2i] = -x[2i + 1],          rot(x)[2i + 1] = x[2i]
 *   backward (the transpose, which for cos / sin as Hugging Face makes them
 *   -- halves or pairs equal -- is the rotation by -theta):
 *     dx[j] = g[j] cos[j] + rot^T(g sin)[j]            j < R;  dx[j] = g[j] beyond
 *     rot^T(y)[j] = y[j + h] (j < h), -y[j - h] (j >= h);  rot^T(y)[2i] = y[2i + 1], rot^T(y)[2i + 1] = -y[2i]
 * q (B, Hq, N, D) and k (B, Hk, N, D), any head counts (grouped-query); cos and
 * sin hold R values per (batch, position): rows picked by (b, n), or by
 * position_ids[b, n] from a table. cos / sin are constants (no gradient).
 *
 * Row kernel contract (every ISA, every dtype): one head row of D elements;
 * x and out advance by xs and os, cos and sin by cs and ss (elements). The
 * vector paths run when every stride is 1, the reference loop otherwise.
 * Products are rounded and summed (no FMA) in every variant, so float32 and
 * float64 agree bit for bit with the reference; bfloat16 / float16 compute
 * in float32 and round once. out may not overlap x.
 */
#ifndef OPFORGE_KERNELS_ROPE_H
#define OPFORGE_KERNELS_ROPE_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

/* inverse: the backward formula (rot^T) */
typedef void (*rope_row_fn)(void *out, const void *x, const void *cos, const void *sin, int64_t d, int64_t r,
                            int64_t os, int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse);

typedef struct rope_kernels {
    OPF_VARIANT_HEAD;
    rope_row_fn row[OPF_DTYPE_COUNT];
} rope_kernels;

extern const rope_kernels rope_kernels_ref;
extern const rope_kernels rope_kernels_avx2;   /* rope_avx2.c */
extern const rope_kernels rope_kernels_avx512; /* rope_avx512.c */
extern const opf_variants rope_variants;

const rope_kernels *rope_kernels_for(opf_isa isa);

/* One call: q and k (or their gradients) rotated into oq and ok. Strides in
 * elements, over (B, H, N, D) for the four head tensors; cos / sin rows at
 * b * cb + n * cn (cb = 0 broadcasts one batch) or, with pos, at
 * pos[b * pb + n * pn] * cn, R elements at stride cr. */
typedef struct rope_problem {
    opf_dtype dt;
    int64_t b, hq, hk, n, d, r;
    int interleaved, inverse;
    const void *q, *k, *cos, *sin;
    void *oq, *ok;
    const int64_t *pos; /* NULL: rows by (b, n) */
    int64_t qs[4], ks[4], oqs[4], oks[4];
    int64_t cb, cn, cr, sb, sn, sr, pb, pn;
} rope_problem;

/* The first (b, n) whose position is outside [0, table_rows), as b * N + n,
 * or -1 when all are inside; *bad gets the position found there. */
int64_t rope_check_positions(const int64_t *pos, int64_t b, int64_t n, int64_t pb, int64_t pn, int64_t table_rows,
                             int64_t *bad);

/* Positions (b, n) split over opf_parallel_for; each rotates every head of q and k there. */
void rope_run(const rope_kernels *k, const rope_problem *p);

#endif
