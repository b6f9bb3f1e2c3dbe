/*
 * CUDA glue of the normalisation ops and their backward (rms_norm,
 * add_rms_norm, layer_norm): guard and stream, then the CPU glue's checks
 * and allocation (norm_prepare_*, csrc/torch/norm.h) with opf_check_cuda as
 * the device check, then the launch (csrc/cuda/norm.cu). The schemas, fake
 * kernels, autograd and autocast are the CPU ops' (csrc/torch/norm.c), and so
 * are the checks, their messages and the outputs' sizes, strides and dtypes:
 * inputs of any strides are read in place (their leading dims merged where
 * they can be), outputs, rstd and mean are contiguous, the gradient of an
 * absent weight or bias is an empty [0] tensor.
 */
#include "norm.h"

#include "../torch/namespace.h"
#include "../torch/norm.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char RMS[] = OPF_QUALNAME("rms_norm");
static const char RMS_BWD[] = OPF_QUALNAME("rms_norm_backward");
static const char ADD[] = OPF_QUALNAME("add_rms_norm");
static const char ADD_BWD[] = OPF_QUALNAME("add_rms_norm_backward");
static const char LN[] = OPF_QUALNAME("layer_norm");
static const char LN_BWD[] = OPF_QUALNAME("layer_norm_backward");

/* The call's shape (checked by norm_prepare_*) for a launch. */
static norm_cuda_args args_of(const norm_call *c) {
    return (norm_cuda_args){
        .dt = c->sh.dt, .rows = c->sh.rows, .hidden = c->sh.hidden, .eps = c->sh.eps, .offset = c->sh.offset};
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

/* A weight / bias (NULL where not given) and its stride. */
static void set_vec(const void **data, int64_t *cs, const opf_tensor *t) {
    *data = t->h ? t->data : NULL;
    *cs = t->h ? t->strides[0] : 0;
}

/* rms_norm(Tensor x, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    opf_tensor x = opf_tensor_info(RMS, "x", x_h);
    OPF_CUDA_CALL(call, RMS, &x, "x");
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms(RMS, opf_check_cuda, x_h, NULL, w_h, opf_arg_double(stack[2]), opf_arg_bool(stack[3]), &c);
    norm_cuda_args a = args_of(&c);
    set_rows(RMS, &a, &c.x, 1, (const opf_tensor *[]){&c.x});
    set_vec(&a.w, &a.wcs, &c.w);
    a.out = c.out[0].data;  /* y */
    a.rstd = c.out[1].data; /* rstd */
    norm_cuda_launch l = norm_cuda_rms_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_fwd", l.grid, l.block, 2, (opf_tensor[]){c.x, c.out[0]});
    norm_call_return(stack, &c);
}

/* add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(res, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    opf_tensor x = opf_tensor_info(ADD, "x", x_h);
    OPF_CUDA_CALL(call, ADD, &x, "x");
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms(ADD, opf_check_cuda, x_h, res_h, w_h, opf_arg_double(stack[3]), opf_arg_bool(stack[4]), &c);
    norm_cuda_args a = args_of(&c);
    set_rows(ADD, &a, &c.x, 2, (const opf_tensor *[]){&c.x, &c.res});
    set_vec(&a.w, &a.wcs, &c.w);
    a.out = c.out[0].data;  /* y */
    a.out2 = c.out[1].data; /* the sum */
    a.rstd = c.out[2].data; /* rstd */
    norm_cuda_launch l = norm_cuda_rms_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_fwd", l.grid, l.block, 3,
                  (opf_tensor[]){c.x, c.res, c.out[0]});
    norm_call_return(stack, &c);
}

/* The RMS backward of both ops: gs_h NULL for rms_norm. Arguments from `first`: weight, rstd, eps, offset. */
static void rms_backward(const char *op, StableIValue *stack, int first, AtenTensorHandle g_h, AtenTensorHandle gs_h,
                         AtenTensorHandle x_h, const char *xarg) {
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[first]);
    OPF_ARG_TENSOR(rstd, stack, first + 1);
    opf_tensor x = opf_tensor_info(op, xarg, x_h);
    OPF_CUDA_CALL(call, op, &x, xarg);
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_rms_bwd(op, opf_check_cuda, g_h, gs_h, x_h, w_h, rstd_h, opf_arg_double(stack[first + 2]),
                         opf_arg_bool(stack[first + 3]), &c);
    norm_cuda_args a = args_of(&c);
    if (gs_h)
        set_rows(op, &a, &c.x, 3, (const opf_tensor *[]){&c.grad, &c.x, &c.grad_sum});
    else
        set_rows(op, &a, &c.x, 2, (const opf_tensor *[]){&c.grad, &c.x});
    set_vec(&a.w, &a.wcs, &c.w);
    a.rstd = c.rstd.data;
    a.out = c.out[0].data;                      /* dx */
    a.out2 = gs_h ? c.out[1].data : NULL;       /* dresidual */
    a.dw = w_h ? c.out[c.nout - 1].data : NULL; /* dweight */
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(op, norm_cuda_bwd_workspace(&a), &c.x, &a.ws);
    norm_cuda_launch l = norm_cuda_rms_bwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "rms_norm_bwd", l.grid, l.block, 3,
                  (opf_tensor[]){c.grad, c.x, c.out[0]});
    norm_call_return(stack, &c);
}

/* rms_norm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, float eps, bool offset) -> (Tensor, Tensor) */
static void rms_norm_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    rms_backward(RMS_BWD, stack, 2, g_h, NULL, x_h, "x");
}

/* add_rms_norm_backward(Tensor grad, Tensor grad_sum, Tensor sum, Tensor? weight, Tensor rstd, float eps,
 *                       bool offset) -> (Tensor, Tensor, Tensor) */
static void add_rms_norm_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(gs, stack, 1);
    OPF_ARG_TENSOR(s, stack, 2);
    rms_backward(ADD_BWD, stack, 3, g_h, gs_h, s_h, "sum");
}

/* layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor) */
static void layer_norm_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[1]);
    OPF_OWNED AtenTensorHandle b_h = opf_arg_optional_tensor(stack[2]);
    opf_tensor x = opf_tensor_info(LN, "x", x_h);
    OPF_CUDA_CALL(call, LN, &x, "x");
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_ln(LN, opf_check_cuda, x_h, w_h, b_h, opf_arg_double(stack[3]), &c);
    norm_cuda_args a = args_of(&c);
    set_rows(LN, &a, &c.x, 1, (const opf_tensor *[]){&c.x});
    set_vec(&a.w, &a.wcs, &c.w);
    set_vec(&a.b, &a.bcs, &c.b);
    a.out = c.out[0].data;  /* y */
    a.mean = c.out[1].data; /* mean */
    a.rstd = c.out[2].data; /* rstd */
    norm_cuda_launch l = norm_cuda_ln_fwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "layer_norm_fwd", l.grid, l.block, 2,
                  (opf_tensor[]){c.x, c.out[0]});
    norm_call_return(stack, &c);
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
    opf_tensor x = opf_tensor_info(LN_BWD, "x", x_h);
    OPF_CUDA_CALL(call, LN_BWD, &x, "x");
    NORM_CALL_OWNED norm_call c = {0};
    norm_prepare_ln_bwd(LN_BWD, opf_check_cuda, g_h, x_h, w_h, b_h, mean_h, rstd_h, opf_arg_double(stack[6]), &c);
    norm_cuda_args a = args_of(&c);
    set_rows(LN_BWD, &a, &c.x, 2, (const opf_tensor *[]){&c.grad, &c.x});
    set_vec(&a.w, &a.wcs, &c.w);
    a.mean = c.mean.data;
    a.rstd = c.rstd.data;
    a.out = c.out[0].data;             /* dx */
    a.dw = w_h ? c.out[1].data : NULL; /* dweight */
    a.db = b_h ? c.out[2].data : NULL; /* dbias */
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LN_BWD, norm_cuda_bwd_workspace(&a), &c.x, &a.ws);
    norm_cuda_launch l = norm_cuda_ln_bwd(&a, call.stream);
    opf_cuda_done(&call, NULL, l.kernel ? l.kernel : "layer_norm_bwd", l.grid, l.block, 3,
                  (opf_tensor[]){c.grad, c.x, c.out[0]});
    norm_call_return(stack, &c);
}

OPF_REGISTER_CUDA(rms_norm, rms_norm_cuda);
OPF_REGISTER_CUDA(rms_norm_backward, rms_norm_backward_cuda);
OPF_REGISTER_CUDA(add_rms_norm, add_rms_norm_cuda);
OPF_REGISTER_CUDA(add_rms_norm_backward, add_rms_norm_backward_cuda);
OPF_REGISTER_CUDA(layer_norm, layer_norm_cuda);
OPF_REGISTER_CUDA(layer_norm_backward, layer_norm_backward_cuda);
