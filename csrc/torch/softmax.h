/*
 * What the CPU glue of softmax and log_softmax (softmax.c) shares with the
 * CUDA glue (csrc/cuda/softmax.c): every argument check, with the device
 * check passed in (opf_check_device on the CPU, opf_check_cuda on the GPU).
 * The output is opf_empty_like the reference (x forward, y backward): x's
 * strides when x is dense, else contiguous. A glue allocates it after these
 * checks, the CUDA glue once it holds its device guard.
 */
#ifndef OPFORGE_TORCH_SOFTMAX_H
#define OPFORGE_TORCH_SOFTMAX_H

#include <stdint.h>

#include "opforge/op.h"

/* softmax(x, dim) and log_softmax(x, dim), checked: x's metadata, its dtype and dim in [0, ndim) */
typedef struct softmax_args {
    opf_tensor x;
    opf_dtype dt;
    int dim;
} softmax_args;

/* softmax_backward(grad, y, dim) and log_softmax_backward, checked: grad like y (device, dtype,
 * shape), y's dtype and dim in [0, ndim) */
typedef struct softmax_backward_args {
    opf_tensor grad, y;
    opf_dtype dt;
    int dim;
} softmax_backward_args;

/* Reads x and checks it (check_device(op, "x", &x, "x", &x) first) and dim (a 0-d x takes dim 0
 * or -1, as torch); fails op with a message naming the argument. */
softmax_args softmax_check(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle x_h,
                           int64_t dim);

/* Reads grad and y and checks them and dim, y first (check_device on y, then on grad against y). */
softmax_backward_args softmax_backward_check(const char *op, __typeof__(opf_check_device) *check_device,
                                             AtenTensorHandle grad_h, AtenTensorHandle y_h, int64_t dim);

#endif
