/*
 * What the CPU glue of the norms (norm.c) shares with their CUDA glue
 * (csrc/cuda/norm.c, in libopforge_cuda.so, which links this library): the
 * arguments' checks, with their messages, and the outputs' allocation, once
 * per op. The caller names the device its kernel takes: opf_check_device (cpu
 * or meta tensors) for the CPU glue, opf_check_cuda for the CUDA glue, which
 * takes its device guard before calling (the outputs are allocated here).
 */
#ifndef OPFORGE_TORCH_NORM_H
#define OPFORGE_TORCH_NORM_H

#include "../kernels/norm.h"
#include "opforge/op.h"

/* The glue's device check, of opf_check_device's signature: t on the device its kernel runs on and on
 * ref's device (ref may be t itself), or a RuntimeError naming both (opf_check_device, opf_check_cuda). */
typedef __typeof__(opf_check_device) *norm_check_device_fn;

/* One checked call: the rows of x (the sum for add_rms_norm_backward), the tensor inputs (all zero where
 * absent: a weight or bias not given, the residual and grad_sum of rms_norm, the mean and rstd a
 * forward returns), and the outputs in the schema's order, contiguous, on x's device. The outputs'
 * handles are owned by the call until norm_call_return hands them to the stack: declare it
 * NORM_CALL_OWNED and zeroed (= {0}), so that they are released on every other path (opf_fail's
 * exception included, also one raised while norm_prepare_* allocates them). */
typedef struct norm_call {
    norm_shape sh;
    opf_tensor x, res, grad, grad_sum, w, b, mean, rstd;
    int nout;
    AtenTensorHandle out_h[3];
    opf_tensor out[3];
} norm_call;

static inline void norm_call_release(norm_call *c) {
    for (int i = 0; i < 3; i++) opf_tensor_release(&c->out_h[i]);
}
#define NORM_CALL_OWNED __attribute__((cleanup(norm_call_release)))

/* The outputs to stack[0 .. nout). */
static inline void norm_call_return(StableIValue *stack, norm_call *c) {
    for (int i = 0; i < c->nout; i++) OPF_RETURN(stack, i, c->out_h[i]);
}

/* Each reads its op's tensor arguments (the handles stay the caller's), checks them in the CPU glue's
 * order (x first: its device, dtype, dims and eps; then each other tensor against x) and allocates the
 * outputs into c, failing op with a message naming the argument. */

/* rms_norm (res_h NULL) and add_rms_norm: outputs y, the sum (add_rms_norm), rstd. */
void norm_prepare_rms(const char *op, norm_check_device_fn check, AtenTensorHandle x_h, AtenTensorHandle res_h,
                      AtenTensorHandle w_h, double eps, int offset, norm_call *c);
/* rms_norm_backward (gs_h NULL) and add_rms_norm_backward (gs_h given: x_h is the argument 'sum'):
 * outputs dx, dresidual (add_rms_norm_backward), dweight ([0] without a weight). */
void norm_prepare_rms_bwd(const char *op, norm_check_device_fn check, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                          AtenTensorHandle x_h, AtenTensorHandle w_h, AtenTensorHandle rstd_h, double eps, int offset,
                          norm_call *c);
/* layer_norm: outputs y, mean, rstd. */
void norm_prepare_ln(const char *op, norm_check_device_fn check, AtenTensorHandle x_h, AtenTensorHandle w_h,
                     AtenTensorHandle b_h, double eps, norm_call *c);
/* layer_norm_backward: outputs dx, dweight, dbias ([0] without a weight / bias). */
void norm_prepare_ln_bwd(const char *op, norm_check_device_fn check, AtenTensorHandle g_h, AtenTensorHandle x_h,
                         AtenTensorHandle w_h, AtenTensorHandle b_h, AtenTensorHandle mean_h, AtenTensorHandle rstd_h,
                         double eps, norm_call *c);

#endif
