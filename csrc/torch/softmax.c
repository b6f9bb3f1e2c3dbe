/*
 * torch glue of softmax and log_softmax along one dim, and their backwards
 * (from the saved output). Check, allocate, call; the arithmetic and the
 * choice of row / strided-axis paths are csrc/kernels/softmax.c. No copies:
 * every operand is read in place through its strides. The output takes x's
 * strides when x is dense (contiguous, transposed, permuted), else it is
 * contiguous; the gradient takes y's the same way. The checks are shared with
 * the CUDA glue (softmax.h).
 */
#include "../kernels/softmax.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"
#include "softmax.h"

static const char SM[] = OPF_QUALNAME("softmax");
static const char LSM[] = OPF_QUALNAME("log_softmax");
static const char SMB[] = OPF_QUALNAME("softmax_backward");
static const char LSMB[] = OPF_QUALNAME("log_softmax_backward");

/* dim wrapped into [0, ndim); a 0-d tensor is taken as one element along dim 0 or -1, as torch does */
static int wrap_dim(const char *op, int64_t dim, int64_t ndim) {
    int64_t n = ndim > 0 ? ndim : 1;
    if (dim < -n || dim >= n)
        opf_fail(op, "argument 'dim' must be in [%lld, %lld] for a %lld-d tensor, got %lld", (long long)-n,
                 (long long)(n - 1), (long long)ndim, (long long)dim);
    return (int)(dim < 0 ? dim + n : dim);
}

static void run(const opf_tensor *ref, softmax_problem *p, int fwd) {
    static const int64_t one = 1;
    if (ref->ndim == 0) p->ndim = 1, p->sizes = &one, p->strides[0] = p->strides[1] = p->strides[2] = &one;
    const softmax_kernels *k = softmax_kernels_for(opf_isa_current());
    if (fwd)
        softmax_fwd(k, p);
    else
        softmax_bwd(k, p);
}

softmax_args softmax_check(const char *op, __typeof__(opf_check_device) *check_device, AtenTensorHandle x_h,
                           int64_t dim) {
    softmax_args a = {.x = opf_tensor_info(op, "x", x_h)};
    check_device(op, "x", &a.x, "x", &a.x);
    a.dt = opf_check_float(op, "x", &a.x);
    a.dim = wrap_dim(op, dim, a.x.ndim);
    return a;
}

softmax_backward_args softmax_backward_check(const char *op, __typeof__(opf_check_device) *check_device,
                                             AtenTensorHandle grad_h, AtenTensorHandle y_h, int64_t dim) {
    softmax_backward_args a;
    a.grad = opf_tensor_info(op, "grad", grad_h);
    a.y = opf_tensor_info(op, "y", y_h);
    const opf_tensor *g = &a.grad, *y = &a.y;
    check_device(op, "y", y, "y", y);
    check_device(op, "grad", g, "y", y);
    a.dt = opf_check_float(op, "y", y);
    opf_check_same_dtype(op, "grad", g, "y", y);
    opf_check_same_shape(op, "grad", g, "y", y);
    a.dim = wrap_dim(op, dim, y->ndim);
    return a;
}

/* softmax(Tensor x, int dim) -> Tensor, log_softmax(Tensor x, int dim) -> Tensor */
static void softmax_impl(StableIValue *stack, const char *op, int log) {
    OPF_ARG_TENSOR(x, stack, 0);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const softmax_args a = softmax_check(op, opf_check_device, x_h, opf_arg_int(stack[1]));
    const opf_tensor x = a.x;

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(op, &x);
    opf_tensor y = opf_tensor_info(op, "out", y_h);
    if (!opf_is_meta(&x)) {
        softmax_problem p = {.dt = a.dt,
                             .log = log,
                             .ndim = (int)x.ndim,
                             .dim = a.dim,
                             .sizes = x.sizes,
                             .out = y.data,
                             .in = x.data,
                             .strides = {y.strides, x.strides}};
        run(&x, &p, 1);
        opf_log_call(op, t0, 2, (opf_tensor[]){x, y});
    }
    OPF_RETURN(stack, 0, y_h);
}

/* softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor (and log_softmax_backward) */
static void softmax_backward_impl(StableIValue *stack, const char *op, int log) {
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(y, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const softmax_backward_args a = softmax_backward_check(op, opf_check_device, grad_h, y_h, opf_arg_int(stack[2]));
    const opf_tensor g = a.grad, y = a.y;

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(op, &y);
    opf_tensor dx = opf_tensor_info(op, "out", dx_h);
    if (!opf_is_meta(&y)) {
        softmax_problem p = {.dt = a.dt,
                             .log = log,
                             .ndim = (int)y.ndim,
                             .dim = a.dim,
                             .sizes = y.sizes,
                             .out = dx.data,
                             .in = g.data,
                             .y = y.data,
                             .strides = {dx.strides, g.strides, y.strides}};
        run(&y, &p, 0);
        opf_log_call(op, t0, 3, (opf_tensor[]){g, y, dx});
    }
    OPF_RETURN(stack, 0, dx_h);
}

static void softmax_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_impl(stack, SM, 0);
}
static void log_softmax_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_impl(stack, LSM, 1);
}
static void softmax_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_backward_impl(stack, SMB, 0);
}
static void log_softmax_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_backward_impl(stack, LSMB, 1);
}

/* torch's CPU autocast lists neither softmax nor log_softmax: they run in the dtype they are given; its CUDA
 * autocast runs both in float32 */
static const opf_op_desc opf_softmax_ops[] = {
    {
        .schema = "softmax(Tensor x, int dim) -> Tensor",
        .cpu = softmax_cpu,
        .shape = "like:x",
        .backward = "softmax_backward",
        .backward_args = "grad0,out0,dim",
        .backward_grads = "x",
        .autocast = OPF_AUTOCAST_NONE,
        .autocast_cuda = OPF_AUTOCAST_FP32,
        .flops = "5*numel(x)",
        .meta = 1,
    },
    {
        .schema = "log_softmax(Tensor x, int dim) -> Tensor",
        .cpu = log_softmax_cpu,
        .shape = "like:x",
        .backward = "log_softmax_backward",
        .backward_args = "grad0,out0,dim",
        .backward_grads = "x",
        .autocast = OPF_AUTOCAST_NONE,
        .autocast_cuda = OPF_AUTOCAST_FP32,
        .flops = "5*numel(x)",
        .meta = 1,
    },
    {
        .schema = "softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor",
        .cpu = softmax_backward_cpu,
        .shape = "like:y",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "4*numel(y)",
        .meta = 1,
    },
    {
        .schema = "log_softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor",
        .cpu = log_softmax_backward_cpu,
        .shape = "like:y",
        .autocast = OPF_AUTOCAST_NONE,
        .flops = "4*numel(y)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_softmax_ops);
OPF_REGISTER_FAMILY(softmax_variants);

OPF_AOTI_SHIM(softmax, 1, (AtenTensorHandle x, int64_t dim), x, dim);
OPF_AOTI_SHIM(log_softmax, 1, (AtenTensorHandle x, int64_t dim), x, dim);
OPF_AOTI_SHIM(softmax_backward, 1, (AtenTensorHandle grad, AtenTensorHandle y, int64_t dim), grad, y, dim);
OPF_AOTI_SHIM(log_softmax_backward, 1, (AtenTensorHandle grad, AtenTensorHandle y, int64_t dim), grad, y, dim);
