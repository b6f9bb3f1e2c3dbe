/*
 * What the CPU glue of cross_entropy (cross_entropy.c) shares with the CUDA
 * glue (csrc/cuda/cross_entropy.c): every argument check, with the device
 * check passed in (opf_check_device on the CPU, opf_check_cuda on the GPU),
 * and the forward's outputs. A glue checks first and allocates after, the
 * CUDA glue once it holds its device guard.
 */
#ifndef OPFORGE_TORCH_CROSS_ENTROPY_H
#define OPFORGE_TORCH_CROSS_ENTROPY_H

#include "../kernels/cross_entropy.h"
#include "opforge/op.h"
#include "registry.h"

/* torch's Reduction codes (none, mean, sum), which linear_cross_entropy takes too */
extern const opf_enum_desc opf_enum_reduction;

/* The checked arguments. p holds the problem's scalars (dt, rows, classes, ignore_index,
 * label_smoothing, softcap, reduction) and the inputs' pointers and strides; the outputs' and
 * the backward's pointers are the caller's to fill. The backward's grad_losses, grad_loss and lse
 * are read by cross_entropy_backward_check only. */
typedef struct cross_entropy_args {
    opf_tensor logits, target, weight; /* weight: when has_weight */
    int has_weight;
    cross_entropy_problem p;
    opf_tensor grad_losses, grad_loss, lse;
} cross_entropy_args;

/* cross_entropy(logits, target, weight?, ignore_index, label_smoothing, reduction, softcap?): reads
 * the tensors (w_h NULL for None) and the four scalars at opts, and checks them, the logits' device
 * first. Targets on the CPU are checked to be in [0, C) or ignore_index here, before anything is
 * computed; on the GPU reading them would synchronise the stream, and the kernels flag such a row
 * instead. Fails op with a message naming the argument. */
cross_entropy_args cross_entropy_check(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle x_h,
                                       AtenTensorHandle t_h, AtenTensorHandle w_h, StableIValue *opts);

/* cross_entropy_backward: cross_entropy_check's checks, then grad_losses (like the target, of the
 * logits' dtype), grad_loss (0-d, of the logits' dtype) and lse (like the target, float64 or
 * float32, contiguous). */
cross_entropy_args cross_entropy_backward_check(const char *op, __typeof__(opf_check_device) *check_device,
                                                AtenTensorHandle gl_h, AtenTensorHandle g_h, AtenTensorHandle x_h,
                                                AtenTensorHandle t_h, AtenTensorHandle w_h, AtenTensorHandle lse_h,
                                                StableIValue *opts);

/* The forward's outputs on the logits' device, contiguous: losses (lead dims) and loss (0-d) of
 * the logits' dtype, lse (lead dims) float64. Each handle is stored as soon as it is made, so that
 * the caller (which declares them OPF_OWNED, NULL) frees it on every path. */
void cross_entropy_alloc(const char *op, const opf_tensor *logits, AtenTensorHandle *losses_h, AtenTensorHandle *loss_h,
                         AtenTensorHandle *lse_h);

#endif
