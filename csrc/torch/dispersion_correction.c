/*
 * torch glue of dispersion_correction (y = x * alpha + sqrt(x)) and its
 * backward. Check, allocate, call; the arithmetic is in csrc/kernels.
 * No copies: any strides are read in place. The output takes x's strides when
 * x is dense (transposed, permuted), else it is contiguous.
 */
#include "../kernels/dispersion_correction.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("dispersion_correction");
static const char BWD[] = OPF_QUALNAME("dispersion_correction_backward");

/* dispersion_correction(Tensor x, float alpha) -> Tensor */
static void dispersion_correction_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    double alpha = opf_arg_double(stack[1]);
    opf_tensor x = opf_tensor_info(FWD, "x", x_h);
    opf_check_device(FWD, "x", &x, "x", &x);
    opf_dtype dt = opf_check_float(FWD, "x", &x);

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(FWD, &x);
    opf_tensor y = opf_tensor_info(FWD, "out", y_h);
    if (opf_is_meta(&x)) {
        OPF_RETURN(stack, 0, y_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {y.strides, x.strides};
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 2, strides);
    opf_nd_log(FWD, &nd, DISPERSION_CORRECTION_GRAIN);
    dispersion_correction_fwd(dispersion_correction_kernels_for(opf_isa_current()), dt, &nd, y.data, x.data, alpha);

    opf_log_call(FWD, t0, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
}

/* dispersion_correction_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void dispersion_correction_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    double alpha = opf_arg_double(stack[2]);
    opf_tensor g = opf_tensor_info(BWD, "grad", grad_h);
    opf_tensor x = opf_tensor_info(BWD, "x", x_h);
    opf_check_device(BWD, "x", &x, "x", &x);
    opf_check_device(BWD, "grad", &g, "x", &x);
    opf_dtype dt = opf_check_float(BWD, "x", &x);
    opf_check_same_dtype(BWD, "grad", &g, "x", &x);
    opf_check_same_shape(BWD, "grad", &g, "x", &x);

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(BWD, &x);
    opf_tensor dx = opf_tensor_info(BWD, "out", dx_h);
    if (opf_is_meta(&x)) {
        OPF_RETURN(stack, 0, dx_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {dx.strides, g.strides, x.strides};
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 3, strides);
    opf_nd_log(BWD, &nd, DISPERSION_CORRECTION_GRAIN);
    dispersion_correction_bwd(dispersion_correction_kernels_for(opf_isa_current()), dt, &nd, dx.data, g.data, x.data,
                              alpha);

    opf_log_call(BWD, t0, 3, (opf_tensor[]){g, x, dx});
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
