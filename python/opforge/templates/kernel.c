/*
 * {name}: y = alpha * x * x            (edit the formula, keep the structure)
 *   backward: dx = 2 * alpha * x * dy
 *
 * One file holds the scalar reference kernels (the oracle: keep them), the
 * glue that checks arguments, allocates and calls a kernel, and the
 * descriptors. {name}_avx2.c holds the vectorised variant. Load with
 *     opforge.load("{name}", ["{name}.c", "{name}_avx2.c"])
 */
#include <opforge/op.h>

#include "{name}.h"

/* ---- scalar reference: one strided run of n elements ------------------------------ */

static void fwd_ref(float *y, const float *x, int64_t n, int64_t ys, int64_t xs, float alpha) {
    for (int64_t i = 0; i < n; i++) y[i * ys] = alpha * x[i * xs] * x[i * xs];
}

static void bwd_ref(float *dx, const float *dy, const float *x, int64_t n, int64_t dxs, int64_t dys,
                    int64_t xs, float alpha) {
    for (int64_t i = 0; i < n; i++) dx[i * dxs] = 2.0f * alpha * x[i * xs] * dy[i * dys];
}

const {name}_kernels {name}_kernels_ref = {fwd_ref, bwd_ref};

/* The AVX2 file may be left out of a build: a weak reference is then NULL. */
extern const {name}_kernels {name}_kernels_avx2 __attribute__((weak));

static const {name}_kernels *kernels(void) {
    if (opf_isa_current() >= OPF_ISA_AVX2 && &{name}_kernels_avx2) return &{name}_kernels_avx2;
    return &{name}_kernels_ref;
}

/* ---- the runtime walks tensors in runs; each run calls a kernel ------------------- */

typedef struct job {
    const {name}_kernels *k;
    float *out;
    const float *a, *b;
    float alpha;
} job;

static void fwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const job *j = ctx;
    j->k->fwd(j->out + off[0], j->a + off[1], n, st[0], st[1], j->alpha);
}

static void bwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const job *j = ctx;
    j->k->bwd(j->out + off[0], j->a + off[1], j->b + off[2], n, st[0], st[1], st[2], j->alpha);
}

static void check_x(const char *op, const opf_tensor *x) {
    opf_check_cpu(op, "x", x);
    if (opf_check_float(op, "x", x) != OPF_F32)
        opf_fail(op, "argument 'x' must be float32, got %s", opf_dtype_name(x->dtype));
}

/* ---- glue: check, allocate, call -------------------------------------------------- */

/* {name}(Tensor x, float alpha) -> Tensor */
static void {name}_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "{name}::{name}";
    OPF_ARG_TENSOR(x, stack, 0); /* released on every path, errors included */
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    float alpha = (float)opf_arg_double(stack[1]);
    opf_tensor x = opf_tensor_info(OP, "x", x_h);
    check_x(OP, &x);

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(OP, &x);
    opf_tensor y = opf_tensor_info(OP, "out", y_h);
    opf_nd nd;
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 2, (const int64_t *[]){y.strides, x.strides});
    opf_nd_parallel(&nd, 32768, fwd_run, &(job){kernels(), y.data, x.data, NULL, alpha});
    opf_log_call(OP, t0, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
}

/* {name}_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void {name}_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "{name}::{name}_backward";
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    float alpha = (float)opf_arg_double(stack[2]);
    opf_tensor g = opf_tensor_info(OP, "grad", grad_h);
    opf_tensor x = opf_tensor_info(OP, "x", x_h);
    check_x(OP, &x);
    opf_check_same_dtype(OP, "grad", &g, "x", &x);
    opf_check_same_shape(OP, "grad", &g, "x", &x);

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(OP, &x);
    opf_tensor dx = opf_tensor_info(OP, "out", dx_h);
    opf_nd nd;
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 3, (const int64_t *[]){dx.strides, g.strides, x.strides});
    opf_nd_parallel(&nd, 32768, bwd_run, &(job){kernels(), dx.data, g.data, x.data, alpha});
    OPF_RETURN(stack, 0, dx_h);
}

/* ---- descriptors: the Python layer wires fake kernel, autograd and autocast -------- */

OPF_OP_TABLE(
    {.schema = "{name}(Tensor x, float alpha) -> Tensor",
     .cpu = {name}_cpu,
     .shape = "like:x",                  /* output: x's shape, dtype and (dense) layout */
     .backward = "{name}_backward",
     .backward_args = "grad0,x,alpha",   /* grad of output 0, input x (saved), alpha */
     .backward_grads = "x",
     .autocast = OPF_AUTOCAST_FP32,      /* float32 kernel: autocast casts inputs to it */
     .flops = "2*numel(x)"},             /* for torch.utils.flop_counter */
    {.schema = "{name}_backward(Tensor grad, Tensor x, float alpha) -> Tensor",
     .cpu = {name}_backward_cpu,
     .shape = "like:x",
     .flops = "3*numel(x)"})
