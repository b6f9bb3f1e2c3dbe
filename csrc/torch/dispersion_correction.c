/*
 * torch glue of dispersion_correction (y = x * alpha + sqrt(x)) and its
 * backward. Check, allocate, call; the arithmetic is in csrc/kernels. The
 * checks and the allocation (dispersion_correction_prepare,
 * dispersion_correction.h) serve the CUDA glue too.
 * No copies: any strides are read in place. The output takes x's strides when
 * x is dense (transposed, permuted), else it is contiguous.
 */
#include "dispersion_correction.h"

#include "../kernels/dispersion_correction.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("dispersion_correction");
static const char BWD[] = OPF_QUALNAME("dispersion_correction_backward");

dispersion_correction_args dispersion_correction_prepare(const char *op, __typeof__(opf_check_device) *check_device,
                                                         AtenTensorHandle grad_h, AtenTensorHandle x_h,
                                                         AtenTensorHandle *out_h) {
    dispersion_correction_args a = {0};
    if (grad_h) a.grad = opf_tensor_info(op, "grad", grad_h);
    a.x = opf_tensor_info(op, "x", x_h);
    check_device(op, "x", &a.x, "x", &a.x);
    if (grad_h) check_device(op, "grad", &a.grad, "x", &a.x);
    a.dt = opf_check_float(op, "x", &a.x);
    if (grad_h) {
        opf_check_same_dtype(op, "grad", &a.grad, "x", &a.x);
        opf_check_same_shape(op, "grad", &a.grad, "x", &a.x);
    }

    *out_h = opf_empty_like(op, &a.x);
    a.out = opf_tensor_info(op, "out", *out_h);
    return a;
}

/* dispersion_correction(Tensor x, float alpha) -> Tensor */
static void dispersion_correction_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    double alpha = opf_arg_double(stack[1]);
    OPF_OWNED AtenTensorHandle y_h = NULL;
    const dispersion_correction_args a = dispersion_correction_prepare(FWD, opf_check_device, NULL, x_h, &y_h);
    if (opf_is_meta(&a.x)) {
        OPF_RETURN(stack, 0, y_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {a.out.strides, a.x.strides};
    opf_nd_init(&nd, (int)a.x.ndim, a.x.sizes, 2, strides);
    opf_nd_log(FWD, &nd, DISPERSION_CORRECTION_GRAIN);
    dispersion_correction_fwd(dispersion_correction_kernels_for(opf_isa_current()), a.dt, &nd, a.out.data, a.x.data,
                              alpha);

    opf_log_call(FWD, t0, 2, (opf_tensor[]){a.x, a.out});
    OPF_RETURN(stack, 0, y_h);
}

/* dispersion_correction_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void dispersion_correction_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    double alpha = opf_arg_double(stack[2]);
    OPF_OWNED AtenTensorHandle dx_h = NULL;
    const dispersion_correction_args a = dispersion_correction_prepare(BWD, opf_check_device, grad_h, x_h, &dx_h);
    if (opf_is_meta(&a.x)) {
        OPF_RETURN(stack, 0, dx_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {a.out.strides, a.grad.strides, a.x.strides};
    opf_nd_init(&nd, (int)a.x.ndim, a.x.sizes, 3, strides);
    opf_nd_log(BWD, &nd, DISPERSION_CORRECTION_GRAIN);
    dispersion_correction_bwd(dispersion_correction_kernels_for(opf_isa_current()), a.dt, &nd, a.out.data, a.grad.data,
                              a.x.data, alpha);

    opf_log_call(BWD, t0, 3, (opf_tensor[]){a.grad, a.x, a.out});
    OPF_RETURN(stack, 0, dx_h);
}

static const opf_op_desc opf_dispersion_correction_ops[] = {
    {
        .schema = "dispersion_correction(Tensor x, float alpha) -> Tensor",
        .cpu = dispersion_correction_cpu,
        .shape = "like:x",
        .backward = "dispersion_correction_backward",
        .backward_args = "grad0,x,alpha",
        .backward_grads = "x",
        .autocast = OPF_AUTOCAST_PROMOTE, /* as eager x * alpha + sqrt(x) under autocast: the widest input */
        .flops = "3*numel(x)",
        .meta = 1,
    },
    {
        .schema = "dispersion_correction_backward(Tensor grad, Tensor x, float alpha) -> Tensor",
        .cpu = dispersion_correction_backward_cpu,
        .shape = "like:x",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "5*numel(x)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_dispersion_correction_ops);
OPF_REGISTER_FAMILY(dispersion_correction_variants);

OPF_AOTI_SHIM(dispersion_correction, 1, (AtenTensorHandle x, double alpha), x, alpha);
OPF_AOTI_SHIM(dispersion_correction_backward, 1, (AtenTensorHandle grad, AtenTensorHandle x, double alpha), grad, x,
              alpha);
