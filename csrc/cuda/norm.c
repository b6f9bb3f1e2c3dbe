/*
 * CUDA glue of the normalisation ops and their backward (rms_norm,
 * add_rms_norm, layer_norm): check, guard, stream, allocate through torch,
 * launch (csrc/cuda/norm.cu). The schemas, fake kernels, autograd and
 * autocast are the CPU ops' (csrc/torch/norm.c), and so are the checks, their
 * messages and the outputs' sizes, strides and dtypes: inputs of any strides
 * are read in place (their leading dims merged where they can be), outputs,
 * rstd and mean are contiguous, the gradient of an absent weight or bias is
 * an empty [0] tensor.
 */
#include <math.h>

#include "norm.h"

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char RMS[] = OPF_QUALNAME("rms_norm");
static const char RMS_BWD[] = OPF_QUALNAME("rms_norm_backward");
static const char ADD[] = OPF_QUALNAME("add_rms_norm");
static const char ADD_BWD[] = OPF_QUALNAME("add_rms_norm_backward");
static const char LN[] = OPF_QUALNAME("layer_norm");
static const char LN_BWD[] = OPF_QUALNAME("layer_norm_backward");

/* x: a float tensor of at least one dim (its device checked by OPF_CUDA_CALL); the shape of its rows. */
static void check_x(const char *op, const char *arg, const opf_tensor *x, double eps, int offset, norm_cuda_args *a) {
    a->dt = opf_check_float(op, arg, x);
    if (x->ndim < 1) opf_fail(op, "argument '%s' must have at least 1 dim (..., hidden), got a 0-dim tensor", arg);
    if (!(eps > 0.0) || !isfinite(eps)) opf_fail(op, "argument 'eps' must be a finite number > 0, got %g", eps);
    a->eps = eps;
    a->offset = offset;
    a->hidden = x->sizes[x->ndim - 1];
    a->rows = 1;
    for (int64_t d = 0; d + 1 < x->ndim; d++) a->rows *= x->sizes[d];
}

/* t has x's shape (and dtype, device) */
static void check_like_x(const char *op, const char *arg, const opf_tensor *t, const char *xarg, const opf_tensor *x) {
    opf_check_cuda(op, arg, t, xarg, x);
    opf_check_same_dtype(op, arg, t, xarg, x);
    opf_check_same_shape(op, arg, t, xarg, x);
}

/* weight / bias: 1-d of the hidden size of x, x's dtype */
static void check_vec(const char *op, const char *arg, const opf_tensor *t, const char *xarg, const opf_tensor *x) {
    opf_check_cuda(op, arg, t, xarg, x);
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
    opf_check_cuda(op, arg, t, xarg, x);
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

/* The row inputs (x's shape) of a launch: their leading dims merged together with the contiguous
 * outputs' row index (operand 0), their data and hidden strides. */
static void set_rows(const char *op, norm_cuda_args *a, const opf_tensor *x, int n, const opf_tensor *const *in) {
    const int nlead = (int)x->ndim - 1;
    int64_t rowstride[OPF_MAX_DIMS];
    const int64_t *strides[4] = {rowstride};
    int64_t step = 1;
    for (int d = nlead - 1; d >= 0; d--) rowstride[d] = step, step *= x->sizes[d];
    for (int k = 0; k < n; k++) {
        strides[1 + k] = in[k]->strides;
        a->in[k] = in[k]->data;
        a->in_cs[k] = in[k]->strides[x->ndim - 1];
    }
    opf_cuda_nd_init(op, &a->lead, nlead, x->sizes, 1 + n, strides);
}

static void set_vec(const void **data, int64_t *cs, AtenTensorHandle h, const opf_tensor *t) {
    *data = h ? t->data : NULL;
    *cs = h ? t->strides[0] : 0;
}

/* rms_norm(Tensor x, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    opf_tensor x = opf_tensor_info(RMS, "x", x_h), w = {0};
    OPF_CUDA_CALL(call, RMS, &x, "x");
    norm_cuda_args a = {0};
    check_x(RMS, "x", &x, opf_arg_double(stack[2]), opf_arg_bool(stack[3]), &a);
    if (w_h) {
        w = opf_tensor_info(RMS, "weight", w_h);
        check_vec(RMS, "weight", &w, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(RMS, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(RMS, x.ndim - 1, x.sizes, aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(RMS, "out", y_h), rstd = opf_tensor_info(RMS, "rstd", r_h);
    set_rows(RMS, &a, &x, 1, (const opf_tensor *[]){&x});
    set_vec(&a.w, &a.wcs, w_h, &w);
    a.out = y.data;
    a.rstd = rstd.data;
    norm_cuda_launch l = norm_cuda_rms_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_fwd", l.grid, l.block, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, r_h);
}

/* add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(res, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    opf_tensor x = opf_tensor_info(ADD, "x", x_h), res = opf_tensor_info(ADD, "residual", res_h), w = {0};
    OPF_CUDA_CALL(call, ADD, &x, "x");
    norm_cuda_args a = {0};
    check_x(ADD, "x", &x, opf_arg_double(stack[3]), opf_arg_bool(stack[4]), &a);
    check_like_x(ADD, "residual", &res, "x", &x);
    if (w_h) {
        w = opf_tensor_info(ADD, "weight", w_h);
        check_vec(ADD, "weight", &w, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(ADD, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle s_h = opf_empty(ADD, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(ADD, x.ndim - 1, x.sizes, aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(ADD, "out", y_h), s = opf_tensor_info(ADD, "sum", s_h),
               rstd = opf_tensor_info(ADD, "rstd", r_h);
    set_rows(ADD, &a, &x, 2, (const opf_tensor *[]){&x, &res});
    set_vec(&a.w, &a.wcs, w_h, &w);
    a.out = y.data;
    a.out2 = s.data;
    a.rstd = rstd.data;
    norm_cuda_launch l = norm_cuda_rms_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_fwd", l.grid, l.block, 3, (opf_tensor[]){x, res, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, s_h);
    OPF_RETURN(stack, 2, r_h);
}

/* The RMS backward of both ops: gs_h NULL for rms_norm. Arguments from `first`: weight, rstd, eps, offset. */
static void rms_backward(const char *op, StableIValue *stack, int first, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                         AtenTensorHandle x_h, const char *xarg, int add) {
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[first]);
    OPF_ARG_TENSOR(rstd, stack, first + 1);
    opf_tensor x = opf_tensor_info(op, xarg, x_h), g = opf_tensor_info(op, "grad", g_h), gs = {0}, w = {0};
    opf_tensor rstd = opf_tensor_info(op, "rstd", rstd_h);
    OPF_CUDA_CALL(call, op, &x, xarg);
    norm_cuda_args a = {0};
    check_x(op, xarg, &x, opf_arg_double(stack[first + 2]), opf_arg_bool(stack[first + 3]), &a);
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
    if (gs_h)
        set_rows(op, &a, &x, 3, (const opf_tensor *[]){&g, &x, &gs});
    else
        set_rows(op, &a, &x, 2, (const opf_tensor *[]){&g, &x});
    set_vec(&a.w, &a.wcs, w_h, &w);
    a.rstd = rstd.data;
    a.out = dx.data;
    a.out2 = add ? dr.data : NULL;
    a.dw = w_h ? dw.data : NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(op, norm_cuda_bwd_workspace(&a), &x, &a.ws);
    norm_cuda_launch l = norm_cuda_rms_bwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_bwd", l.grid, l.block, 3, (opf_tensor[]){g, x, dx});
    int i = 0;
    OPF_RETURN(stack, i++, dx_h);
    if (add) OPF_RETURN(stack, i++, dr_h);
    OPF_RETURN(stack, i, dw_h);
}

/* rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    rms_backward(RMS_BWD, stack, 2, g_h, NULL, x_h, "x", 0);
}

/* add_rms_norm_backward(Tensor grad, Tensor grad_sum, Tensor sum, Tensor? weight, Tensor rstd, float eps,
 *                       bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(gs, stack, 1);
    OPF_ARG_TENSOR(s, stack, 2);
    rms_backward(ADD_BWD, stack, 3, g_h, gs_h, s_h, "sum", 1);
}

/* layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor) */
static void layer_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[2]);
    opf_tensor x = opf_tensor_info(LN, "x", x_h), w = {0}, b = {0};
    OPF_CUDA_CALL(call, LN, &x, "x");
    norm_cuda_args a = {0};
    check_x(LN, "x", &x, opf_arg_double(stack[3]), 0, &a);
    if (w_h) {
        w = opf_tensor_info(LN, "weight", w_h);
        check_vec(LN, "weight", &w, "x", &x);
    }
    if (b_h) {
        b = opf_tensor_info(LN, "bias", b_h);
        check_vec(LN, "bias", &b, "x", &x);
    }
    OPF_OWNED AtenTensorHandle y_h = opf_empty(LN, x.ndim, x.sizes, x.dtype, &x);
    OPF_OWNED AtenTensorHandle m_h = opf_empty(LN, x.ndim - 1, x.sizes, aoti_torch_dtype_float32(), &x);
    OPF_OWNED AtenTensorHandle r_h = opf_empty(LN, x.ndim - 1, x.sizes, aoti_torch_dtype_float32(), &x);
    opf_tensor y = opf_tensor_info(LN, "out", y_h), mean = opf_tensor_info(LN, "mean", m_h),
               rstd = opf_tensor_info(LN, "rstd", r_h);
    set_rows(LN, &a, &x, 1, (const opf_tensor *[]){&x});
    set_vec(&a.w, &a.wcs, w_h, &w);
    set_vec(&a.b, &a.bcs, b_h, &b);
    a.out = y.data;
    a.mean = mean.data;
    a.rstd = rstd.data;
    norm_cuda_launch l = norm_cuda_ln_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "layer_norm_fwd", l.grid, l.block, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
    OPF_RETURN(stack, 1, m_h);
    OPF_RETURN(stack, 2, r_h);
}

/* layer_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, float eps)
 *     -> (Tensor, Tensor, Tensor) */
static void layer_norm_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[3]);
    OPF_ARG_TENSOR(mean, stack, 4);
    OPF_ARG_TENSOR(rstd, stack, 5);
    opf_tensor x = opf_tensor_info(LN_BWD, "x", x_h), g = opf_tensor_info(LN_BWD, "grad", g_h), w = {0}, b = {0};
    opf_tensor mean = opf_tensor_info(LN_BWD, "mean", mean_h), rstd = opf_tensor_info(LN_BWD, "rstd", rstd_h);
    OPF_CUDA_CALL(call, LN_BWD, &x, "x");
    norm_cuda_args a = {0};
    check_x(LN_BWD, "x", &x, opf_arg_double(stack[6]), 0, &a);
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
    set_rows(LN_BWD, &a, &x, 2, (const opf_tensor *[]){&g, &x});
    set_vec(&a.w, &a.wcs, w_h, &w);
    a.mean = mean.data;
    a.rstd = rstd.data;
    a.out = dx.data;
    a.dw = w_h ? dw.data : NULL;
    a.db = b_h ? db.data : NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LN_BWD, norm_cuda_bwd_workspace(&a), &x, &a.ws);
    norm_cuda_launch l = norm_cuda_ln_bwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "layer_norm_bwd", l.grid, l.block, 3, (opf_tensor[]){g, x, dx});
    OPF_RETURN(stack, 0, dx_h);
    OPF_RETURN(stack, 1, dw_h);
    OPF_RETURN(stack, 2, db_h);
}

OPF_REGISTER_CUDA(rms_norm, rms_norm_cuda);
OPF_REGISTER_CUDA(rms_norm_backward, rms_norm_backward_cuda);
OPF_REGISTER_CUDA(add_rms_norm, add_rms_norm_cuda);
OPF_REGISTER_CUDA(add_rms_norm_backward, add_rms_norm_backward_cuda);
OPF_REGISTER_CUDA(layer_norm, layer_norm_cuda);
OPF_REGISTER_CUDA(layer_norm_backward, layer_norm_backward_cuda);
