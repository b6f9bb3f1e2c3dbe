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
 * Checks, allocation and the calls; the algorithms (row views of x, matmul's
 * batches and transposes, the plans, both backward strategies, the float64
 * paths) are csrc/kernels/linear.c.
 * float32 runs the blocked GEMM of csrc/kernels/gemm.c. bfloat16 runs it on
 * bfloat16 pairs where the CPU has AVX512-BF16 (the avx512_bf16 ISA; amx: AMX tiles), else on
 * operands converted to float32 while packed, as float16 always does; both
 * accumulate in float32 and round once, in the GEMM's epilogue. float64 runs
 * the oracle (gradcheck). Operands of any strides are read in place; outputs are
 * contiguous. activation: "none", "relu", "gelu", "gelu_tanh" or "silu" (ACT_NAMES), read as
 * an act_kind.
 */
#include <stdlib.h>

#include "../kernels/linear.h"
#include "aoti.h"
#include "namespace.h"
#include "provider.h"
#include "opforge/op.h"

static const char MATMUL[] = OPF_QUALNAME("matmul");
static const char MATMUL_BACKWARD[] = OPF_QUALNAME("matmul_backward");
static const char LINEAR[] = OPF_QUALNAME("linear");
static const char LINEAR_BACKWARD[] = OPF_QUALNAME("linear_backward");

/* t on the device of ref (cpu, or meta for the fake kernel) and of a float type */
static opf_dtype check_operand(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                               const opf_tensor *ref) {
    opf_check_device(op, arg, t, ref_arg, ref);
    return opf_check_float(op, arg, t);
}

/* The `str activation` argument as an act_kind (ACT_NAMES lists them in order). Read before anything
 * is checked: a failure there would leave torch's string to no one. */
static act_kind arg_activation(const char *op, StableIValue v) {
    return (act_kind)opf_arg_enum(op, "activation", v, ACT_NAMES);
}

/* provider.h's OPF_RUN_CLAIMED with linear.h's code of a declined claim */
#define RUN_CLAIMED(op, like, plan, workspace_of, make, claim, run) \
    OPF_RUN_CLAIMED(op, like, plan, workspace_of, make, claim, run, LINEAR_ERR_DECLINED)

static linear_view view_of(const opf_tensor *t) {
    return (linear_view){.data = t->data, .ndim = t->ndim, .sizes = t->sizes, .strides = t->strides};
}

/* The operands of matmul and its backward: a (M,K) and b (K,N), or batched (B,M,K) and (B,K,N), of one
 * float type on one device */
typedef struct matmul_args {
    opf_tensor a, b;
    opf_dtype dt;
    int nd;
    int64_t batch, m, k, n;
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
    mm.m = a->sizes[mm.nd - 2], mm.k = a->sizes[mm.nd - 1], mm.n = b->sizes[mm.nd - 1];
    if (b->sizes[mm.nd - 2] != mm.k)
        opf_fail(op, "argument 'b' must have %lld rows (the columns of 'a'), got %lld", (long long)mm.k,
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
    matmul_args mm = check_matmul(MATMUL, a_h, b_h);
    int64_t sizes[3] = {mm.batch, mm.m, mm.n};
    OPF_OWNED AtenTensorHandle c_h = opf_empty(MATMUL, mm.nd, sizes + (3 - mm.nd), mm.a.dtype, &mm.a);
    opf_tensor c = opf_tensor_info(MATMUL, "out", c_h);
    if (opf_is_meta(&mm.a)) {
        OPF_RETURN(stack, 0, c_h);
        return;
    }
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const linear_view av = view_of(&mm.a), bv = view_of(&mm.b);
    matmul_fwd_plan plan;
    RUN_CLAIMED(MATMUL, &mm.a, plan, matmul_fwd_workspace,
                matmul_fwd_plan_make(gemm, mm.dt, mm.batch, mm.m, mm.n, mm.k, opf_num_threads()),
                matmul_fwd_plan_claim(&plan, &av, &bv), matmul_fwd(&plan, c.data, &av, &bv, ws, wsn));
    opf_log_call(MATMUL, t0, 3, (opf_tensor[]){mm.a, mm.b, c});
    OPF_RETURN(stack, 0, c_h);
}

/* matmul_backward(grad (..., M, N), a (..., M, K), b (..., K, N), needs) -> (da = grad b^T, db = a^T grad),
 * both contiguous; needs: bit 0 da, bit 1 db (the other one is returned uncomputed) */
static void matmul_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(a, stack, 1);
    OPF_ARG_TENSOR(b, stack, 2);
    const int64_t needs = opf_arg_int(stack[3]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    matmul_args mm = check_matmul(MATMUL_BACKWARD, a_h, b_h);
    opf_tensor g = opf_tensor_info(MATMUL_BACKWARD, "grad", g_h);
    check_operand(MATMUL_BACKWARD, "grad", &g, "a", &mm.a);
    opf_check_same_dtype(MATMUL_BACKWARD, "grad", &g, "a", &mm.a);
    int64_t want_sizes[3] = {mm.batch, mm.m, mm.n};
    opf_tensor want = {.ndim = mm.nd, .sizes = want_sizes + (3 - mm.nd)};
    opf_check_same_shape(MATMUL_BACKWARD, "grad", &g, "the output", &want);
    OPF_OWNED AtenTensorHandle da_h = opf_empty(MATMUL_BACKWARD, mm.nd, mm.a.sizes, mm.a.dtype, &mm.a);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(MATMUL_BACKWARD, mm.nd, mm.b.sizes, mm.b.dtype, &mm.b);
    opf_tensor da = opf_tensor_info(MATMUL_BACKWARD, "da", da_h), db = opf_tensor_info(MATMUL_BACKWARD, "db", db_h);
    if (opf_is_meta(&mm.a)) {
        OPF_RETURN(stack, 0, da_h);
        OPF_RETURN(stack, 1, db_h);
        return;
    }
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const linear_view gv = view_of(&g), av = view_of(&mm.a), bv = view_of(&mm.b);
    void *da_p = needs & 1 ? da.data : NULL, *db_p = needs & 2 ? db.data : NULL;
    matmul_bwd_plan plan;
    RUN_CLAIMED(MATMUL_BACKWARD, &mm.a, plan, matmul_bwd_workspace,
                matmul_bwd_plan_make(gemm, mm.dt, mm.batch, mm.m, mm.n, mm.k, opf_num_threads()),
                matmul_bwd_plan_claim(&plan, &gv, &av, &bv), matmul_bwd(&plan, da_p, db_p, &gv, &av, &bv, ws, wsn));
    opf_log_call(MATMUL_BACKWARD, t0, 3, (opf_tensor[]){g, mm.a, mm.b});
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

static linear_args check_linear(const char *op, AtenTensorHandle x_h, AtenTensorHandle w_h, AtenTensorHandle b_h,
                                act_kind act) {
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
        opf_fail(op,
                 "the last dim of argument 'x' (%lld) must equal the columns of argument 'weight' (its in_features; "
                 "weight is (out_features, in_features) = (%lld, %lld)): a weight of %lld columns, or an x whose "
                 "last dim is %lld",
                 (long long)l.k, (long long)l.w.sizes[0], (long long)l.w.sizes[1], (long long)l.k,
                 (long long)l.w.sizes[1]);
    if (l.has_bias) {
        l.bias = opf_tensor_info(op, "bias", b_h);
        check_operand(op, "bias", &l.bias, "x", &l.x);
        opf_check_same_dtype(op, "bias", &l.bias, "x", &l.x);
        opf_tensor want = {.ndim = 1, .sizes = &l.n};
        opf_check_same_shape(op, "bias", &l.bias, "out_features", &want);
    }
    l.p = (linear_problem){.n = l.n,
                           .k = l.k,
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
    act_kind act = arg_activation(LINEAR, stack[3]);
    const int save = act && opf_arg_bool(stack[4]); /* preact is made only for a backward */
    linear_args l = check_linear(LINEAR, x_h, w_h, bias_h, act);
    int64_t sizes[OPF_MAX_DIMS], empty = 0;
    out_sizes(&l.x, l.n, sizes);
    OPF_OWNED AtenTensorHandle out_h = opf_empty(LINEAR, l.x.ndim, sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle pre_h =
        save ? opf_empty(LINEAR, l.x.ndim, sizes, l.x.dtype, &l.x) : opf_empty(LINEAR, 1, &empty, l.x.dtype, &l.x);
    opf_tensor out = opf_tensor_info(LINEAR, "out", out_h), pre = opf_tensor_info(LINEAR, "preact", pre_h);
    if (opf_is_meta(&l.x)) {
        OPF_RETURN(stack, 0, out_h);
        OPF_RETURN(stack, 1, pre_h);
        return;
    }
    l.p.out = out.data;
    l.p.preact = save ? pre.data : NULL;
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    linear_fwd_plan plan;
    RUN_CLAIMED(LINEAR, &l.x, plan, linear_fwd_workspace, linear_fwd_plan_make(gemm, &l.p, opf_num_threads()),
                linear_fwd_plan_claim(&plan, &l.p), linear_fwd(&plan, &l.p, ws, wsn));
    opf_log_call(LINEAR, t0, 3, (opf_tensor[]){l.x, l.w, out});
    OPF_RETURN(stack, 0, out_h);
    OPF_RETURN(stack, 1, pre_h);
}

/* linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor preact, str activation, int needs)
 *   g' = grad * act'(preact)   (grad itself for "none"), gathered into (M, N)
 *   dx = g' weight             dweight = g'^T x             dbias = sum_rows g'
 * needs: bit 0 dx, bit 1 dweight, bit 2 dbias; dx and dweight not needed are
 * returned uncomputed (no GEMM), dbias is always made (one pass, or none).
 * linear_backward_ is the same with preact overwritten by g' where it can be
 * (the autograd wiring calls it when the saved preact is no one else's). */
static void linear_backward_impl(StableIValue *stack, int in_place) {
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(x, stack, 1);
    OPF_ARG_TENSOR(w, stack, 2);
    OPF_OWNED AtenTensorHandle bias_h = opf_arg_optional_tensor(stack[3]);
    OPF_ARG_TENSOR(pre, stack, 4);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    act_kind act = arg_activation(LINEAR_BACKWARD, stack[5]);
    const int64_t needs = opf_arg_int(stack[6]);
    linear_args l = check_linear(LINEAR_BACKWARD, x_h, w_h, bias_h, act);
    opf_tensor g = opf_tensor_info(LINEAR_BACKWARD, "grad", grad_h),
               pre = opf_tensor_info(LINEAR_BACKWARD, "preact", pre_h);
    opf_check_device(LINEAR_BACKWARD, "grad", &g, "x", &l.x);
    opf_check_same_dtype(LINEAR_BACKWARD, "grad", &g, "x", &l.x);
    int64_t sizes[OPF_MAX_DIMS], empty = 0;
    out_sizes(&l.x, l.n, sizes);
    opf_tensor want = {.ndim = l.x.ndim, .sizes = sizes};
    opf_check_same_shape(LINEAR_BACKWARD, "grad", &g, "the output", &want);
    if (act) { /* an empty preact (save_preact=False) is recomputed */
        opf_check_device(LINEAR_BACKWARD, "preact", &pre, "x", &l.x);
        opf_check_same_dtype(LINEAR_BACKWARD, "preact", &pre, "x", &l.x);
        if (pre.numel != 0 || pre.ndim != 1) opf_check_same_shape(LINEAR_BACKWARD, "preact", &pre, "the output", &want);
    }

    OPF_OWNED AtenTensorHandle dx_h = opf_empty(LINEAR_BACKWARD, l.x.ndim, l.x.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle dw_h = opf_empty(LINEAR_BACKWARD, 2, l.w.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(LINEAR_BACKWARD, 1, l.has_bias ? &l.n : &empty, l.x.dtype, &l.x);
    opf_tensor dx = opf_tensor_info(LINEAR_BACKWARD, "dx", dx_h),
               dw = opf_tensor_info(LINEAR_BACKWARD, "dweight", dw_h),
               db = opf_tensor_info(LINEAR_BACKWARD, "dbias", db_h);
    if (!opf_is_meta(&l.x)) {
        l.p.grad = view_of(&g);
        l.p.saved_preact = view_of(&pre);
        if (pre.numel == 0) l.p.saved_preact.data = NULL;
        l.p.dx = needs & 1 ? dx.data : NULL, l.p.dweight = needs & 2 ? dw.data : NULL;
        l.p.dbias = l.has_bias ? db.data : NULL;
        const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
        linear_bwd_plan plan; /* only the direct backward, which overwrites no input, is claimed */
        RUN_CLAIMED(LINEAR_BACKWARD, &l.x, plan, linear_bwd_workspace,
                    linear_bwd_plan_make(gemm, &l.p, in_place, opf_num_threads()), linear_bwd_plan_claim(&plan, &l.p),
                    linear_bwd(&plan, &l.p, ws, wsn));
    }
    opf_log_call(LINEAR_BACKWARD, t0, 3, (opf_tensor[]){g, l.x, dw});
    OPF_RETURN(stack, 0, dx_h);
    OPF_RETURN(stack, 1, dw_h);
    OPF_RETURN(stack, 2, db_h);
}

static void linear_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) { linear_backward_impl(stack, 0); }
static void linear_backward_inplace_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    linear_backward_impl(stack, 1);
}

static const opf_op_desc opf_linear_ops[] = {
    {
        .schema = "matmul(Tensor a, Tensor b) -> Tensor",
        .cpu = matmul_cpu,
        .shape = "[a[:-1], b[-1]]",
        .backward = "matmul_backward",
        .backward_args = "grad0,a,b,needs",
        .backward_grads = "a,b",
        .autocast = OPF_AUTOCAST_LOWER,
        .flops = "2*numel(a)*size(b,-1)",
        .meta = 1,
    },
    {
        .schema = "matmul_backward(Tensor grad, Tensor a, Tensor b, int needs=3) -> (Tensor, Tensor)",
        .cpu = matmul_backward_cpu,
        .shape = "[a[:]]; [b[:]]",
        .flops = "4*numel(a)*size(b,-1)",
        .meta = 1,
    },
    {
        .schema = "linear(Tensor x, Tensor weight, Tensor? bias, str activation, bool save_preact=True) "
                  "-> (Tensor, Tensor)",
        .cpu = linear_cpu,
        .shape = "[x[:-1], weight[0]]; [x[:-1], weight[0]] if activation and save_preact",
        .backward = "linear_backward",
        .backward_args = "grad0,x,weight,bias,out1!,activation,needs",
        .backward_grads = "x,weight,bias",
        .autocast = OPF_AUTOCAST_LOWER,
        .flops = "2*numel(x)*size(weight,0)",
        .meta = 1,
        .enums = "activation: " ACT_NAMES,
    },
    {
        .schema = "linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor preact, "
                  "str activation, int needs=7) -> (Tensor, Tensor, Tensor)",
        .cpu = linear_backward_cpu,
        .shape = "[x[:]]; [weight[:]]; [bias[:]] dtype=x if bias",
        .flops = "4*numel(x)*size(weight,0)",
        .meta = 1,
        .enums = "activation: " ACT_NAMES,
    },
    {
        .schema = "linear_backward_(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor(a!) preact, "
                  "str activation, int needs=7) -> (Tensor, Tensor, Tensor)",
        .cpu = linear_backward_inplace_cpu,
        .shape = "[x[:]]; [weight[:]]; [bias[:]] dtype=x if bias",
        .flops = "4*numel(x)*size(weight,0)",
        .meta = 1,
        .enums = "activation: " ACT_NAMES,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_linear_ops);
OPF_REGISTER_FAMILY(gemm_variants);
OPF_REGISTER_FAMILY(act_variants);

OPF_AOTI_SHIM(matmul, 1, (AtenTensorHandle a, AtenTensorHandle b), a, b);
OPF_AOTI_SHIM(matmul_backward, 2, (AtenTensorHandle grad, AtenTensorHandle a, AtenTensorHandle b, int64_t needs), grad,
              a, b, needs);
OPF_AOTI_SHIM(linear, 2,
              (AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle *bias, const char *activation,
               int32_t save_preact),
              x, weight, bias, activation, save_preact);
OPF_AOTI_SHIM(linear_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle *bias,
               AtenTensorHandle preact, const char *activation, int64_t needs),
              grad, x, weight, bias, preact, activation, needs);
OPF_AOTI_SHIM(linear_backward_, 3,
              (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle *bias,
               AtenTensorHandle preact, const char *activation, int64_t needs),
              grad, x, weight, bias, preact, activation, needs);

/* The answer for a product and the products after it (rest: their answer): 0 where the provider does not
 * claim it and that stands, -1 while it may change (auto mode still measuring the class, or in a re-check
 * that needs the op's calls; before any later 0: a re-check's calls reach the op either way), else rest */
static int answer_of(const linear_gemm_plan *g, int rest) {
    if (!g->settled) return rest == 0 ? 0 : -1;
    return !g->claimed ? 0 : rest;
}

/* opforge_linear_on_torch's answer (1 for 3) */
static int linear_on_torch(int64_t m, int64_t n, int64_t k, int64_t rsx, int64_t csx, int64_t rsw, int64_t csw,
                           int bf16, int bias, int grad, int64_t threads) {
    static const float mark; /* the claims read which pointers are set, never their data */
    const int64_t xs[2] = {m, k}, xst[2] = {rsx, csx}, gs[2] = {m, n}, gst[2] = {n, 1};
    linear_problem p = {.n = n,
                        .k = k,
                        .dt = bf16 ? OPF_BF16 : OPF_F32,
                        .x = {.data = (void *)&mark, .ndim = 2, .sizes = xs, .strides = xst},
                        .weight = &mark,
                        .weight_strides = {rsw, csw},
                        .bias = bias ? &mark : NULL,
                        .bias_stride = 1,
                        .out = (void *)&mark};
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    linear_fwd_plan fwd = linear_fwd_plan_make(gemm, &p, threads);
    linear_fwd_plan_claim(&fwd, &p);
    if (!grad) return answer_of(&fwd.product, 1);
    /* every plan claimed before the answer: the claims count a report of routed calls for their classes */
    p.grad = (linear_view){.data = (void *)&mark, .ndim = 2, .sizes = gs, .strides = gst};
    p.dx = p.dweight = (void *)&mark;
    p.dbias = bias ? (void *)&mark : NULL;
    linear_bwd_plan bwd = linear_bwd_plan_make(gemm, &p, 0, threads);
    linear_bwd_plan_claim(&bwd, &p);
    if (bwd.strategy != LINEAR_BWD_DIRECT) return 0;
    return answer_of(&fwd.product, answer_of(&bwd.in_place.dx, answer_of(&bwd.in_place.dweight, 1)));
}

/* Whether torch's GEMM runs every product of a plain linear (no activation) of these sizes and layouts
 * on this thread count: x (m, k) of strides (rsx, csx), weight (n, k) of (rsw, csw), float32 or
 * bfloat16 (bf16 set), with a bias or not, and, with grad set, its direct backward (a contiguous
 * gradient: dx and dweight). The GEMM provider claims each of them (mode torch, or a class auto mode
 * settled for torch). The op then fuses nothing that F.linear does not, and the Python layer calls
 * F.linear instead: the same GEMM, without the custom op's autograd hop through Python. 1: yes, for
 * the rest of the process (mode torch; until the mode or the ISA changes); 3: yes, and auto mode
 * re-checks the classes: ask again at the re-checks' call numbers (32, 64, ... 2048), with `routed`
 * the calls sent to F.linear since last asked; 0: no, for the rest of the process; -1: not now (a
 * class of a product auto mode is still measuring, or one that waits for a re-check's sample of
 * opforge's kernel: the op's next call takes it). */
OPF_EXPORT int opforge_linear_on_torch(int64_t m, int64_t n, int64_t k, int64_t rsx, int64_t csx, int64_t rsw,
                                       int64_t csw, int bf16, int bias, int grad, int64_t threads, int64_t routed) {
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    opf_provider_routed_calls(routed);
    const int answer = linear_on_torch(m, n, k, rsx, csx, rsw, csw, bf16, bias, grad, threads);
    opf_provider_routed_calls(0);
    return answer == 1 && opf_provider_mode() == OPF_PROVIDER_AUTO ? 3 : answer;
}

/* opforge_matmul_on_torch's answer (1 for 3) */
static int matmul_on_torch(int64_t m, int64_t n, int64_t k, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                           int bf16, int needs, int64_t threads) {
    static const float mark; /* the claims read which pointers are set, never their data */
    const int64_t as[2] = {m, k}, ast[2] = {rsa, csa}, bs[2] = {k, n}, bst[2] = {rsb, csb}, gs[2] = {m, n},
                  gst[2] = {n, 1};
    const linear_view av = {.data = (void *)&mark, .ndim = 2, .sizes = as, .strides = ast},
                      bv = {.data = (void *)&mark, .ndim = 2, .sizes = bs, .strides = bst},
                      gv = {.data = (void *)&mark, .ndim = 2, .sizes = gs, .strides = gst};
    const opf_dtype dt = bf16 ? OPF_BF16 : OPF_F32;
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    matmul_fwd_plan fwd = matmul_fwd_plan_make(gemm, dt, 1, m, n, k, threads);
    matmul_fwd_plan_claim(&fwd, &av, &bv);
    if (!needs) return answer_of(&fwd.product, 1);
    matmul_bwd_plan bwd = matmul_bwd_plan_make(gemm, dt, 1, m, n, k, threads); /* (as linear_on_torch) */
    matmul_bwd_plan_claim(&bwd, &gv, &av, &bv);
    const int db = needs & 2 ? answer_of(&bwd.db, 1) : 1;
    return answer_of(&fwd.product, needs & 1 ? answer_of(&bwd.da, db) : db);
}

/* The same question for a 2-d matmul: a (m, k) of strides (rsa, csa) times b (k, n) of (rsb, csb), and,
 * with needs set (1: da, 2: db, 3: both), the backward's products from a contiguous gradient. Python
 * then calls torch.mm: the same GEMM, without the op's hop through the dispatcher and its autograd.
 * 1, 3, 0 or -1 as above (routed: the calls sent to torch.mm since last asked). */
OPF_EXPORT int opforge_matmul_on_torch(int64_t m, int64_t n, int64_t k, int64_t rsa, int64_t csa, int64_t rsb,
                                       int64_t csb, int bf16, int needs, int64_t threads, int64_t routed) {
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    opf_provider_routed_calls(routed);
    const int answer = matmul_on_torch(m, n, k, rsa, csa, rsb, csb, bf16, needs, threads);
    opf_provider_routed_calls(0);
    return answer == 1 && opf_provider_mode() == OPF_PROVIDER_AUTO ? 3 : answer;
}
