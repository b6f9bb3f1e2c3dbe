/*
 * torch glue of the GEMM ops:
 *   matmul(a (M,K) | (B,M,K), b (K,N) | (B,K,N)) -> (M,N) | (B,M,N)
 *   linear(x (...,K), weight (N,K), bias (N)?, activation, save_preact=True) -> (out (...,N), preact)
 *       out = act(x weight^T + bias); preact = x weight^T + bias, saved for the
 *       backward when act is not "none" and save_preact (else an empty tensor:
 *       a forward that needs no backward writes only out, and a backward given
 *       the empty tensor recomputes preact chunk by chunk)
 *   linear_backward(grad, x, weight, bias?, preact, activation) -> (dx, dweight, dbias)
 *   linear_backward_(...): the same, free to overwrite preact (the autograd
 *       wiring's choice when the saved preact is no one else's)
 * Checks, allocation and the calls; the algorithms (row views of x, chunk
 * plans, both backward strategies, the float64 path) are csrc/kernels/linear.c.
 * float32 runs the blocked GEMM of csrc/kernels/gemm.c. bfloat16 runs it on
 * bfloat16 pairs where the CPU has AVX512-BF16 (the avx512_bf16 ISA; amx: AMX tiles), else on
 * operands converted to float32 while packed, as float16 always does; both
 * accumulate in float32 and round once, in the GEMM's epilogue. float64 runs
 * the oracle (gradcheck). Operands of any strides are read in place; outputs are
 * contiguous. activation: 0 none, 1 relu, 2 gelu, 3 gelu_tanh, 4 silu.
 */
#include <stdlib.h>

#include "../kernels/linear.h"
#include "namespace.h"
#include "opforge/op.h"

static const char MM[] = OPF_QUALNAME("matmul");
static const char LIN[] = OPF_QUALNAME("linear");
static const char LBWD[] = OPF_QUALNAME("linear_backward");

/* t on the device of ref (cpu, or meta for the fake kernel) and of a float type */
static opf_dtype check_operand(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                               const opf_tensor *ref) {
    opf_check_device(op, arg, t, ref_arg, ref);
    return opf_check_float(op, arg, t);
}

static void *at(void *p, int64_t i, opf_dtype dt) { return (char *)p + i * (int64_t)opf_dtype_size(dt); }

static void check_activation(const char *op, int64_t act) {
    if (act < 0 || act >= ACT_COUNT)
        opf_fail(op, "argument 'activation' must be 0 (none), 1 (relu), 2 (gelu), 3 (gelu_tanh) or 4 (silu), got %lld",
                 (long long)act);
}

/* a kernel that refuses its workspace was given one sized for another problem: a bug of ours, which the
 * error names instead of writing past the workspace */
static void check_ran(const char *op, int rc) {
    if (rc != 0)
        opf_fail(op, "internal error: the workspace is smaller than the plan needs (please report it with the "
                     "shapes)");
}

/* The operands of matmul and its backward: a (M,K) and b (K,N), or batched (B,M,K) and (B,K,N), of one
 * float type on one device */
typedef struct matmul_args {
    opf_tensor a, b;
    opf_dtype dt;
    int nd;
    int64_t batch, m, kd, n;
} matmul_args;

static matmul_args check_matmul(const char *op, AtenTensorHandle a_h, AtenTensorHandle b_h) {
    matmul_args mm = {.a = opf_tensor_info(op, "a", a_h), .b = opf_tensor_info(op, "b", b_h)};
    const opf_tensor *a = &mm.a, *b = &mm.b;
    mm.dt = check_operand(op, "a", a, "a", a);
    check_operand(op, "b", b, "a", a);
    opf_check_same_dtype(op, "b", b, "a", a);
    if ((a->ndim != 2 && a->ndim != 3) || a->ndim != b->ndim)
        opf_fail(op, "arguments 'a' and 'b' must both be 2-d (M,K),(K,N) or 3-d (B,M,K),(B,K,N), got %lld-d and %lld-d",
                 (long long)a->ndim, (long long)b->ndim);
    mm.nd = (int)a->ndim;
    mm.batch = mm.nd == 3 ? a->sizes[0] : 1;
    mm.m = a->sizes[mm.nd - 2], mm.kd = a->sizes[mm.nd - 1], mm.n = b->sizes[mm.nd - 1];
    if (b->sizes[mm.nd - 2] != mm.kd)
        opf_fail(op, "argument 'b' must have %lld rows (the columns of 'a'), got %lld", (long long)mm.kd,
                 (long long)b->sizes[mm.nd - 2]);
    if (mm.nd == 3 && b->sizes[0] != mm.batch)
        opf_fail(op, "argument 'b' must have batch size %lld (that of 'a'), got %lld", (long long)mm.batch,
                 (long long)b->sizes[0]);
    return mm;
}

/* ---- matmul ------------------------------------------------------------------------------ */

static void matmul_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(a, stack, 0);
    OPF_ARG_TENSOR(b, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    matmul_args mm = check_matmul(MM, a_h, b_h);
    opf_tensor a = mm.a, b = mm.b;
    const opf_dtype dt = mm.dt;
    const int nd = mm.nd;
    const int64_t batch = mm.batch, m = mm.m, kd = mm.kd, n = mm.n;
    int64_t sizes[3] = {batch, m, n};
    OPF_OWNED AtenTensorHandle c_h = opf_empty(MM, nd, sizes + (3 - nd), a.dtype, &a);
    opf_tensor c = opf_tensor_info(MM, "out", c_h);
    if (opf_is_meta(&a)) {
        OPF_RETURN(stack, 0, c_h);
        return;
    }
    int64_t asb = nd == 3 ? a.strides[0] : 0, bsb = nd == 3 ? b.strides[0] : 0;
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    linear_gemm_plan plan = linear_gemm_plan_for(gemm, dt, m, n, kd);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = dt != OPF_F64 ? opf_workspace(MM, plan.ws_floats, &a, &ws) : NULL;
    for (int64_t i = 0; i < batch; i++) {
        if (dt == OPF_F64) {
            gemm_ref_f64(m, n, kd, (const double *)a.data + i * asb, a.strides[nd - 2], a.strides[nd - 1],
                         (const double *)b.data + i * bsb, b.strides[nd - 2], b.strides[nd - 1],
                         (double *)c.data + i * m * n, n, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            continue;
        }
        check_ran(MM, linear_gemm(gemm, &plan, m, n, kd, at(a.data, i * asb, dt), a.strides[nd - 2], a.strides[nd - 1],
                                  at(b.data, i * bsb, dt), b.strides[nd - 2], b.strides[nd - 1],
                                  at(c.data, i * m * n, dt), NULL, dt, NULL, ACT_NONE, ws));
    }
    opf_log_call(MM, t0, 3, (opf_tensor[]){a, b, c});
    OPF_RETURN(stack, 0, c_h);
}

/* matmul_backward(grad (..., M, N), a (..., M, K), b (..., K, N)) -> (da = grad b^T, db = a^T grad), both
 * contiguous: two GEMMs that read grad, a and b in place through their strides */
static void matmul_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char MMB[] = OPF_QUALNAME("matmul_backward");
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(a, stack, 1);
    OPF_ARG_TENSOR(b, stack, 2);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    matmul_args mm = check_matmul(MMB, a_h, b_h);
    opf_tensor a = mm.a, b = mm.b, g = opf_tensor_info(MMB, "grad", g_h);
    const opf_dtype dt = mm.dt;
    const int nd = mm.nd;
    const int64_t batch = mm.batch, m = mm.m, kd = mm.kd, n = mm.n;
    check_operand(MMB, "grad", &g, "a", &a);
    opf_check_same_dtype(MMB, "grad", &g, "a", &a);
    int64_t want_sizes[3] = {batch, m, n};
    opf_tensor want = {.ndim = nd, .sizes = want_sizes + (3 - nd)};
    opf_check_same_shape(MMB, "grad", &g, "the output", &want);
    OPF_OWNED AtenTensorHandle da_h = opf_empty(MMB, nd, a.sizes, a.dtype, &a);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(MMB, nd, b.sizes, b.dtype, &b);
    opf_tensor da = opf_tensor_info(MMB, "da", da_h), db = opf_tensor_info(MMB, "db", db_h);
    if (opf_is_meta(&a)) {
        OPF_RETURN(stack, 0, da_h);
        OPF_RETURN(stack, 1, db_h);
        return;
    }
    const int64_t gsb = nd == 3 ? g.strides[0] : 0, asb = nd == 3 ? a.strides[0] : 0, bsb = nd == 3 ? b.strides[0] : 0;
    const int64_t grs = g.strides[nd - 2], gcs = g.strides[nd - 1], ars = a.strides[nd - 2], acs = a.strides[nd - 1];
    const int64_t brs = b.strides[nd - 2], bcs = b.strides[nd - 1];
    if (dt == OPF_F64) {
        for (int64_t i = 0; i < batch; i++) {
            const double *gi = (const double *)g.data + i * gsb, *ai = (const double *)a.data + i * asb;
            const double *bi = (const double *)b.data + i * bsb;
            gemm_ref_f64(m, kd, n, gi, grs, gcs, bi, bcs, brs, (double *)da.data + i * m * kd, kd, 0.0, NULL, 0,
                         GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            gemm_ref_f64(kd, n, m, ai, acs, ars, gi, grs, gcs, (double *)db.data + i * kd * n, n, 0.0, NULL, 0,
                         GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
        }
    } else {
        const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
        linear_gemm_plan pa = linear_gemm_plan_for(gemm, dt, m, kd, n), pb = linear_gemm_plan_for(gemm, dt, kd, n, m);
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h =
            opf_workspace(MMB, pa.ws_floats > pb.ws_floats ? pa.ws_floats : pb.ws_floats, &a, &ws);
        for (int64_t i = 0; i < batch; i++) {
            const void *gi = at(g.data, i * gsb, dt), *ai = at(a.data, i * asb, dt), *bi = at(b.data, i * bsb, dt);
            /* da (m, kd) = grad (m, n) . b^T (n, kd) */
            check_ran(MMB, linear_gemm(gemm, &pa, m, kd, n, gi, grs, gcs, bi, bcs, brs, at(da.data, i * m * kd, dt),
                                       NULL, dt, NULL, ACT_NONE, ws));
            /* db (kd, n) = a^T (kd, m) . grad (m, n) */
            check_ran(MMB, linear_gemm(gemm, &pb, kd, n, m, ai, acs, ars, gi, grs, gcs, at(db.data, i * kd * n, dt),
                                       NULL, dt, NULL, ACT_NONE, ws));
        }
    }
    opf_log_call(MMB, t0, 3, (opf_tensor[]){g, a, b});
    OPF_RETURN(stack, 0, da_h);
    OPF_RETURN(stack, 1, db_h);
}

/* ---- linear ------------------------------------------------------------------------------- */

typedef struct linear_args {
    opf_tensor x, w, bias;
    int has_bias;
    opf_dtype dt;
    int64_t k, n;
    linear_problem p; /* the inputs; the caller adds the outputs */
} linear_args;

static linear_view view_of(const opf_tensor *t) {
    return (linear_view){.data = t->data, .ndim = t->ndim, .sizes = t->sizes, .strides = t->strides};
}

static linear_args check_linear(const char *op, AtenTensorHandle x_h, AtenTensorHandle w_h, AtenTensorHandle b_h,
                                int64_t act) {
    linear_args l = {
        .x = opf_tensor_info(op, "x", x_h), .w = opf_tensor_info(op, "weight", w_h), .has_bias = b_h != NULL};
    l.dt = check_operand(op, "x", &l.x, "x", &l.x);
    check_operand(op, "weight", &l.w, "x", &l.x);
    opf_check_same_dtype(op, "weight", &l.w, "x", &l.x);
    if (l.x.ndim < 1) opf_fail(op, "argument 'x' must have at least 1 dim (..., in_features), got a 0-d tensor");
    if (l.w.ndim != 2)
        opf_fail(op, "argument 'weight' must be 2-d (out_features, in_features), got %lld-d", (long long)l.w.ndim);
    l.k = l.x.sizes[l.x.ndim - 1];
    l.n = l.w.sizes[0];
    if (l.w.sizes[1] != l.k)
        opf_fail(op, "argument 'weight' must have %lld columns (in_features, the last dim of 'x'), got %lld",
                 (long long)l.k, (long long)l.w.sizes[1]);
    if (l.has_bias) {
        l.bias = opf_tensor_info(op, "bias", b_h);
        check_operand(op, "bias", &l.bias, "x", &l.x);
        opf_check_same_dtype(op, "bias", &l.bias, "x", &l.x);
        opf_tensor want = {.ndim = 1, .sizes = &l.n};
        opf_check_same_shape(op, "bias", &l.bias, "out_features", &want);
    }
    int64_t m = 1; /* rows: the product of x's leading dims */
    for (int64_t d = 0; d < l.x.ndim - 1; d++) m *= l.x.sizes[d];
    l.p = (linear_problem){.m = m,
                           .in_features = l.k,
                           .out_features = l.n,
                           .dt = l.dt,
                           .act = (int)act,
                           .x = view_of(&l.x),
                           .weight = l.w.data,
                           .weight_strides = {l.w.strides[0], l.w.strides[1]},
                           .bias = l.has_bias ? l.bias.data : NULL,
                           .bias_stride = l.has_bias ? l.bias.strides[0] : 0};
    return l;
}

/* the shape of out: x's with the last dim replaced by n */
static void out_sizes(const opf_tensor *x, int64_t n, int64_t *sizes) {
    for (int64_t d = 0; d < x->ndim - 1; d++) sizes[d] = x->sizes[d];
    sizes[x->ndim - 1] = n;
}

static void linear_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(w, stack, 1);
    OPF_OWNED AtenTensorHandle bias_h = opf_arg_optional_tensor(stack[2]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    int64_t act = opf_arg_int(stack[3]);
    check_activation(LIN, act);
    const int save = act && opf_arg_bool(stack[4]); /* preact is made only for a backward */
    linear_args l = check_linear(LIN, x_h, w_h, bias_h, act);
    int64_t sizes[OPF_MAX_DIMS], empty = 0;
    out_sizes(&l.x, l.n, sizes);
    OPF_OWNED AtenTensorHandle out_h = opf_empty(LIN, l.x.ndim, sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle pre_h =
        save ? opf_empty(LIN, l.x.ndim, sizes, l.x.dtype, &l.x) : opf_empty(LIN, 1, &empty, l.x.dtype, &l.x);
    opf_tensor out = opf_tensor_info(LIN, "out", out_h), pre = opf_tensor_info(LIN, "preact", pre_h);
    if (opf_is_meta(&l.x)) {
        OPF_RETURN(stack, 0, out_h);
        OPF_RETURN(stack, 1, pre_h);
        return;
    }
    l.p.out = out.data;
    l.p.preact = save ? pre.data : NULL;
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    int64_t ws_floats = linear_fwd_workspace(gemm, &l.p);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LIN, ws_floats, &l.x, &ws);
    check_ran(LIN, linear_fwd(gemm, &l.p, ws, ws_floats));
    opf_log_call(LIN, t0, 3, (opf_tensor[]){l.x, l.w, out});
    OPF_RETURN(stack, 0, out_h);
    OPF_RETURN(stack, 1, pre_h);
}

/* linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor preact, int activation)
 *   g' = grad * act'(preact)   (grad itself for "none"), gathered into (M, N)
 *   dx = g' weight             dweight = g'^T x             dbias = sum_rows g'
 * linear_backward_ is the same with preact overwritten by g' where it can be
 * (the autograd wiring calls it when the saved preact is no one else's). */
static void linear_backward_impl(StableIValue *stack, int in_place) {
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    OPF_ARG_TENSOR(w, stack, 2);
    OPF_OWNED AtenTensorHandle bias_h = opf_arg_optional_tensor(stack[3]);
    OPF_ARG_TENSOR(pre, stack, 4);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    int64_t act = opf_arg_int(stack[5]);
    check_activation(LBWD, act);
    linear_args l = check_linear(LBWD, x_h, w_h, bias_h, act);
    opf_tensor g = opf_tensor_info(LBWD, "grad", grad_h), pre = opf_tensor_info(LBWD, "preact", pre_h);
    opf_check_device(LBWD, "grad", &g, "x", &l.x);
    opf_check_same_dtype(LBWD, "grad", &g, "x", &l.x);
    int64_t sizes[OPF_MAX_DIMS], empty = 0;
    out_sizes(&l.x, l.n, sizes);
    opf_tensor want = {.ndim = l.x.ndim, .sizes = sizes};
    opf_check_same_shape(LBWD, "grad", &g, "the output", &want);
    if (act) { /* an empty preact (save_preact=False) is recomputed */
        opf_check_device(LBWD, "preact", &pre, "x", &l.x);
        opf_check_same_dtype(LBWD, "preact", &pre, "x", &l.x);
        if (pre.numel != 0 || pre.ndim != 1) opf_check_same_shape(LBWD, "preact", &pre, "the output", &want);
    }

    OPF_OWNED AtenTensorHandle dx_h = opf_empty(LBWD, l.x.ndim, l.x.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle dw_h = opf_empty(LBWD, 2, l.w.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(LBWD, 1, l.has_bias ? &l.n : &empty, l.x.dtype, &l.x);
    opf_tensor dx = opf_tensor_info(LBWD, "dx", dx_h), dw = opf_tensor_info(LBWD, "dweight", dw_h),
               db = opf_tensor_info(LBWD, "dbias", db_h);
    if (!opf_is_meta(&l.x)) {
        l.p.grad = view_of(&g);
        l.p.saved_preact = view_of(&pre);
        if (pre.numel == 0) l.p.saved_preact.data = NULL;
        l.p.dx = dx.data, l.p.dweight = dw.data, l.p.dbias = l.has_bias ? db.data : NULL;
        const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
        linear_bwd_strategy strategy = linear_bwd_plan(&l.p, in_place);
        int64_t ws_floats = linear_bwd_workspace(gemm, &l.p, strategy);
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LBWD, ws_floats, &l.x, &ws);
        check_ran(LBWD, linear_bwd(gemm, &l.p, strategy, ws, ws_floats));
    }
    opf_log_call(LBWD, t0, 3, (opf_tensor[]){g, l.x, dw});
    OPF_RETURN(stack, 0, dx_h);
    OPF_RETURN(stack, 1, dw_h);
    OPF_RETURN(stack, 2, db_h);
}

static void linear_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) { linear_backward_impl(stack, 0); }
static void linear_backward_inplace_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    linear_backward_impl(stack, 1);
}

const opf_op_desc opf_linear_ops[] = {
    {
        .schema = "matmul(Tensor a, Tensor b) -> Tensor",
        .cpu = matmul_cpu,
        .shape = "[a[:-1], b[-1]]",
        .backward = "matmul_backward",
        .backward_args = "grad0,a,b",
        .backward_grads = "a,b",
        .autocast = OPF_AUTOCAST_LOWER,
        .flops = "2*numel(a)*size(b,-1)",
        .meta = 1,
    },
    {
        .schema = "matmul_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)",
        .cpu = matmul_backward_cpu,
        .shape = "[a[:]]; [b[:]]",
        .flops = "4*numel(a)*size(b,-1)",
        .meta = 1,
    },
    {
        .schema = "linear(Tensor x, Tensor weight, Tensor? bias, int activation, bool save_preact=True) "
                  "-> (Tensor, Tensor)",
        .cpu = linear_cpu,
        .shape = "[x[:-1], weight[0]]; [x[:-1], weight[0]] if activation and save_preact",
        .backward = "linear_backward",
        .backward_args = "grad0,x,weight,bias,out1!,activation",
        .backward_grads = "x,weight,bias",
        .autocast = OPF_AUTOCAST_LOWER,
        .flops = "2*numel(x)*size(weight,0)",
        .meta = 1,
    },
    {
        .schema = "linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor preact, "
                  "int activation) -> (Tensor, Tensor, Tensor)",
        .cpu = linear_backward_cpu,
        .shape = "[x[:]]; [weight[:]]; [bias[:]] dtype=x if bias",
        .flops = "4*numel(x)*size(weight,0)",
        .meta = 1,
    },
    {
        .schema = "linear_backward_(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor(a!) preact, "
                  "int activation) -> (Tensor, Tensor, Tensor)",
        .cpu = linear_backward_inplace_cpu,
        .shape = "[x[:]]; [weight[:]]; [bias[:]] dtype=x if bias",
        .flops = "4*numel(x)*size(weight,0)",
        .meta = 1,
    },
    OPF_OP_END,
};
