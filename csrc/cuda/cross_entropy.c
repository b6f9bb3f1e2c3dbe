/*
 * CUDA glue of the fused cross-entropy and its backward: check, guard, stream,
 * allocate through torch, launch (csrc/cuda/cross_entropy.cu). The schemas,
 * fake kernels, autograd and autocast are the CPU ops'
 * (csrc/torch/cross_entropy.c), and so are the checks, the outputs (losses
 * and loss of the logits' dtype, lse float64, dlogits contiguous) and the
 * walk: operands of any strides read in place.
 *
 * One difference: the CPU op raises when a target is neither in [0, C) nor
 * ignore_index, before computing anything. The targets live on the GPU here
 * and reading them back would synchronise the stream (and break CUDA graph
 * capture), so the kernels check them instead: such a row's loss and lse are
 * NaN (so are the mean and the sum) and its gradient row is NaN.
 */
#include "cross_entropy.h"

#include "../kernels/cross_entropy.h"
#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char CE[] = OPF_QUALNAME("cross_entropy");
static const char CEB[] = OPF_QUALNAME("cross_entropy_backward");

extern const opf_enum_desc opf_enum_reduction; /* csrc/torch/cross_entropy.c */

typedef struct ce_args {
    opf_tensor logits, target, weight;
    opf_dtype dt;
    int has_weight;
    int64_t lead_strides[OPF_MAX_DIMS]; /* contiguous strides of the lead dims: the row index */
    cross_entropy_cuda_problem p;
} ce_args;

/* The CPU glue's checks (logits already checked to be on the GPU by the caller's OPF_CUDA_CALL). */
static void check_ce(ce_args *a, const char *op, AtenTensorHandle t_h, AtenTensorHandle w_h, StableIValue *opts) {
    a->target = opf_tensor_info(op, "target", t_h);
    const opf_tensor *x = &a->logits, *t = &a->target;
    a->dt = opf_check_float(op, "logits", x);
    opf_check_cuda(op, "target", t, "logits", x);
    if (t->dtype != aoti_torch_dtype_int64())
        opf_fail(op, "argument 'target' must be int64 class indices, got %s", opf_dtype_name(t->dtype));
    if (x->ndim < 1) opf_fail(op, "argument 'logits' must have at least 1 dim (..., C), got a 0-d tensor");
    opf_tensor lead = {.ndim = x->ndim - 1, .sizes = x->sizes};
    opf_check_same_shape(op, "target", t, "logits without its last (class) dim", &lead);
    const int64_t C = x->sizes[x->ndim - 1];
    a->has_weight = w_h != NULL;
    if (w_h) {
        a->weight = opf_tensor_info(op, "weight", w_h);
        opf_check_cuda(op, "weight", &a->weight, "logits", x);
        opf_check_same_dtype(op, "weight", &a->weight, "logits", x);
        opf_tensor want = {.ndim = 1, .sizes = &C};
        opf_check_same_shape(op, "weight", &a->weight, "(C,), C the last dim of logits", &want);
    }
    int64_t ignore = opf_arg_int(opts[0]);
    double eps = opf_arg_double(opts[1]);
    int64_t reduction = opf_arg_int(opts[2]);
    double cap = 0;
    int has_cap = opf_arg_optional_double(opts[3], &cap);
    if (!(eps >= 0 && eps <= 1)) opf_fail(op, "argument 'label_smoothing' must be in [0, 1], got %g", eps);
    opf_check_enum(op, "reduction", &opf_enum_reduction, reduction);
    if (has_cap && !(cap > 0)) opf_fail(op, "argument 'softcap' must be > 0 or None, got %g", cap);
    const int lead_ndim = (int)(x->ndim - 1);
    int64_t rows = 1;
    for (int d = lead_ndim - 1; d >= 0; d--) {
        a->lead_strides[d] = rows;
        rows *= x->sizes[d];
    }
    a->p = (cross_entropy_cuda_problem){.nrows = rows,
                                        .classes = C,
                                        .class_stride = x->strides[lead_ndim],
                                        .weight_stride = w_h ? a->weight.strides[0] : 0,
                                        .ignore_index = ignore,
                                        .label_smoothing = eps,
                                        .softcap = has_cap ? cap : 0,
                                        .reduction = (int)reduction};
}

/* p->rows over the lead dims: the row index, the logits', the target's and (backward) grad_losses' */
static void plan_rows(ce_args *a, const char *op, const int64_t *grad_losses_strides) {
    const int64_t *strides[4] = {a->lead_strides, a->logits.strides, a->target.strides, grad_losses_strides};
    opf_cuda_nd_init(op, &a->p.rows, (int)(a->logits.ndim - 1), a->logits.sizes, grad_losses_strides ? 4 : 3, strides);
}

static void cross_entropy_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(t, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    ce_args a = {.logits = opf_tensor_info(CE, "logits", x_h)};
    OPF_CUDA_CALL(call, CE, &a.logits, "logits");
    check_ce(&a, CE, t_h, w_h, stack + 3);
    const opf_tensor *x = &a.logits;
    const opf_dtype dt = a.dt;
    OPF_OWNED AtenTensorHandle losses_h = opf_empty(CE, x->ndim - 1, x->sizes, x->dtype, x);
    OPF_OWNED AtenTensorHandle loss_h = opf_empty(CE, 0, NULL, x->dtype, x);
    OPF_OWNED AtenTensorHandle lse_h = opf_empty(CE, x->ndim - 1, x->sizes, aoti_torch_dtype_float64(), x);
    opf_tensor losses = opf_tensor_info(CE, "losses", losses_h), loss = opf_tensor_info(CE, "loss", loss_h);
    opf_tensor lse = opf_tensor_info(CE, "lse", lse_h);
    plan_rows(&a, CE, NULL);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h =
        opf_workspace(CE, cross_entropy_cuda_fwd_workspace(dt, &a.p, a.has_weight), x, &ws);
    cross_entropy_cuda_launch r = cross_entropy_cuda_fwd(dt, losses.data, loss.data, lse.data, x->data, a.target.data,
                                                         a.has_weight ? a.weight.data : NULL, ws, &a.p, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 2, (opf_tensor[]){*x, a.target});
    OPF_RETURN(stack, 0, losses_h);
    OPF_RETURN(stack, 1, loss_h);
    OPF_RETURN(stack, 2, lse_h);
}

static void cross_entropy_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gl, stack, 0);
    OPF_ARG_TENSOR(g, stack, 1);
    OPF_ARG_TENSOR(x, stack, 2);
    OPF_ARG_TENSOR(t, stack, 3);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[4]);
    OPF_ARG_TENSOR(lse, stack, 5);
    ce_args a = {.logits = opf_tensor_info(CEB, "logits", x_h)};
    OPF_CUDA_CALL(call, CEB, &a.logits, "logits");
    check_ce(&a, CEB, t_h, w_h, stack + 6);
    const opf_tensor *x = &a.logits;
    const opf_dtype dt = a.dt;
    opf_tensor gls = opf_tensor_info(CEB, "grad_losses", gl_h), gs = opf_tensor_info(CEB, "grad_loss", g_h);
    opf_tensor lse = opf_tensor_info(CEB, "lse", lse_h);
    opf_check_cuda(CEB, "grad_losses", &gls, "logits", x);
    opf_check_cuda(CEB, "grad_loss", &gs, "logits", x);
    opf_check_cuda(CEB, "lse", &lse, "logits", x);
    opf_check_same_dtype(CEB, "grad_losses", &gls, "logits", x);
    opf_check_same_dtype(CEB, "grad_loss", &gs, "logits", x);
    opf_check_same_shape(CEB, "grad_losses", &gls, "target", &a.target);
    opf_tensor scalar = {.ndim = 0};
    opf_check_same_shape(CEB, "grad_loss", &gs, "a 0-d loss", &scalar);
    opf_check_same_shape(CEB, "lse", &lse, "target", &a.target);
    if (lse.dtype != aoti_torch_dtype_float64() && lse.dtype != aoti_torch_dtype_float32())
        opf_fail(CEB, "argument 'lse' must be float64 (as the forward makes it) or float32, got %s",
                 opf_dtype_name(lse.dtype));
    /* an empty lse (a leading dim 0) has any strides: nothing of it is read */
    for (int64_t d = lse.ndim - 1, step = 1; d >= 0 && lse.numel > 0; step *= lse.sizes[d], d--)
        if (lse.sizes[d] > 1 && lse.strides[d] != step)
            opf_fail(CEB, "argument 'lse' must be contiguous (the tensor the forward made)");
    OPF_OWNED AtenTensorHandle dx_h = opf_empty(CEB, x->ndim, x->sizes, x->dtype, x);
    opf_tensor dx = opf_tensor_info(CEB, "dlogits", dx_h);
    plan_rows(&a, CEB, gls.strides);
    float *ws = NULL;
    const int64_t ws_floats = cross_entropy_cuda_bwd_workspace(dt, &a.p, a.has_weight);
    OPF_OWNED AtenTensorHandle ws_h = ws_floats > 0 ? opf_workspace(CEB, ws_floats, x, &ws) : NULL;
    cross_entropy_cuda_launch r =
        cross_entropy_cuda_bwd(dt, dx.data, x->data, a.target.data, a.has_weight ? a.weight.data : NULL, gls.data,
                               gs.data, lse.data, lse.dtype == aoti_torch_dtype_float32(), ws, &a.p, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 3, (opf_tensor[]){*x, a.target, dx});
    OPF_RETURN(stack, 0, dx_h);
}

OPF_REGISTER_CUDA(cross_entropy, cross_entropy_cuda);
OPF_REGISTER_CUDA(cross_entropy_backward, cross_entropy_backward_cuda);
