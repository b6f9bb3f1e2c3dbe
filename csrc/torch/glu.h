/*
 * What the CPU glue of glu and glu_backward (glu.c) shares with their CUDA
 * glue (csrc/cuda/glu.c): the reading of act, every check of the tensors and
 * the outputs' allocation, so that both take and refuse the same arguments
 * with the same messages and give outputs of the same layout.
 */
#ifndef OPFORGE_TORCH_GLU_H
#define OPFORGE_TORCH_GLU_H

#include <stdint.h>

#include "../kernels/act.h"
#include "opforge/op.h"

/* The `str act` argument as an act_kind (torch's string freed), or fails op naming the activations glu
 * takes. The glue reads it before it checks the tensors (the CUDA glue before it takes its device
 * guard): a failure there would leave the string to no one. */
act_kind glu_arg_act(const char *op, StableIValue act);

/* The tensors of a call, checked, and its outputs. */
typedef struct glu_args {
    opf_tensor grad, gate, up; /* grad: the backward's only */
    opf_tensor out;            /* the forward's out, the backward's dgate */
    opf_tensor dup;            /* the backward's only */
    opf_dtype dt;
} glu_args;

/* Reads and checks the tensors of glu (grad_h NULL) or glu_backward: gate and up float, on one
 * device, of one dtype and shape; grad too in the backward. check_device is the glue's device check
 * (opf_check_device on the CPU, opf_check_cuda on the GPU). Then allocates the outputs like gate
 * (gate's strides when gate is dense, else contiguous) into *out_h and, in the backward, *dup_h:
 * handles the caller owns (OPF_OWNED, NULL before the call), so that they are released on every
 * path, a failure here included. out_h NULL: the checks alone, no output (glu_backward_, which
 * writes its outputs over gate and up). */
glu_args glu_prepare(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle grad_h,
                     AtenTensorHandle gate_h, AtenTensorHandle up_h, AtenTensorHandle *out_h, AtenTensorHandle *dup_h);

#endif
