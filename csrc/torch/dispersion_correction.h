/*
 * What the CPU glue of dispersion_correction and its backward
 * (dispersion_correction.c) shares with their CUDA glue
 * (csrc/cuda/dispersion_correction.c): every check of the tensors and the
 * output's allocation, so that both take and refuse the same arguments with
 * the same messages and give outputs of the same layout.
 */
#ifndef OPFORGE_TORCH_DISPERSION_CORRECTION_H
#define OPFORGE_TORCH_DISPERSION_CORRECTION_H

#include "opforge/op.h"

/* The tensors of a call, checked, and its output. */
typedef struct dispersion_correction_args {
    opf_tensor grad, x; /* grad: the backward's only */
    opf_tensor out;     /* the forward's y, the backward's dx */
    opf_dtype dt;
} dispersion_correction_args;

/* Reads and checks the tensors of dispersion_correction (grad_h NULL) or its backward: x float;
 * in the backward grad on x's device, of its dtype and shape. check_device is the glue's device
 * check (opf_check_device on the CPU, opf_check_cuda on the GPU). Then allocates the output like x
 * (x's strides when x is dense, else contiguous) into *out_h: a handle the caller owns (OPF_OWNED,
 * NULL before the call), so that it is released on every path, a failure here included. */
dispersion_correction_args dispersion_correction_prepare(const char *op, __typeof__(opf_check_device) *check_device,
                                                         AtenTensorHandle grad_h, AtenTensorHandle x_h,
                                                         AtenTensorHandle *out_h);

#endif
