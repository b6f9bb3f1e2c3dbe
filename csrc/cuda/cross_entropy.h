/* The launchers of csrc/cuda/cross_entropy.cu: the fused cross-entropy over the last dim of the logits
 * and its backward (formulas in csrc/kernels/cross_entropy.h). Each returns what it launched (grid 0:
 * nothing, or only the forward's reduction of no rows). */
#ifndef OPFORGE_CUDA_CROSS_ENTROPY_H
#define OPFORGE_CUDA_CROSS_ENTROPY_H

#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The problem. rows walks the lead dims (opf_cuda_nd_make): operand 0 the row index (contiguous
 * strides of the lead sizes: the losses, lse and dlogits rows), 1 the logits' lead strides, 2 the
 * target's, 3 grad_losses' (backward). */
typedef struct cross_entropy_cuda_problem {
    opf_cuda_nd rows;
    int64_t nrows, classes, class_stride, weight_stride, ignore_index;
    double label_smoothing, softcap; /* softcap 0: none */
    int reduction;                   /* CROSS_ENTROPY_REDUCTION_* (csrc/kernels/cross_entropy.h) */
} cross_entropy_cuda_problem;

typedef struct cross_entropy_cuda_launch {
    unsigned grid, block;
    const char *kernel;
} cross_entropy_cuda_launch;

/* Workspace floats of the forward: every block's partial sums of the losses and target weights (in
 * double, added in a fixed order by a second kernel: the same bits run to run), and the weights'
 * sum when label smoothing meets a weight. */
int64_t cross_entropy_cuda_fwd_workspace(opf_dtype dt, const cross_entropy_cuda_problem *p, int has_weight);

/* losses (rows,) of dt, loss 0-d of dt (mean, or sum for sum and none), lse (rows,) float64, all
 * contiguous. A row whose target is neither in [0, C) nor ignore_index gets a NaN loss and lse (the
 * GPU cannot raise from inside a kernel without a synchronisation): the mean and the sum then turn
 * NaN. weight may be NULL. */
cross_entropy_cuda_launch cross_entropy_cuda_fwd(opf_dtype dt, void *losses, void *loss, double *lse,
                                                 const void *logits, const int64_t *target, const void *weight,
                                                 float *ws, const cross_entropy_cuda_problem *p, void *stream);

/* Workspace floats of the backward: the mean's 1 / W (W added over the targets, as the forward) and
 * the weights' sum, when the problem needs them (0 otherwise: ws may be NULL). */
int64_t cross_entropy_cuda_bwd_workspace(opf_dtype dt, const cross_entropy_cuda_problem *p, int has_weight);

/* dlogits (rows, C) contiguous of dt, from the logits and the saved lse (float64, or float32 when
 * lse_f32), grad_losses (lead strides in p->rows, operand 3) and grad_loss (0-d), both of dt. A row
 * with an ignored target gets zeros, a row with a target out of range NaN. */
cross_entropy_cuda_launch cross_entropy_cuda_bwd(opf_dtype dt, void *dlogits, const void *logits, const int64_t *target,
                                                 const void *weight, const void *grad_losses, const void *grad_loss,
                                                 const void *lse, int lse_f32, float *ws,
                                                 const cross_entropy_cuda_problem *p, void *stream);

#ifdef __cplusplus
}
#endif

#endif
