/*
 * torch glue of the gated linear units:
 *   glu(gate (..., F), up (..., F), act) -> act(gate) * up
 *   glu_backward(grad, gate, up, act) -> (dgate, dup)
 * act is "gelu", "gelu_tanh" or "silu" (geglu, geglu with the tanh
 * approximation, swiglu), read as an act_kind.
 * The packed (..., 2F) form is x.chunk(2, -1) in functional.py: two views
 * that these kernels read in place. No copies: any strides are read in place.
 * out, dgate and dup take gate's strides when gate is dense, else they are
 * contiguous. Check, allocate, call; the arithmetic is in csrc/kernels/glu*.
 * The checks and the allocation (glu_prepare, glu.h) serve the CUDA glue too.
 */
#include "glu.h"

#include "../kernels/glu.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("glu");
static const char BWD[] = OPF_QUALNAME("glu_backward");

/* the values of the schemas' `str act`, for .enums and opf_arg_enum */
#define GLU_ACTS "gelu|gelu_tanh|silu"

act_kind glu_arg_act(const char *op, StableIValue act) {
    static const act_kind kinds[] = {ACT_GELU, ACT_GELU_TANH, ACT_SILU}; /* GLU_ACTS' */
    return kinds[opf_arg_enum(op, "act", act, GLU_ACTS)];
}

glu_args glu_prepare(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle grad_h,
                     AtenTensorHandle gate_h, AtenTensorHandle up_h, AtenTensorHandle *out_h, AtenTensorHandle *dup_h) {
    glu_args a = {0};
    if (grad_h) a.grad = opf_tensor_info(op, "grad", grad_h);
    a.gate = opf_tensor_info(op, "gate", gate_h), a.up = opf_tensor_info(op, "up", up_h);
    /* gate and up: float, one device, dtype and shape */
    check_device(op, "gate", &a.gate, "gate", &a.gate);
    check_device(op, "up", &a.up, "gate", &a.gate);
    a.dt = opf_check_float(op, "gate", &a.gate);
    opf_check_same_dtype(op, "up", &a.up, "gate", &a.gate);
    opf_check_same_shape(op, "up", &a.up, "gate", &a.gate);
    if (grad_h) {
        check_device(op, "grad", &a.grad, "gate", &a.gate);
        opf_check_same_dtype(op, "grad", &a.grad, "gate", &a.gate);
        opf_check_same_shape(op, "grad", &a.grad, "gate", &a.gate);
    }

    /* like gate: in the backward, one set of strides for the two outputs */
    *out_h = opf_empty_like(op, &a.gate);
    a.out = opf_tensor_info(op, grad_h ? "dgate" : "out", *out_h);
    if (grad_h) {
        *dup_h = opf_empty_like(op, &a.gate);
        a.dup = opf_tensor_info(op, "dup", *dup_h);
    }
    return a;
}

/* glu(Tensor gate, Tensor up, str act) -> Tensor */
static void glu_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gate, stack, 0);
    OPF_ARG_TENSOR(up, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = glu_arg_act(FWD, stack[2]);
    OPF_OWNED AtenTensorHandle out_h = NULL;
    const glu_args a = glu_prepare(FWD, opf_check_device, NULL, gate_h, up_h, &out_h, NULL);
    if (opf_is_meta(&a.gate)) {
        OPF_RETURN(stack, 0, out_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {a.out.strides, a.gate.strides, a.up.strides};
    opf_nd_init(&nd, (int)a.gate.ndim, a.gate.sizes, 3, strides);
    opf_nd_log(FWD, &nd, GLU_GRAIN);
    glu_fwd(glu_kernels_for(opf_isa_current()), a.dt, &nd, a.out.data, a.gate.data, a.up.data, act);

    opf_log_call(FWD, t0, 3, (opf_tensor[]){a.gate, a.up, a.out});
    OPF_RETURN(stack, 0, out_h);
}

/* glu_backward(Tensor grad, Tensor gate, Tensor up, str act) -> (Tensor, Tensor) */
static void glu_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(gate, stack, 1);
    OPF_ARG_TENSOR(up, stack, 2);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = glu_arg_act(BWD, stack[3]);
    OPF_OWNED AtenTensorHandle dgate_h = NULL;
    OPF_OWNED AtenTensorHandle dup_h = NULL;
    const glu_args a = glu_prepare(BWD, opf_check_device, grad_h, gate_h, up_h, &dgate_h, &dup_h);
    if (!opf_is_meta(&a.gate)) {
        opf_nd nd;
        const int64_t *strides[] = {a.out.strides, a.grad.strides, a.gate.strides, a.up.strides};
        opf_nd_init(&nd, (int)a.gate.ndim, a.gate.sizes, 4, strides);
        opf_nd_log(BWD, &nd, GLU_GRAIN);
        glu_bwd(glu_kernels_for(opf_isa_current()), a.dt, &nd, a.out.data, a.dup.data, a.grad.data, a.gate.data,
                a.up.data, act);
        opf_log_call(BWD, t0, 4, (opf_tensor[]){a.grad, a.gate, a.up, a.out});
    }
    OPF_RETURN(stack, 0, dgate_h);
    OPF_RETURN(stack, 1, dup_h);
}

static const opf_op_desc opf_glu_ops[] = {
    {
        .schema = "glu(Tensor gate, Tensor up, str act) -> Tensor",
        .cpu = glu_cpu,
        .shape = "like:gate",
        .backward = "glu_backward",
        .backward_args = "grad0,gate,up,act",
        .backward_grads = "gate,up",
        .autocast = OPF_AUTOCAST_PROMOTE, /* as eager silu(gate) * up under autocast */
        .flops = "6*numel(gate)",
        .meta = 1,
        .enums = "act: " GLU_ACTS,
    },
    {
        .schema = "glu_backward(Tensor grad, Tensor gate, Tensor up, str act) -> (Tensor, Tensor)",
        .cpu = glu_backward_cpu,
        .shape = "like:gate;like:gate",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "10*numel(gate)",
        .meta = 1,
        .enums = "act: " GLU_ACTS,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_glu_ops);
OPF_REGISTER_FAMILY(glu_variants);

OPF_AOTI_SHIM(glu, 1, (AtenTensorHandle gate, AtenTensorHandle up, const char *act), gate, up, act);
OPF_AOTI_SHIM(glu_backward, 2, (AtenTensorHandle grad, AtenTensorHandle gate, AtenTensorHandle up, const char *act),
              grad, gate, up, act);
