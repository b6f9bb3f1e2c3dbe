/*
 * torch glue of the normalisation ops (formulas and numerics in csrc/kernels/norm.h):
 *   rms_norm(x (..., H), weight? (H), eps, offset)            -> (y, rstd (...) float32)
 *   add_rms_norm(x, residual, weight?, eps, offset)           -> (y, s = x + residual, rstd)
 *   layer_norm(x, weight?, bias?, eps)                        -> (y, mean (...) float32, rstd)
 * and their backward ops. rstd and mean are saved for the backward only. Inputs
 * of any strides are read in place (no copy); outputs are contiguous.
 * The checks and the outputs' allocation (norm_prepare_*, norm.h) serve the
 * CUDA glue too (csrc/cuda/norm.c), with its own device check.
 */
#include <math.h>

#include "norm.h"

#include "../kernels/norm.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char RMS[] = OPF_QUALNAME("rms_norm");
static const char RMS_BWD[] = OPF_QUALNAME("rms_norm_backward");
static const char ADD[] = OPF_QUALNAME("add_rms_norm");
static const char ADD_BWD[] = OPF_QUALNAME("add_rms_norm_backward");
static const char LN[] = OPF_QUALNAME("layer_norm");
static const char LN_BWD[] = OPF_QUALNAME("layer_norm_backward");

/* x: a float tensor of at least one dim on the kernel's device; the shape of its rows. */
static norm_shape check_x(const char *op, norm_check_device_fn check, const char *arg, const opf_tensor *x, double eps,
                          int offset) {
    check(op, arg, x, arg, x);
    norm_shape sh = {.dt = opf_check_float(op, arg, x), .eps = eps, .offset = offset};
    if (x->ndim < 1) opf_fail(op, "argument '%s' must have at least 1 dim (..., hidden), got a 0-dim tensor", arg);
    if (!(eps > 0.0) || !isfinite(eps)) opf_fail(op, "argument 'eps' must be a finite number > 0, got %g", eps);
    sh.nlead = (int)x->ndim - 1;
    sh.hidden = x->sizes[x->ndim - 1];
    sh.rows = 1;
    for (int d = 0; d < sh.nlead; d++) sh.lead[d] = x->sizes[d], sh.rows *= x->sizes[d];
    return sh;
}

/* t has x's shape (and dtype, device) */
static void check_like_x(const char *op, norm_check_device_fn check, const char *arg, const opf_tensor *t,
                         const char *xarg, const opf_tensor *x) {
    check(op, arg, t, xarg, x);
    opf_check_same_dtype(op, arg, t, xarg, x);
    opf_check_same_shape(op, arg, t, xarg, x);
}

/* weight / bias: 1-d of the hidden size of x, x's dtype */
static void check_vec(const char *op, norm_check_device_fn check, const char *arg, const opf_tensor *t,
                      const char *xarg, const opf_tensor *x) {
    check(op, arg, t, xarg, x);
    opf_check_same_dtype(op, arg, t, xarg, x);
    opf_check_dims(op, arg, t, 1, "(hidden,)");
    opf_check_size(op, arg, t, 0, xarg, x, -1);
}

/* The weight and bias given (NULL: not given): their infos, checked against x. */
static void check_vecs(const char *op, norm_check_device_fn check, AtenTensorHandle w_h, AtenTensorHandle b_h,
                       const char *xarg, norm_call *c) {
    if (w_h) {
        c->w = opf_tensor_info(op, "weight", w_h);
        check_vec(op, check, "weight", &c->w, xarg, &c->x);
    }
    if (b_h) {
        c->b = opf_tensor_info(op, "bias", b_h);
        check_vec(op, check, "bias", &c->b, xarg, &c->x);
    }
}

/* rstd / mean as the forward returns them: float32, contiguous, x's leading shape */
static void check_saved(const char *op, norm_check_device_fn check, const char *arg, const opf_tensor *t,
                        const char *xarg, const opf_tensor *x, const char *fwd) {
    check(op, arg, t, xarg, x);
    int ok = t->dtype == aoti_torch_dtype_float32() && t->ndim == x->ndim - 1;
    int64_t want = 1;
    /* strides matter only where there is an element to read (torch gives an empty tensor's dims strides of
     * its own) */
    for (int64_t d = t->ndim - 1; ok && d >= 0; d--) {
        ok = t->sizes[d] == x->sizes[d] && (t->sizes[d] == 1 || t->numel == 0 || t->strides[d] == want);
        want *= t->sizes[d];
    }
    if (!ok) {
        char got[128];
        opf_shape_str(got, sizeof got, t);
        opf_fail(op,
                 "argument '%s' must be the contiguous float32 %s returned by %s (the leading dims of '%s'), "
                 "got %s %s",
                 arg, arg, fwd, xarg, opf_dtype_name(t->dtype), got);
    }
}

/* The next output of c: a new contiguous tensor on x's device, owned by c from here on. */
static void new_out(const char *op, norm_call *c, int64_t ndim, const int64_t *sizes, int32_t dtype) {
    AtenTensorHandle h = opf_empty(op, ndim, sizes, dtype, &c->x);
    c->out_h[c->nout++] = h;
}

/* The outputs' infos, once all are allocated; names[i] names output i in a failure's message. */
static void read_outs(const char *op, norm_call *c, const char *const *names) {
    for (int i = 0; i < c->nout; i++) c->out[i] = opf_tensor_info(op, names[i], c->out_h[i]);
}

void norm_prepare_rms(const char *op, norm_check_device_fn check, AtenTensorHandle x_h, AtenTensorHandle res_h,
                      AtenTensorHandle w_h, double eps, int offset, norm_call *c) {
    c->x = opf_tensor_info(op, "x", x_h);
    if (res_h) c->res = opf_tensor_info(op, "residual", res_h);
    c->sh = check_x(op, check, "x", &c->x, eps, offset);
    if (res_h) check_like_x(op, check, "residual", &c->res, "x", &c->x);
    check_vecs(op, check, w_h, NULL, "x", c);
    new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    if (res_h) new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    new_out(op, c, c->x.ndim - 1, c->x.sizes, aoti_torch_dtype_float32());
    read_outs(op, c, res_h ? (const char *[]){"out", "sum", "rstd"} : (const char *[]){"out", "rstd"});
}

void norm_prepare_rms_bwd(const char *op, norm_check_device_fn check, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                          AtenTensorHandle x_h, AtenTensorHandle w_h, AtenTensorHandle rstd_h, double eps, int offset,
                          norm_call *c) {
    const int add = gs_h != NULL;
    const char *xarg = add ? "sum" : "x";
    c->x = opf_tensor_info(op, xarg, x_h);
    c->grad = opf_tensor_info(op, "grad", g_h);
    c->rstd = opf_tensor_info(op, "rstd", rstd_h);
    c->sh = check_x(op, check, xarg, &c->x, eps, offset);
    check_like_x(op, check, "grad", &c->grad, xarg, &c->x);
    if (gs_h) {
        c->grad_sum = opf_tensor_info(op, "grad_sum", gs_h);
        check_like_x(op, check, "grad_sum", &c->grad_sum, xarg, &c->x);
    }
    check_vecs(op, check, w_h, NULL, xarg, c);
    check_saved(op, check, "rstd", &c->rstd, xarg, &c->x, add ? ADD : RMS);
    const int64_t zero = 0;
    new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    if (add) new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    new_out(op, c, 1, w_h ? c->w.sizes : &zero, c->x.dtype);
    read_outs(op, c, add ? (const char *[]){"dx", "dresidual", "dweight"} : (const char *[]){"dx", "dweight"});
}

void norm_prepare_ln(const char *op, norm_check_device_fn check, AtenTensorHandle x_h, AtenTensorHandle w_h,
                     AtenTensorHandle b_h, double eps, norm_call *c) {
    c->x = opf_tensor_info(op, "x", x_h);
    c->sh = check_x(op, check, "x", &c->x, eps, 0);
    check_vecs(op, check, w_h, b_h, "x", c);
    new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    new_out(op, c, c->x.ndim - 1, c->x.sizes, aoti_torch_dtype_float32());
    new_out(op, c, c->x.ndim - 1, c->x.sizes, aoti_torch_dtype_float32());
    read_outs(op, c, (const char *[]){"out", "mean", "rstd"});
}

void norm_prepare_ln_bwd(const char *op, norm_check_device_fn check, AtenTensorHandle g_h, AtenTensorHandle x_h,
                         AtenTensorHandle w_h, AtenTensorHandle b_h, AtenTensorHandle mean_h, AtenTensorHandle rstd_h,
                         double eps, norm_call *c) {
    c->x = opf_tensor_info(op, "x", x_h);
    c->grad = opf_tensor_info(op, "grad", g_h);
    c->mean = opf_tensor_info(op, "mean", mean_h);
    c->rstd = opf_tensor_info(op, "rstd", rstd_h);
    c->sh = check_x(op, check, "x", &c->x, eps, 0);
    check_like_x(op, check, "grad", &c->grad, "x", &c->x);
    check_vecs(op, check, w_h, b_h, "x", c);
    check_saved(op, check, "mean", &c->mean, "x", &c->x, LN);
    check_saved(op, check, "rstd", &c->rstd, "x", &c->x, LN);
    const int64_t zero = 0;
    new_out(op, c, c->x.ndim, c->x.sizes, c->x.dtype);
    new_out(op, c, 1, w_h ? c->w.sizes : &zero, c->x.dtype);
    new_out(op, c, 1, b_h ? c->b.sizes : &zero, c->x.dtype);
    read_outs(op, c, (const char *[]){"dx", "dweight", "dbias"});
}

static norm_mat mat(const opf_tensor *t) {
    norm_mat m = {.data = t ? t->data : NULL};
    if (!t || !t->data) return m;
    m.cs = t->strides[t->ndim - 1];
    for (int64_t d = 0; d + 1 < t->ndim; d++) m.rs[d] = t->strides[d];
    return m;
}

/* rms_norm(Tensor x, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms(RMS, opf_check_device, x_h, NULL, w_h, opf_arg_double(stack[2]), opf_arg_bool(stack[3]), &c);
    const opf_tensor *y = &c.out[0], *rstd = &c.out[1];
    if (!opf_is_meta(&c.x)) {
        norm_mat xm = mat(&c.x), wm = mat(w_h ? &c.w : NULL);
        norm_rms_fwd(norm_kernels_for(opf_isa_current()), &c.sh, y->data, NULL, rstd->data, &xm, NULL, &wm);
    }
    opf_log_call(RMS, t0, 2, (opf_tensor[]){c.x, *y});
    norm_call_return(stack, &c);
}

/* add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(res, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms(ADD, opf_check_device, x_h, res_h, w_h, opf_arg_double(stack[3]), opf_arg_bool(stack[4]), &c);
    const opf_tensor *y = &c.out[0], *s = &c.out[1], *rstd = &c.out[2];
    if (!opf_is_meta(&c.x)) {
        norm_mat xm = mat(&c.x), rm = mat(&c.res), wm = mat(w_h ? &c.w : NULL);
        norm_rms_fwd(norm_kernels_for(opf_isa_current()), &c.sh, y->data, s->data, rstd->data, &xm, &rm, &wm);
    }
    opf_log_call(ADD, t0, 3, (opf_tensor[]){c.x, c.res, *y});
    norm_call_return(stack, &c);
}

/* The RMS backward of both ops: gs_h NULL for rms_norm. Arguments from `first`: weight, rstd, eps, offset. */
static void rms_backward(const char *op, StableIValue *stack, int first, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                         AtenTensorHandle x_h) {
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[first]);
    OPF_ARG_TENSOR(rstd, stack, first + 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms_bwd(op, opf_check_device, g_h, gs_h, x_h, w_h, rstd_h, opf_arg_double(stack[first + 2]),
                         opf_arg_bool(stack[first + 3]), &c);
    const int add = gs_h != NULL;
    const opf_tensor *dx = &c.out[0], *dr = add ? &c.out[1] : NULL, *dw = &c.out[c.nout - 1];
    if (!opf_is_meta(&c.x)) {
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(op, norm_bwd_workspace(&c.sh, w_h != NULL, 0), &c.x, &ws);
        norm_mat gm = mat(&c.grad), gsm = mat(gs_h ? &c.grad_sum : NULL), xm = mat(&c.x), wm = mat(w_h ? &c.w : NULL);
        norm_rms_bwd(norm_kernels_for(opf_isa_current()), &c.sh, dx->data, add ? dr->data : NULL, w_h ? dw->data : NULL,
                     &gm, &gsm, &xm, c.rstd.data, &wm, ws);
    }
    opf_log_call(op, t0, 3, (opf_tensor[]){c.grad, c.x, *dx});
    norm_call_return(stack, &c);
}

/* rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    rms_backward(RMS_BWD, stack, 2, g_h, NULL, x_h);
}

/* add_rms_norm_backward(Tensor grad, Tensor grad_sum, Tensor sum, Tensor? weight, Tensor rstd, float eps,
 *                       bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(gs, stack, 1);
    OPF_ARG_TENSOR(s, stack, 2);
    rms_backward(ADD_BWD, stack, 3, g_h, gs_h, s_h);
}

/* layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor) */
static void layer_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_ln(LN, opf_check_device, x_h, w_h, b_h, opf_arg_double(stack[3]), &c);
    const opf_tensor *y = &c.out[0], *mean = &c.out[1], *rstd = &c.out[2];
    if (!opf_is_meta(&c.x)) {
        norm_mat xm = mat(&c.x), wm = mat(w_h ? &c.w : NULL), bm = mat(b_h ? &c.b : NULL);
        norm_ln_fwd(norm_kernels_for(opf_isa_current()), &c.sh, y->data, mean->data, rstd->data, &xm, &wm, &bm);
    }
    opf_log_call(LN, t0, 2, (opf_tensor[]){c.x, *y});
    norm_call_return(stack, &c);
}

/* layer_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, float eps)
 *     -> (Tensor, Tensor, Tensor) */
static void layer_norm_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[3]);
    OPF_ARG_TENSOR(mean, stack, 4);
    OPF_ARG_TENSOR(rstd, stack, 5);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_ln_bwd(LN_BWD, opf_check_device, g_h, x_h, w_h, b_h, mean_h, rstd_h, opf_arg_double(stack[6]), &c);
    const opf_tensor *dx = &c.out[0], *dw = &c.out[1], *db = &c.out[2];
    if (!opf_is_meta(&c.x)) {
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h =
            opf_workspace(LN_BWD, norm_bwd_workspace(&c.sh, w_h != NULL, b_h != NULL), &c.x, &ws);
        norm_mat gm = mat(&c.grad), xm = mat(&c.x), wm = mat(w_h ? &c.w : NULL);
        norm_ln_bwd(norm_kernels_for(opf_isa_current()), &c.sh, dx->data, w_h ? dw->data : NULL, b_h ? db->data : NULL,
                    &gm, &xm, c.mean.data, c.rstd.data, &wm, ws);
    }
    opf_log_call(LN_BWD, t0, 3, (opf_tensor[]){c.grad, c.x, *dx});
    norm_call_return(stack, &c);
}

static const opf_op_desc opf_norm_ops[] = {
    {
        .schema = "rms_norm(Tensor x, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor)",
        .cpu = rms_norm_cpu,
        .shape = "[x[:]]; [x[:-1]] dtype=float32",
        .backward = "rms_norm_backward",
        .backward_args = "grad0,x,weight,out1,eps,offset",
        .backward_grads = "x,weight",
        .autocast = OPF_AUTOCAST_FOLLOW, /* F.rms_norm / F.layer_norm run in x's dtype beside float32 weights */
        .flops = "4*numel(x)",
        .meta = 1,
    },
    {
        .schema = "rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, float eps, bool offset) "
                  "-> (Tensor, Tensor)",
        .cpu = rms_norm_backward_cpu,
        .shape = "[x[:]]; [weight[:]] dtype=x if weight",
        .flops = "8*numel(x)",
        .meta = 1,
    },
    {
        .schema = "add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, bool offset) "
                  "-> (Tensor, Tensor, Tensor)",
        .cpu = add_rms_norm_cpu,
        .shape = "[x[:]]; [x[:]]; [x[:-1]] dtype=float32",
        .backward = "add_rms_norm_backward",
        .backward_args = "grad0,grad1,out1,weight,out2,eps,offset",
        .backward_grads = "x,residual,weight",
        .autocast = OPF_AUTOCAST_FOLLOW, /* F.rms_norm / F.layer_norm run in x's dtype beside float32 weights */
        .flops = "5*numel(x)",
        .meta = 1,
    },
    {
        .schema = "add_rms_norm_backward(Tensor grad, Tensor grad_sum, Tensor sum, Tensor? weight, Tensor rstd, "
                  "float eps, bool offset) -> (Tensor, Tensor, Tensor)",
        .cpu = add_rms_norm_backward_cpu,
        .shape = "[sum[:]]; [sum[:]]; [weight[:]] dtype=sum if weight",
        .flops = "9*numel(sum)",
        .meta = 1,
    },
    {
        .schema = "layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
        .cpu = layer_norm_cpu,
        .shape = "[x[:]]; [x[:-1]] dtype=float32; [x[:-1]] dtype=float32",
        .backward = "layer_norm_backward",
        .backward_args = "grad0,x,weight,bias,out1,out2,eps",
        .backward_grads = "x,weight,bias",
        .autocast = OPF_AUTOCAST_FOLLOW,    /* F.rms_norm / F.layer_norm run in x's dtype beside float32 weights */
        .autocast_cuda = OPF_AUTOCAST_FP32, /* torch's CUDA autocast runs layer_norm in float32 */
        .flops = "6*numel(x)",
        .meta = 1,
    },
    {
        .schema = "layer_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
                  "Tensor rstd, float eps) -> (Tensor, Tensor, Tensor)",
        .cpu = layer_norm_backward_cpu,
        .shape = "[x[:]]; [weight[:]] dtype=x if weight; [bias[:]] dtype=x if bias",
        .flops = "10*numel(x)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_norm_ops);
OPF_REGISTER_FAMILY(norm_variants);

OPF_AOTI_SHIM(rms_norm, 2, (AtenTensorHandle x, AtenTensorHandle *weight, double eps, int32_t offset), x, weight, eps,
              offset);
OPF_AOTI_SHIM(rms_norm_backward, 2,
              (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle *weight, AtenTensorHandle rstd, double eps,
               int32_t offset),
              grad, x, weight, rstd, eps, offset);
OPF_AOTI_SHIM(add_rms_norm, 3,
              (AtenTensorHandle x, AtenTensorHandle residual, AtenTensorHandle *weight, double eps, int32_t offset), x,
              residual, weight, eps, offset);
OPF_AOTI_SHIM(add_rms_norm_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle grad_sum, AtenTensorHandle sum, AtenTensorHandle *weight,
               AtenTensorHandle rstd, double eps, int32_t offset),
              grad, grad_sum, sum, weight, rstd, eps, offset);
OPF_AOTI_SHIM(layer_norm, 3, (AtenTensorHandle x, AtenTensorHandle *weight, AtenTensorHandle *bias, double eps), x,
              weight, bias, eps);
OPF_AOTI_SHIM(layer_norm_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle *weight, AtenTensorHandle *bias,
               AtenTensorHandle mean, AtenTensorHandle rstd, double eps),
              grad, x, weight, bias, mean, rstd, eps);
