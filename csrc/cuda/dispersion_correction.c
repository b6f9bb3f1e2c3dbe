/*
 * CUDA glue of dispersion_correction and its backward: check, guard, stream,
 * allocate through torch, launch (csrc/cuda/dispersion_correction.cu). The
 * schema, fake kernel, autograd and autocast are the CPU op's
 * (csrc/torch/dispersion_correction.c). Any strides: a dense x (any
 * permutation) is walked as one flat array, else the strided kernel walks the
 * merged dims in place.
 */
#include "dispersion_correction.h"

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
    opf_tensor x = opf_tensor_info(FWD, "x", x_h);
    OPF_CUDA_CALL(call, FWD, &x, "x");
    opf_dtype dt = opf_check_float(FWD, "x", &x);

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(FWD, &x);
    opf_tensor y = opf_tensor_info(FWD, "out", y_h);
    opf_cuda_nd nd;
    const int64_t *strides[] = {y.strides, x.strides};
    opf_cuda_nd_init(FWD, &nd, (int)x.ndim, x.sizes, 2, strides);
    unsigned grid = dispersion_correction_cuda_fwd(dt, y.data, x.data, &nd, alpha, call.stream);
    opf_cuda_done(&call, NULL, nd.flat ? "dispersion_correction_fwd_flat" : "dispersion_correction_fwd_strided", grid,
                  DISPERSION_CORRECTION_CUDA_THREADS, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
}

/* dispersion_correction_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void dispersion_correction_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    double alpha = opf_arg_double(stack[2]);
    opf_tensor g = opf_tensor_info(BWD, "grad", grad_h);
    opf_tensor x = opf_tensor_info(BWD, "x", x_h);
    OPF_CUDA_CALL(call, BWD, &x, "x");
    opf_check_cuda(BWD, "grad", &g, "x", &x);
    opf_dtype dt = opf_check_float(BWD, "x", &x);
    opf_check_same_dtype(BWD, "grad", &g, "x", &x);
    opf_check_same_shape(BWD, "grad", &g, "x", &x);

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(BWD, &x);
    opf_tensor dx = opf_tensor_info(BWD, "out", dx_h);
    opf_cuda_nd nd;
    const int64_t *strides[] = {dx.strides, g.strides, x.strides};
    opf_cuda_nd_init(BWD, &nd, (int)x.ndim, x.sizes, 3, strides);
    unsigned grid = dispersion_correction_cuda_bwd(dt, dx.data, g.data, x.data, &nd, alpha, call.stream);
    opf_cuda_done(&call, NULL, nd.flat ? "dispersion_correction_bwd_flat" : "dispersion_correction_bwd_strided", grid,
                  DISPERSION_CORRECTION_CUDA_THREADS, 3, (opf_tensor[]){g, x, dx});
    OPF_RETURN(stack, 0, dx_h);
}

OPF_REGISTER_CUDA(dispersion_correction, dispersion_correction_cuda);
OPF_REGISTER_CUDA(dispersion_correction_backward, dispersion_correction_backward_cuda);
