/*
 * What the CPU glue of rope and rope_backward (rope.c) shares with their CUDA
 * glue (csrc/cuda/rope.c): every check of the arguments and the outputs'
 * allocation, so that both take and refuse the same arguments with the same
 * messages and give outputs of the same layout.
 */
#ifndef OPFORGE_TORCH_ROPE_H
#define OPFORGE_TORCH_ROPE_H

#include "../kernels/rope.h"
#include "opforge/op.h"

/* A call's arguments, checked, its outputs, and the problem they make for rope_run. */
typedef struct rope_args {
    const char *op, *qname, *kname;
    opf_tensor q, k, cos, sin, pos; /* pos: with has_pos only */
    opf_tensor oq, ok;
    int has_pos;
    rope_problem p;
} rope_args;

/* Reads and checks the arguments of rope (qname "q", kname "k", inverse 0) or rope_backward
 * ("grad_q", "grad_k", 1); pos_h is position_ids (NULL for None). check_device is the glue's device
 * check (opf_check_device on the CPU, opf_check_cuda on the GPU). The position ids of a CPU tensor
 * are checked against the rows of the table here, before any output is written; those on the GPU
 * are left to the kernel, which checks each as it reads it. Then allocates q_out and k_out like q
 * and k (their strides when they are dense, else contiguous) into *oq_h and *ok_h: handles the
 * caller owns (OPF_OWNED, NULL before the call), so that they are released on every path, a
 * failure here included. */
rope_args rope_prepare(const char *op, const char *qname, const char *kname, __typeof__(opf_check_device) *check_device,
                       AtenTensorHandle q_h, AtenTensorHandle k_h, AtenTensorHandle cos_h, AtenTensorHandle sin_h,
                       AtenTensorHandle pos_h, int interleaved, int inverse, AtenTensorHandle *oq_h,
                       AtenTensorHandle *ok_h);

#endif
