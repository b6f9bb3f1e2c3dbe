/*
 * torch glue of the gated linear units:
 *   glu(gate (..., F), up (..., F), act) -> act(gate) * up
 *   glu_backward(grad, gate, up, act) -> (dgate, dup)
 * act is an act_kind code (2 = gelu, 3 = gelu_tanh, 4 = silu: geglu, geglu
 * with the tanh approximation, swiglu), mapped from names in functional.py.
 * The packed (..., 2F) form is x.chunk(2, -1) in functional.py: two views
 * that these kernels read in place. No copies: any strides are read in place.
 * out, dgate and dup take gate's strides when gate is dense, else they are
 * contiguous. Check, allocate, call; the arithmetic is in csrc/kernels/glu*.
 */
#include "../kernels/glu.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("glu");
static const char BWD[] = OPF_QUALNAME("glu_backward");

OPF_REGISTER_ENUM(glu_activation, {"gelu", ACT_GELU}, {"gelu_tanh", ACT_GELU_TANH}, {"silu", ACT_SILU});

static act_kind check_act(const char *op, int64_t act) {
    return (act_kind)opf_check_enum(op, "act", &opf_enum_glu_activation, act);
}

/* gate and up: float, one device, dtype and shape */
static opf_dtype check_gate_up(const char *op, const opf_tensor *gate, const opf_tensor *up) {
    opf_check_device(op, "gate", gate, "gate", gate);
    opf_check_device(op, "up", up, "gate", gate);
    opf_dtype dt = opf_check_float(op, "gate", gate);
    opf_check_same_dtype(op, "up", up, "gate", gate);
    opf_check_same_shape(op, "up", up, "gate", gate);
    return dt;
}

/* glu(Tensor gate, Tensor up, int act) -> Tensor */
static void glu_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gate, stack, 0);
    OPF_ARG_TENSOR(up, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = check_act(FWD, opf_arg_int(stack[2]));
    opf_tensor gate = opf_tensor_info(FWD, "gate", gate_h), up = opf_tensor_info(FWD, "up", up_h);
    opf_dtype dt = check_gate_up(FWD, &gate, &up);

    OPF_OWNED AtenTensorHandle out_h = opf_empty_like(FWD, &gate);
    opf_tensor out = opf_tensor_info(FWD, "out", out_h);
    if (opf_is_meta(&gate)) {
        OPF_RETURN(stack, 0, out_h);
        return;
    }
    opf_nd nd;
    const int64_t *strides[] = {out.strides, gate.strides, up.strides};
    opf_nd_init(&nd, (int)gate.ndim, gate.sizes, 3, strides);
    opf_nd_log(FWD, &nd, GLU_GRAIN);
    glu_fwd(glu_kernels_for(opf_isa_current()), dt, &nd, out.data, gate.data, up.data, act);

    opf_log_call(FWD, t0, 3, (opf_tensor[]){gate, up, out});
    OPF_RETURN(stack, 0, out_h);
}

/* glu_backward(Tensor grad, Tensor gate, Tensor up, int act) -> (Tensor, Tensor) */
static void glu_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(gate, stack, 1);
    OPF_ARG_TENSOR(up, stack, 2);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = check_act(BWD, opf_arg_int(stack[3]));
    opf_tensor g = opf_tensor_info(BWD, "grad", grad_h);
    opf_tensor gate = opf_tensor_info(BWD, "gate", gate_h), up = opf_tensor_info(BWD, "up", up_h);
    opf_dtype dt = check_gate_up(BWD, &gate, &up);
    opf_check_device(BWD, "grad", &g, "gate", &gate);
    opf_check_same_dtype(BWD, "grad", &g, "gate", &gate);
    opf_check_same_shape(BWD, "grad", &g, "gate", &gate);

    /* both like gate: one set of strides for the two outputs */
    OPF_OWNED AtenTensorHandle dgate_h = opf_empty_like(BWD, &gate);
    OPF_OWNED AtenTensorHandle dup_h = opf_empty_like(BWD, &gate);
    opf_tensor dgate = opf_tensor_info(BWD, "dgate", dgate_h), dup = opf_tensor_info(BWD, "dup", dup_h);
    if (!opf_is_meta(&gate)) {
        opf_nd nd;
        const int64_t *strides[] = {dgate.strides, g.strides, gate.strides, up.strides};
        opf_nd_init(&nd, (int)gate.ndim, gate.sizes, 4, strides);
        opf_nd_log(BWD, &nd, GLU_GRAIN);
        glu_bwd(glu_kernels_for(opf_isa_current()), dt, &nd, dgate.data, dup.data, g.data, gate.data, up.data, act);
        opf_log_call(BWD, t0, 4, (opf_tensor[]){g, gate, up, dgate});
    }
    OPF_RETURN(stack, 0, dgate_h);
    OPF_RETURN(stack, 1, dup_h);
}

static const opf_op_desc opf_glu_ops[] = {
    {
        .schema = "glu(Tensor gate, Tensor up, int act) -> Tensor",
        .cpu = glu_cpu,
        .shape = "like:gate",
        .backward = "glu_backward",
        .backward_args = "grad0,gate,up,act",
        .backward_grads = "gate,up",
        .autocast = OPF_AUTOCAST_PROMOTE, /* as eager silu(gate) * up under autocast */
        .flops = "6*numel(gate)",
        .meta = 1,
    },
    {
        .schema = "glu_backward(Tensor grad, Tensor gate, Tensor up, int act) -> (Tensor, Tensor)",
        .cpu = glu_backward_cpu,
        .shape = "like:gate;like:gate",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "10*numel(gate)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_glu_ops);
OPF_REGISTER_FAMILY(glu_variants);

OPF_AOTI_SHIM(glu, 1, (AtenTensorHandle gate, AtenTensorHandle up, int64_t act), gate, up, act);
OPF_AOTI_SHIM(glu_backward, 2, (AtenTensorHandle grad, AtenTensorHandle gate, AtenTensorHandle up, int64_t act), grad,
              gate, up, act);
