/*
 * cross_entropy over the last dim of logits (rows of C classes), forward and
 * backward; the backward recomputes the softmax from the logits and the
 * per-row logsumexp the forward saved (no (rows, C) tensor is kept).
 *
 *   z_j    = softcap > 0 ? c tanh(x_j / c) : x_j            (Gemma-2 soft-capping)
 *   lse    = log sum_j exp z_j
 *   loss_i = (1-eps) w_t (lse - z_t) + (eps/C) sum_j w_j (lse - z_j)
 *            (w = 1 without weight; the eps term only when eps > 0; 0 for a
 *            row whose target t is ignore_index), as torch's F.cross_entropy
 *   mean   = sum_i loss_i / W, W = sum of w_t over the rows not ignored (their
 *            count without weight: 0/0 = NaN when all are ignored, as torch);
 *   sum    = sum_i loss_i
 *   dz_j   = s_i [((1-eps) w_t + (eps/C) Wc) p_j - (eps/C) w_j - (1-eps) w_t [j == t]],
 *            p_j = exp(z_j - lse), Wc = sum_j w_j (C without weight),
 *            s_i = grad_losses_i + grad_loss * (1/W for mean, 1 otherwise)
 *   dx_j   = dz_j (1 - (z_j / c)^2) with softcap; ignored rows get 0.
 *
 * Row kernel contract (every ISA, every dtype): C logits at x[j * xs], the
 * weight (same dtype, or NULL) at w[j * ws], any strides; the vector path runs
 * when they are 1. Halves compute in float32; float64 in double. Pure
 * functions: no allocation, no threads.
 */
#ifndef OPFORGE_KERNELS_CROSS_ENTROPY_H
#define OPFORGE_KERNELS_CROSS_ENTROPY_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

/* lse of one row and, when wz is not NULL, sum_j w_j z_j */
typedef void (*cross_entropy_fwd_fn)(const void *x, int64_t C, int64_t xs, const void *w, int64_t ws, double softcap,
                                     double *lse, double *wz);
/* dx_j = (a p_j - b w_j - ct [j == t]) (softcap derivative); a = b = ct = 0 writes zeros */
typedef void (*cross_entropy_bwd_fn)(void *dx, const void *x, int64_t C, int64_t dxs, int64_t xs, const void *w,
                                     int64_t ws, double softcap, double lse, double a, double b, int64_t t, double ct);

typedef struct cross_entropy_kernels {
    OPF_VARIANT_HEAD;
    cross_entropy_fwd_fn fwd[OPF_DTYPE_COUNT];
    cross_entropy_bwd_fn bwd[OPF_DTYPE_COUNT];
} cross_entropy_kernels;

extern const cross_entropy_kernels cross_entropy_kernels_ref;
extern const cross_entropy_kernels cross_entropy_kernels_avx2;   /* cross_entropy_avx2.c */
extern const cross_entropy_kernels cross_entropy_kernels_avx512; /* cross_entropy_avx512.c */
extern const opf_variants cross_entropy_variants;

const cross_entropy_kernels *cross_entropy_kernels_for(opf_isa isa);

enum {
    CROSS_ENTROPY_REDUCTION_NONE = 0,
    CROSS_ENTROPY_REDUCTION_MEAN = 1,
    CROSS_ENTROPY_REDUCTION_SUM = 2
}; /* torch's Reduction codes */

/* Rows per block of the reduction: every block's partial sum is made by one
 * task and the blocks are added in order, so the mean and the sum have the
 * same bits on any thread count. */
#define CROSS_ENTROPY_BLOCK 16
/* Logits per parallel task (at least). */
#define CROSS_ENTROPY_GRAIN 65536

/* The problem: logits (lead..., C) with strides (lead_ndim + 1 of them),
 * target (lead...) int64 with its strides; rows = product of lead sizes. */
typedef struct cross_entropy_problem {
    opf_dtype dt;
    int64_t rows, classes;
    int lead_ndim;
    const int64_t *lead_sizes;
    const void *logits;
    const int64_t *logits_strides;
    const int64_t *target, *target_strides;
    const void *weight; /* (C,) of dt, or NULL */
    int64_t weight_stride;
    int64_t ignore_index;
    double label_smoothing, softcap; /* softcap 0: none */
    int reduction;
    /* forward outputs: losses (rows,) contiguous of dt; loss 0-d of dt (mean or sum; sum for none); lse (rows,) */
    void *losses, *loss;
    double *lse;
    /* backward: the saved lse (rows,) contiguous, float64 as the forward makes it (or float32); grad_losses
     * (lead...) of dt with its strides, grad_loss 0-d of dt, dlogits (rows, C) contiguous */
    const void *lse_saved;
    opf_dtype lse_dt;
    const void *grad_losses;
    const int64_t *grad_losses_strides;
    const void *grad_loss;
    void *dlogits;
} cross_entropy_problem;

/* The first row whose target is neither in [0, C) nor ignore_index, its value
 * in *value; -1 when every target is valid. */
int64_t cross_entropy_check_target(const cross_entropy_problem *p, int64_t *value);

/* Workspace floats of cross_entropy_fwd (the reduction's block partials). */
int64_t cross_entropy_fwd_workspace(const cross_entropy_problem *p);
void cross_entropy_fwd(const cross_entropy_kernels *k, const cross_entropy_problem *p, float *ws);
void cross_entropy_bwd(const cross_entropy_kernels *k, const cross_entropy_problem *p);

#endif
