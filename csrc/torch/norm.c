/*
 * torch glue of the normalisation ops (formulas and numerics in csrc/kernels/norm.h):
 *   rms_norm(x (..., H), weight? (H), eps, offset)            -> (y, rstd (...) float32)
 *   add_rms_norm(x, residual, weight?, eps, offset)           -> (y, s = x + residual, rstd)
 *   layer_norm(x, weight?, bias?, eps)                        -> (y, mean (...) float32, rstd)
 * and their backward ops. rstd and mean are saved for the backward only. Inputs
 * of any strides are read in place (no copy); outputs are contiguous.
 */
#include <math.h>

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

/* x: a float tensor of at least one dim on cpu / meta; the shape of its rows. */
static norm_shape check_x(const char *op, const char *arg, const opf_tensor *x, double eps, int offset) {
    opf_check_device(op, arg, x, arg, x);
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
static void check_like_x(const char *op, const char *arg, const opf_tensor *t, const char *xarg, const opf_tensor *x) {
    opf_check_device(op, arg, t, xarg, x);
    opf_check_same_dtype(op, arg, t, xarg, x);
    opf_check_same_shape(op, arg, t, xarg, x);
}

/* weight / bias: 1-d of the hidden size of x, x's dtype */
static void check_vec(const char *op, const char *arg, const opf_tensor *t, const char *xarg, const opf_tensor *x) {
    opf_check_device(op, arg, t, xarg, x);
    opf_check_same_dtype(op, arg, t, xarg, x);
    if (t->ndim != 1 || t->sizes[0] != x->sizes[x->ndim - 1]) {
        char got[128];
        opf_shape_str(got, sizeof got, t);
        opf_fail(op, "argument '%s' must have shape [%lld] (the last dim of '%s'), got %s", arg,
                 (long long)x->sizes[x->ndim - 1], xarg, got);
    }
}

/* rstd / mean as the forward returns them: float32, contiguous, x's leading shape */
static void check_saved(const char *op, const char *arg, const opf_tensor *t, const char *xarg, const opf_tensor *x,
                        const char *fwd) {
    opf_check_device(op, arg, t, xarg, x);
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

static norm_mat mat(const opf_tensor *t) {
    norm_mat m = {.data = t ? t->data : NULL};
    if (!t || !t->data) return m;
    m.cs = t->strides[t->ndim - 1];
    for (int64_t d = 0; d + 1 < t->ndim; d++) m.rs[d] = t->strides[d];
    return m;
}

static const int64_t *lead_sizes(const opf_tensor *x) { return x->sizes; }

/* rms_norm(Tensor x, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor x = opf_tensor_info(RMS, "x", x_h), w = {0};
    norm_shape sh = check_x(RMS, "x", &x, opf_arg_double(stack[2]), opf_arg_bool(stack[3]));
    if (w_h) {
        w = opf_tensor_info(RMS, "weight", w_h);
        check_vec(RMS, "weight", &w, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(RMS, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(RMS, x.ndim - 1, lead_sizes(&x), aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(RMS, "out", y_h), rstd = opf_tensor_info(RMS, "rstd", r_h);
    if (!opf_is_meta(&x)) {
        norm_mat xm = mat(&x), wm = mat(w_h ? &w : NULL);
        norm_rms_fwd(norm_kernels_for(opf_isa_current()), &sh, y.data, NULL, rstd.data, &xm, NULL, &wm);
    }
    opf_log_call(RMS, t0, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, r_h);
}

/* add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(res, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor x = opf_tensor_info(ADD, "x", x_h), res = opf_tensor_info(ADD, "residual", res_h), w = {0};
    norm_shape sh = check_x(ADD, "x", &x, opf_arg_double(stack[3]), opf_arg_bool(stack[4]));
    check_like_x(ADD, "residual", &res, "x", &x);
    if (w_h) {
        w = opf_tensor_info(ADD, "weight", w_h);
        check_vec(ADD, "weight", &w, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(ADD, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle s_h = opf_empty(ADD, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(ADD, x.ndim - 1, lead_sizes(&x), aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(ADD, "out", y_h), s = opf_tensor_info(ADD, "sum", s_h),
               rstd = opf_tensor_info(ADD, "rstd", r_h);
    if (!opf_is_meta(&x)) {
        norm_mat xm = mat(&x), rm = mat(&res), wm = mat(w_h ? &w : NULL);
        norm_rms_fwd(norm_kernels_for(opf_isa_current()), &sh, y.data, s.data, rstd.data, &xm, &rm, &wm);
    }
    opf_log_call(ADD, t0, 3, (opf_tensor[]){x, res, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, s_h);
    OPF_RETURN(stack, 2, r_h);
}

/* The RMS backward of both ops: gs_h / dres NULL for rms_norm. Arguments from `first`: weight, rstd, eps,
 * offset. */
static void rms_backward(const char *op, StableIValue *stack, int first, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                         AtenTensorHandle x_h, const char *xarg, int add) {
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[first]);
    OPF_ARG_TENSOR(rstd, stack, first + 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor x = opf_tensor_info(op, xarg, x_h), g = opf_tensor_info(op, "grad", g_h), gs = {0}, w = {0};
    opf_tensor rstd = opf_tensor_info(op, "rstd", rstd_h);
    norm_shape sh = check_x(op, xarg, &x, opf_arg_double(stack[first + 2]), opf_arg_bool(stack[first + 3]));
    check_like_x(op, "grad", &g, xarg, &x);
    if (gs_h) {
        gs = opf_tensor_info(op, "grad_sum", gs_h);
        check_like_x(op, "grad_sum", &gs, xarg, &x);
    }
    if (w_h) {
        w = opf_tensor_info(op, "weight", w_h);
        check_vec(op, "weight", &w, xarg, &x);
    }
    check_saved(op, "rstd", &rstd, xarg, &x, add ? ADD : RMS);
    OPF_OWNED AtenTensorHandle dx_h = opf_empty(op, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle dr_h = add ? opf_empty(op, x.ndim, x.sizes, x.dtype, &x) : NULL;
    const int64_t zero = 0;
    OPF_OWNED AtenTensorHandle dw_h =
        w_h ? opf_empty(op, 1, w.sizes, x.dtype, &x) : opf_empty(op, 1, &zero, x.dtype, &x);
    opf_tensor dx = opf_tensor_info(op, "dx", dx_h), dw = opf_tensor_info(op, "dweight", dw_h), dr = {0};
    if (add) dr = opf_tensor_info(op, "dresidual", dr_h);
    if (!opf_is_meta(&x)) {
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(op, norm_bwd_workspace(&sh, w_h != NULL, 0), &x, &ws);
        norm_mat gm = mat(&g), gsm = mat(gs_h ? &gs : NULL), xm = mat(&x), wm = mat(w_h ? &w : NULL);
        norm_rms_bwd(norm_kernels_for(opf_isa_current()), &sh, dx.data, add ? dr.data : NULL, w_h ? dw.data : NULL, &gm,
                     &gsm, &xm, rstd.data, &wm, ws);
    }
    opf_log_call(op, t0, 3, (opf_tensor[]){g, x, dx});
    int i = 0;
    OPF_RETURN(stack, i++, dx_h);
    if (add) OPF_RETURN(stack, i++, dr_h);
    OPF_RETURN(stack, i, dw_h);
}

/* rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    rms_backward(RMS_BWD, stack, 2, g_h, NULL, x_h, "x", 0);
}

/* add_rms_norm_backward(Tensor grad, Tensor grad_sum, Tensor sum, Tensor? weight, Tensor rstd, float eps,
 *                       bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(gs, stack, 1);
    OPF_ARG_TENSOR(s, stack, 2);
    rms_backward(ADD_BWD, stack, 3, g_h, gs_h, s_h, "sum", 1);
}

/* layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor) */
static void layer_norm_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor x = opf_tensor_info(LN, "x", x_h), w = {0}, b = {0};
    norm_shape sh = check_x(LN, "x", &x, opf_arg_double(stack[3]), 0);
    if (w_h) {
        w = opf_tensor_info(LN, "weight", w_h);
        check_vec(LN, "weight", &w, "x", &x);
    }
    if (b_h) {
        b = opf_tensor_info(LN, "bias", b_h);
        check_vec(LN, "bias", &b, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(LN, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle m_h = opf_empty(LN, x.ndim - 1, lead_sizes(&x), aoti_torch_dtype_float32(), &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(LN, x.ndim - 1, lead_sizes(&x), aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(LN, "out", y_h), mean = opf_tensor_info(LN, "mean", m_h),
               rstd = opf_tensor_info(LN, "rstd", r_h);
    if (!opf_is_meta(&x)) {
        norm_mat xm = mat(&x), wm = mat(w_h ? &w : NULL), bm = mat(b_h ? &b : NULL);
        norm_ln_fwd(norm_kernels_for(opf_isa_current()), &sh, y.data, mean.data, rstd.data, &xm, &wm, &bm);
    }
    opf_log_call(LN, t0, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, m_h);
    OPF_RETURN(stack, 2, r_h);
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
    opf_tensor x = opf_tensor_info(LN_BWD, "x", x_h), g = opf_tensor_info(LN_BWD, "grad", g_h), w = {0}, b = {0};
    opf_tensor mean = opf_tensor_info(LN_BWD, "mean", mean_h), rstd = opf_tensor_info(LN_BWD, "rstd", rstd_h);
    norm_shape sh = check_x(LN_BWD, "x", &x, opf_arg_double(stack[6]), 0);
    check_like_x(LN_BWD, "grad", &g, "x", &x);
    if (w_h) {
        w = opf_tensor_info(LN_BWD, "weight", w_h);
        check_vec(LN_BWD, "weight", &w, "x", &x);
    }
    if (b_h) {
        b = opf_tensor_info(LN_BWD, "bias", b_h);
        check_vec(LN_BWD, "bias", &b, "x", &x);
    }
    check_saved(LN_BWD, "mean", &mean, "x", &x, LN);
    check_saved(LN_BWD, "rstd", &rstd, "x", &x, LN);
    const int64_t zero = 0;
    OPF_OWNED AtenTensorHandle dx_h = opf_empty(LN_BWD, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle dw_h = opf_empty(LN_BWD, 1, w_h ? w.sizes : &zero, x.dtype, &x);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(LN_BWD, 1, b_h ? b.sizes : &zero, x.dtype, &x);
    opf_tensor dx = opf_tensor_info(LN_BWD, "dx", dx_h), dw = opf_tensor_info(LN_BWD, "dweight", dw_h),
               db = opf_tensor_info(LN_BWD, "dbias", db_h);
    if (!opf_is_meta(&x)) {
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h =
            opf_workspace(LN_BWD, norm_bwd_workspace(&sh, w_h != NULL, b_h != NULL), &x, &ws);
        norm_mat gm = mat(&g), xm = mat(&x), wm = mat(w_h ? &w : NULL);
        norm_ln_bwd(norm_kernels_for(opf_isa_current()), &sh, dx.data, w_h ? dw.data : NULL, b_h ? db.data : NULL, &gm,
                    &xm, mean.data, rstd.data, &wm, ws);
    }
    opf_log_call(LN_BWD, t0, 3, (opf_tensor[]){g, x, dx});
    OPF_RETURN(stack, 0, dx_h);
    OPF_RETURN(stack, 1, dw_h);
    OPF_RETURN(stack, 2, db_h);
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
