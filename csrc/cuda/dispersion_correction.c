/*
 * CUDA glue of dispersion_correction and its backward: check, guard, stream,
 * allocate through torch, launch (csrc/cuda/dispersion_correction.cu). The
 * schema, fake kernel, autograd and autocast are the CPU op's
 * (csrc/torch/dispersion_correction.c), and so are the checks, the messages
 * and the output's layout, through the same function
 * (dispersion_correction_prepare, csrc/torch/dispersion_correction.h). Any
 * strides: a dense x (any permutation) is walked as one flat array, else the
 * strided kernel walks the merged dims in place.
 */
#include "dispersion_correction.h"

#include "../torch/dispersion_correction.h"
#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char FWD[] = OPF_QUALNAME("dispersion_correction");
static const char BWD[] = OPF_QUALNAME("dispersion_correction_backward");

/* dispersion_correction(Tensor x, float alpha) -> Tensor */
static void dispersion_correction_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    double alpha = opf_arg_double(stack[1]);
    /* the guard on x's GPU before anything is allocated; it checks x's device first, as
     * dispersion_correction_prepare does */
    const opf_tensor x = opf_tensor_info(FWD, "x", x_h);
    OPF_CUDA_CALL(call, FWD, &x, "x");
    OPF_OWNED AtenTensorHandle y_h = NULL;
    const dispersion_correction_args a = dispersion_correction_prepare(FWD, opf_check_cuda, NULL, x_h, &y_h);

    opf_cuda_nd nd;
    const int64_t *strides[] = {a.out.strides, a.x.strides};
    opf_cuda_nd_init(FWD, &nd, (int)a.x.ndim, a.x.sizes, 2, strides);
    unsigned grid = dispersion_correction_cuda_fwd(a.dt, a.out.data, a.x.data, &nd, alpha, call.stream);
    opf_cuda_done(&call, NULL, nd.flat ? "dispersion_correction_fwd_flat" : "dispersion_correction_fwd_strided", grid,
                  DISPERSION_CORRECTION_CUDA_THREADS, 2, (opf_tensor[]){a.x, a.out});
    OPF_RETURN(stack, 0, y_h);
}

/* dispersion_correction_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void dispersion_correction_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    double alpha = opf_arg_double(stack[2]);
    const opf_tensor x = opf_tensor_info(BWD, "x", x_h);
    OPF_CUDA_CALL(call, BWD, &x, "x");
    OPF_OWNED AtenTensorHandle dx_h = NULL;
    const dispersion_correction_args a = dispersion_correction_prepare(BWD, opf_check_cuda, grad_h, x_h, &dx_h);

    opf_cuda_nd nd;
    const int64_t *strides[] = {a.out.strides, a.grad.strides, a.x.strides};
    opf_cuda_nd_init(BWD, &nd, (int)a.x.ndim, a.x.sizes, 3, strides);
    unsigned grid = dispersion_correction_cuda_bwd(a.dt, a.out.data, a.grad.data, a.x.data, &nd, alpha, call.stream);
    opf_cuda_done(&call, NULL, nd.flat ? "dispersion_correction_bwd_flat" : "dispersion_correction_bwd_strided", grid,
                  DISPERSION_CORRECTION_CUDA_THREADS, 3, (opf_tensor[]){a.grad, a.x, a.out});
    OPF_RETURN(stack, 0, dx_h);
}

OPF_REGISTER_CUDA(dispersion_correction, dispersion_correction_cuda);
OPF_REGISTER_CUDA(dispersion_correction_backward, dispersion_correction_backward_cuda);
