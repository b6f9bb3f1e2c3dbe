/*
 * torch glue of the gated linear units:
 *   glu(gate (..., F), up (..., F), act) -> act(gate) * up
 *   glu_backward(grad, gate, up, act) -> (dgate, dup)
 *   glu_backward_(grad, gate!, up!, act) -> (): the same, dgate written over gate and dup over up
 *     (the autograd wiring calls it when the saved gate and up are no one else's: "gate!,up!")
 * act is "gelu", "gelu_tanh" or "silu" (geglu, geglu with the tanh
 * approximation, swiglu), read as an act_kind.
 * The packed (..., 2F) form is x.chunk(2, -1) in functional.py: two views
 * that these kernels read in place. No copies: any strides are read in place.
 * out, dgate and dup take gate's strides when gate is dense, else they are
 * contiguous. Check, allocate, call; the arithmetic is in csrc/kernels/glu*.
 * The checks and the allocation (glu_prepare, glu.h) serve the CUDA glue too.
 */
#include "glu.h"

#include <stdio.h>

#include "../kernels/glu.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("glu");
static const char BWD[] = OPF_QUALNAME("glu_backward");
static const char BWD_INPLACE[] = OPF_QUALNAME("glu_backward_");

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

    if (out_h == NULL) return a;
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

/* The backward's kernel over its n-d iteration into dgate and dup (one set of strides: dstrides), then
 * its log line (out: the dgate tensor, NULL when written over gate) */
static void backward_run(const char *op, const glu_args *a, const int64_t *dstrides, void *dgate, void *dup,
                         act_kind act, double t0, const opf_tensor *out) {
    opf_nd nd;
    const int64_t *strides[] = {dstrides, a->grad.strides, a->gate.strides, a->up.strides};
    opf_nd_init(&nd, (int)a->gate.ndim, a->gate.sizes, 4, strides);
    opf_nd_log(op, &nd, GLU_GRAIN);
    glu_bwd(glu_kernels_for(opf_isa_current()), a->dt, &nd, dgate, dup, a->grad.data, a->gate.data, a->up.data, act);
    opf_log_call(op, t0, out ? 4 : 3, (opf_tensor[]){a->grad, a->gate, a->up, out ? *out : a->gate});
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
    if (!opf_is_meta(&a.gate)) backward_run(BWD, &a, a.out.strides, a.out.data, a.dup.data, act, t0, &a.out);
    OPF_RETURN(stack, 0, dgate_h);
    OPF_RETURN(stack, 1, dup_h);
}

/* Whether the memory of a and b (dense tensors of elements of es bytes) overlaps */
static int overlaps(const opf_tensor *a, const opf_tensor *b, size_t es) {
    const char *a0 = a->data, *b0 = b->data;
    return a0 < b0 + (size_t)b->numel * es && b0 < a0 + (size_t)a->numel * es;
}

/* "(4096, 1)": t's strides */
static void strides_str(char *buf, size_t len, const opf_tensor *t) {
    size_t n = (size_t)snprintf(buf, len, "(");
    for (int64_t d = 0; d < t->ndim && n < len; d++)
        n += (size_t)snprintf(buf + n, len - n, d ? ", %lld" : "%lld", (long long)t->strides[d]);
    if (n < len) snprintf(buf + n, len - n, ")");
}

/* glu_backward_(Tensor grad, Tensor(a!) gate, Tensor(b!) up, str act) -> ():
 * glu_backward's checks and kernel, dgate written over gate and dup over up (each element is read
 * before it is written: the same values as glu_backward's). gate and up must be dense, of one set of
 * strides, and apart. Without fresh outputs a large backward takes no page faults and pages nothing
 * in (pages.c), and its peak holds two tensors of gate's size fewer. */
static void glu_backward_inplace_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(gate, stack, 1);
    OPF_ARG_TENSOR(up, stack, 2);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = glu_arg_act(BWD_INPLACE, stack[3]);
    const glu_args a = glu_prepare(BWD_INPLACE, opf_check_device, grad_h, gate_h, up_h, NULL, NULL);
    if (a.gate.numel > 0) {
        const int ndim = (int)a.gate.ndim;
        int same = 1;
        for (int d = 0; d < ndim; d++) same &= a.gate.sizes[d] == 1 || a.gate.strides[d] == a.up.strides[d];
        if (!opf_is_dense(ndim, a.gate.sizes, a.gate.strides) || !same) {
            char g[256], u[256];
            strides_str(g, sizeof g, &a.gate), strides_str(u, sizeof u, &a.up);
            opf_fail(BWD_INPLACE,
                     "arguments 'gate' and 'up' must be dense with the same strides (the gradients are written "
                     "over them), got strides %s and %s",
                     g, u);
        }
        if (!opf_is_meta(&a.gate) && overlaps(&a.gate, &a.up, opf_dtype_size(a.dt)))
            opf_fail(BWD_INPLACE, "arguments 'gate' and 'up' must not overlap in memory (the gradients are written "
                                  "over them)");
    }
    if (!opf_is_meta(&a.gate)) backward_run(BWD_INPLACE, &a, a.gate.strides, a.gate.data, a.up.data, act, t0, NULL);
}

static const opf_op_desc opf_glu_ops[] = {
    {
        .schema = "glu(Tensor gate, Tensor up, str act) -> Tensor",
        .cpu = glu_cpu,
        .shape = "like:gate",
        .backward = "glu_backward",
        .backward_args = "grad0,gate!,up!,act",
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
    {
        .schema = "glu_backward_(Tensor grad, Tensor(a!) gate, Tensor(b!) up, str act) -> ()",
        .cpu = glu_backward_inplace_cpu,
        .shape = "",
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
OPF_AOTI_SHIM(glu_backward_, 0, (AtenTensorHandle grad, AtenTensorHandle gate, AtenTensorHandle up, const char *act),
              grad, gate, up, act);
