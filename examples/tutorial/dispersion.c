/*
 * The brief's dispersion correction as a user op, in one C file:
 *     y = x * alpha + sqrt(x),   dx = dy * alpha + dy / (2 * sqrt(x))
 * Loaded with opforge.load("tutorial", ["dispersion.c"]); float32 and
 * float64, any shape and strides. (opforge ships a faster, vectorised
 * version of the same op as opforge.dispersion_correction.)
 */
#include <math.h>

#include <opforge/op.h>

/* ---- kernels: the brief's loop, on one strided run of n elements ---------------- */

static void fwd_f32(float *y, const float *x, int64_t n, int64_t ys, int64_t xs, float alpha) {
    for (int64_t i = 0; i < n; i++) y[i * ys] = x[i * xs] * alpha + sqrtf(x[i * xs]);
}

static void fwd_f64(double *y, const double *x, int64_t n, int64_t ys, int64_t xs, double alpha) {
    for (int64_t i = 0; i < n; i++) y[i * ys] = x[i * xs] * alpha + sqrt(x[i * xs]);
}

static void bwd_f32(float *dx, const float *dy, const float *x, int64_t n, const int64_t *st, float alpha) {
    for (int64_t i = 0; i < n; i++) {
        float g = dy[i * st[1]];
        dx[i * st[0]] = g * alpha + g / (2.0f * sqrtf(x[i * st[2]]));
    }
}

static void bwd_f64(double *dx, const double *dy, const double *x, int64_t n, const int64_t *st, double alpha) {
    for (int64_t i = 0; i < n; i++) {
        double g = dy[i * st[1]];
        dx[i * st[0]] = g * alpha + g / (2.0 * sqrt(x[i * st[2]]));
    }
}

/* ---- the runtime walks the tensors in runs; each run calls a kernel -------------- */

typedef struct job {
    opf_dtype dt;
    char *out;
    const char *a, *b;
    double alpha;
} job;

static void fwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const job *j = ctx;
    if (j->dt == OPF_F32)
        fwd_f32((float *)j->out + off[0], (const float *)j->a + off[1], n, st[0], st[1], (float)j->alpha);
    else
        fwd_f64((double *)j->out + off[0], (const double *)j->a + off[1], n, st[0], st[1], j->alpha);
}

static void bwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const job *j = ctx;
    if (j->dt == OPF_F32)
        bwd_f32((float *)j->out + off[0], (const float *)j->a + off[1], (const float *)j->b + off[2], n, st,
                (float)j->alpha);
    else
        bwd_f64((double *)j->out + off[0], (const double *)j->a + off[1], (const double *)j->b + off[2], n, st,
                j->alpha);
}

static opf_dtype check_x(const char *op, const opf_tensor *x) {
    opf_check_cpu(op, "x", x);
    opf_dtype dt = opf_check_float(op, "x", x);
    if (dt != OPF_F32 && dt != OPF_F64)
        opf_fail(op, "argument 'x' must be float32 or float64, got %s", opf_dtype_name(x->dtype));
    return dt;
}

/* ---- glue: check, allocate, call ------------------------------------------------- */

/* dispersion(Tensor x, float alpha) -> Tensor */
static void dispersion_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "tutorial::dispersion";
    OPF_ARG_TENSOR(x, stack, 0); /* released on every path, errors included */
    double alpha = opf_arg_double(stack[1]);
    opf_tensor x = opf_tensor_info(OP, "x", x_h);
    opf_dtype dt = check_x(OP, &x);

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(OP, &x);
    opf_tensor y = opf_tensor_info(OP, "out", y_h);
    opf_nd nd;
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 2, (const int64_t *[]){y.strides, x.strides});
    opf_nd_parallel(&nd, 32768, fwd_run, &(job){dt, y.data, x.data, NULL, alpha});
    OPF_RETURN(stack, 0, y_h);
}

/* dispersion_backward(Tensor grad, Tensor x, float alpha) -> Tensor */
static void dispersion_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "tutorial::dispersion_backward";
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    double alpha = opf_arg_double(stack[2]);
    opf_tensor g = opf_tensor_info(OP, "grad", grad_h);
    opf_tensor x = opf_tensor_info(OP, "x", x_h);
    opf_dtype dt = check_x(OP, &x);
    opf_check_same_dtype(OP, "grad", &g, "x", &x);
    opf_check_same_shape(OP, "grad", &g, "x", &x);

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(OP, &x);
    opf_tensor dx = opf_tensor_info(OP, "out", dx_h);
    opf_nd nd;
    opf_nd_init(&nd, (int)x.ndim, x.sizes, 3, (const int64_t *[]){dx.strides, g.strides, x.strides});
    opf_nd_parallel(&nd, 32768, bwd_run, &(job){dt, dx.data, g.data, x.data, alpha});
    OPF_RETURN(stack, 0, dx_h);
}

/* ---- descriptors: what the Python layer wires (fake, autograd, autocast) ---------- */

OPF_OP_TABLE({.schema = "dispersion(Tensor x, float alpha) -> Tensor",
              .cpu = dispersion_cpu,
              .shape = "like:x",
              .backward = "dispersion_backward",
              .backward_args = "grad0,x,alpha",
              .backward_grads = "x",
              .autocast = OPF_AUTOCAST_FP32,
              .flops = "3*numel(x)"},
             {.schema = "dispersion_backward(Tensor grad, Tensor x, float alpha) -> Tensor",
              .cpu = dispersion_backward_cpu,
              .shape = "like:x"})
