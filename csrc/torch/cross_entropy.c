/*
 * torch glue of the fused cross-entropy (class dim last):
 *   cross_entropy(logits (..., C), target (...) int64, weight (C)?, ignore_index, label_smoothing,
 *                 reduction, softcap?) -> (losses (...), loss (), lse (...) float64)
 *     losses: the per-row losses (0 on ignored rows); loss: their mean (reduction 1, over the
 *     target weights) or sum (2, and 0 "none"); lse: the per-row logsumexp, saved for the backward
 *   cross_entropy_backward(grad_losses, grad_loss, logits, target, weight?, lse (float64 or float32), ...)
 *     -> dlogits
 *     contiguous (..., C), from the logits and lse alone
 * Check, allocate, call; the arithmetic is csrc/kernels/cross_entropy.c. The
 * targets are checked (in range or ignore_index) before anything is computed.
 * Operands of any strides are read in place. The checks and the forward's
 * outputs are shared with the CUDA glue (cross_entropy.h).
 */
#include "cross_entropy.h"

#include "../kernels/cross_entropy.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char CE[] = OPF_QUALNAME("cross_entropy");
static const char CEB[] = OPF_QUALNAME("cross_entropy_backward");

/* torch's Reduction codes, which linear_cross_entropy takes too */
OPF_REGISTER_ENUM(reduction, {"none", CROSS_ENTROPY_REDUCTION_NONE}, {"mean", CROSS_ENTROPY_REDUCTION_MEAN},
                  {"sum", CROSS_ENTROPY_REDUCTION_SUM});

cross_entropy_args cross_entropy_check(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle x_h,
                                       AtenTensorHandle t_h, AtenTensorHandle w_h, StableIValue *opts) {
    cross_entropy_args a = {.logits = opf_tensor_info(op, "logits", x_h)};
    a.target = opf_tensor_info(op, "target", t_h);
    const opf_tensor *x = &a.logits, *t = &a.target;
    check_device(op, "logits", x, "logits", x);
    opf_dtype dt = opf_check_float(op, "logits", x);
    check_device(op, "target", t, "logits", x);
    if (t->dtype != aoti_torch_dtype_int64())
        opf_fail(op, "argument 'target' must be int64 class indices, got %s", opf_dtype_name(t->dtype));
    if (x->ndim < 1) opf_fail(op, "argument 'logits' must have at least 1 dim (..., C), got a 0-d tensor");
    opf_tensor lead = {.ndim = x->ndim - 1, .sizes = x->sizes};
    opf_check_same_shape(op, "target", t, "logits without its last (class) dim", &lead);
    const int64_t C = x->sizes[x->ndim - 1];
    a.has_weight = w_h != NULL;
    if (w_h) {
        a.weight = opf_tensor_info(op, "weight", w_h);
        check_device(op, "weight", &a.weight, "logits", x);
        opf_check_same_dtype(op, "weight", &a.weight, "logits", x);
        opf_check_dims(op, "weight", &a.weight, 1, "(C,)");
        opf_check_size(op, "weight", &a.weight, 0, "logits", x, -1);
    }
    int64_t ignore = opf_arg_int(opts[0]);
    double eps = opf_arg_double(opts[1]);
    int64_t reduction = opf_arg_int(opts[2]);
    double cap = 0;
    int has_cap = opf_arg_optional_double(opts[3], &cap);
    if (!(eps >= 0 && eps <= 1)) opf_fail(op, "argument 'label_smoothing' must be in [0, 1], got %g", eps);
    opf_check_enum(op, "reduction", &opf_enum_reduction, reduction);
    if (has_cap && !(cap > 0)) opf_fail(op, "argument 'softcap' must be > 0 or None, got %g", cap);
    int64_t rows = 1;
    for (int64_t d = 0; d < x->ndim - 1; d++) rows *= x->sizes[d];
    a.p = (cross_entropy_problem){.dt = dt,
                                  .rows = rows,
                                  .classes = C,
                                  .lead_ndim = (int)(x->ndim - 1),
                                  .lead_sizes = x->sizes,
                                  .logits = x->data,
                                  .logits_strides = x->strides,
                                  .target = t->data,
                                  .target_strides = t->strides,
                                  .weight = w_h ? a.weight.data : NULL,
                                  .weight_stride = w_h ? a.weight.strides[0] : 0,
                                  .ignore_index = ignore,
                                  .label_smoothing = eps,
                                  .softcap = has_cap ? cap : 0,
                                  .reduction = (int)reduction};
    /* only targets in host memory are read here (not meta ones, nor a GPU's: see cross_entropy.h) */
    if (x->device_type == aoti_torch_device_type_cpu()) {
        int64_t value = 0, row = cross_entropy_check_target(&a.p, &value);
        if (row >= 0)
            opf_fail(
                op,
                "argument 'target' must hold class indices in [0, %lld) or ignore_index (%lld), got %lld at row %lld",
                (long long)C, (long long)ignore, (long long)value, (long long)row);
    }
    return a;
}

cross_entropy_args cross_entropy_backward_check(const char *op, __typeof__(opf_check_device) *check_device,
                                                AtenTensorHandle gl_h, AtenTensorHandle g_h, AtenTensorHandle x_h,
                                                AtenTensorHandle t_h, AtenTensorHandle w_h, AtenTensorHandle lse_h,
                                                StableIValue *opts) {
    cross_entropy_args a = cross_entropy_check(op, check_device, x_h, t_h, w_h, opts);
    const opf_tensor *x = &a.logits;
    a.grad_losses = opf_tensor_info(op, "grad_losses", gl_h);
    a.grad_loss = opf_tensor_info(op, "grad_loss", g_h);
    a.lse = opf_tensor_info(op, "lse", lse_h);
    const opf_tensor *gls = &a.grad_losses, *gs = &a.grad_loss, *lse = &a.lse;
    check_device(op, "grad_losses", gls, "logits", x);
    check_device(op, "grad_loss", gs, "logits", x);
    check_device(op, "lse", lse, "logits", x);
    opf_check_same_dtype(op, "grad_losses", gls, "logits", x);
    opf_check_same_dtype(op, "grad_loss", gs, "logits", x);
    opf_check_same_shape(op, "grad_losses", gls, "target", &a.target);
    opf_tensor scalar = {.ndim = 0};
    opf_check_same_shape(op, "grad_loss", gs, "a 0-d loss", &scalar);
    opf_check_same_shape(op, "lse", lse, "target", &a.target);
    if (lse->dtype != aoti_torch_dtype_float64() && lse->dtype != aoti_torch_dtype_float32())
        opf_fail(op, "argument 'lse' must be float64 (as the forward makes it) or float32, got %s",
                 opf_dtype_name(lse->dtype));
    /* an empty lse (a leading dim 0) has any strides: nothing of it is read */
    for (int64_t d = lse->ndim - 1, step = 1; d >= 0 && lse->numel > 0; step *= lse->sizes[d], d--)
        if (lse->sizes[d] > 1 && lse->strides[d] != step)
            opf_fail(op, "argument 'lse' must be contiguous (the tensor the forward made)");
    return a;
}

void cross_entropy_alloc(const char *op, const opf_tensor *x, AtenTensorHandle *losses_h, AtenTensorHandle *loss_h,
                         AtenTensorHandle *lse_h) {
    *losses_h = opf_empty(op, x->ndim - 1, x->sizes, x->dtype, x);
    *loss_h = opf_empty(op, 0, NULL, x->dtype, x);
    *lse_h = opf_empty(op, x->ndim - 1, x->sizes, aoti_torch_dtype_float64(), x);
}

static void cross_entropy_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(t, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    cross_entropy_args a = cross_entropy_check(CE, opf_check_device, x_h, t_h, w_h, stack + 3);
    const opf_tensor *x = &a.logits;
    OPF_OWNED AtenTensorHandle losses_h = NULL;
    OPF_OWNED AtenTensorHandle loss_h = NULL;
    OPF_OWNED AtenTensorHandle lse_h = NULL;
    cross_entropy_alloc(CE, x, &losses_h, &loss_h, &lse_h);
    if (!opf_is_meta(x)) {
        opf_tensor losses = opf_tensor_info(CE, "losses", losses_h), loss = opf_tensor_info(CE, "loss", loss_h);
        opf_tensor lse = opf_tensor_info(CE, "lse", lse_h);
        a.p.losses = losses.data, a.p.loss = loss.data, a.p.lse = lse.data;
        const cross_entropy_kernels *k = cross_entropy_kernels_for(opf_isa_current());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(CE, cross_entropy_fwd_workspace(&a.p), x, &ws);
        cross_entropy_fwd(k, &a.p, ws);
        opf_log_call(CE, t0, 2, (opf_tensor[]){*x, a.target});
    }
    OPF_RETURN(stack, 0, losses_h);
    OPF_RETURN(stack, 1, loss_h);
    OPF_RETURN(stack, 2, lse_h);
}

static void cross_entropy_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gl, stack, 0);
    OPF_ARG_TENSOR(g, stack, 1);
    OPF_ARG_TENSOR(x, stack, 2);
    OPF_ARG_TENSOR(t, stack, 3);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[4]);
    OPF_ARG_TENSOR(lse, stack, 5);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    cross_entropy_args a =
        cross_entropy_backward_check(CEB, opf_check_device, gl_h, g_h, x_h, t_h, w_h, lse_h, stack + 6);
    const opf_tensor *x = &a.logits, *gls = &a.grad_losses, *gs = &a.grad_loss, *lse = &a.lse;
    OPF_OWNED AtenTensorHandle dx_h = opf_empty(CEB, x->ndim, x->sizes, x->dtype, x);
    if (!opf_is_meta(x)) {
        opf_tensor dx = opf_tensor_info(CEB, "dlogits", dx_h);
        a.p.grad_losses = gls->data, a.p.grad_losses_strides = gls->strides, a.p.grad_loss = gs->data;
        a.p.lse_saved = lse->data, a.p.dlogits = dx.data;
        a.p.lse_dt = lse->dtype == aoti_torch_dtype_float32() ? OPF_F32 : OPF_F64;
        cross_entropy_bwd(cross_entropy_kernels_for(opf_isa_current()), &a.p);
        opf_log_call(CEB, t0, 3, (opf_tensor[]){*x, a.target, dx});
    }
    OPF_RETURN(stack, 0, dx_h);
}

/* torch's CPU autocast runs cross_entropy in float32 (F.cross_entropy of bfloat16 logits under autocast
 * returns float32): the same policy */
static const opf_op_desc opf_cross_entropy_ops[] = {
    {
        .schema = "cross_entropy(Tensor logits, Tensor target, Tensor? weight, int ignore_index, "
                  "float label_smoothing, int reduction, float? softcap) -> (Tensor, Tensor, Tensor)",
        .cpu = cross_entropy_cpu,
        .shape = "[target[:]] dtype=logits; [] dtype=logits; [target[:]] dtype=float64",
        .backward = "cross_entropy_backward",
        .backward_args = "grad0,grad1,logits,target,weight,out2,ignore_index,label_smoothing,reduction,softcap",
        .backward_grads = "logits",
        .autocast = OPF_AUTOCAST_FP32,
        .flops = "4*numel(logits)",
        .meta = 1,
    },
    {
        .schema = "cross_entropy_backward(Tensor grad_losses, Tensor grad_loss, Tensor logits, Tensor target, "
                  "Tensor? weight, Tensor lse, int ignore_index, float label_smoothing, int reduction, "
                  "float? softcap) -> Tensor",
        .cpu = cross_entropy_backward_cpu,
        .shape = "[logits[:]]",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "5*numel(logits)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_cross_entropy_ops);
OPF_REGISTER_FAMILY(cross_entropy_variants);

OPF_AOTI_SHIM(cross_entropy, 3,
              (AtenTensorHandle logits, AtenTensorHandle target, AtenTensorHandle *weight, int64_t ignore_index,
               double label_smoothing, int64_t reduction, double *softcap),
              logits, target, weight, ignore_index, label_smoothing, reduction, softcap);
OPF_AOTI_SHIM(cross_entropy_backward, 1,
              (AtenTensorHandle grad_losses, AtenTensorHandle grad_loss, AtenTensorHandle logits,
               AtenTensorHandle target, AtenTensorHandle *weight, AtenTensorHandle lse, int64_t ignore_index,
               double label_smoothing, int64_t reduction, double *softcap),
              grad_losses, grad_loss, logits, target, weight, lse, ignore_index, label_smoothing, reduction, softcap);
