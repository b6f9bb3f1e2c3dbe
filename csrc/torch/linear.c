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
 * float32 runs the blocked GEMM of csrc/kernels/gemm.c. bfloat16 runs it on
 * bfloat16 pairs where the CPU has AVX512-BF16 (the avx512_bf16 ISA; amx: AMX tiles), else on
 * operands converted to float32 while packed, as float16 always does; both
 * accumulate in float32 and round once, in the GEMM's epilogue. float64 runs
 * the oracle (gradcheck). Operands of any strides are read in place; outputs are
 * contiguous. activation: 0 none, 1 relu, 2 gelu, 3 gelu_tanh, 4 silu.
 */
#include <stdlib.h>

#include "../kernels/gemm.h"
#include "opforge/op.h"

static const char MM[] = "opforge::matmul";
static const char LIN[] = "opforge::linear";
static const char LBWD[] = "opforge::linear_backward";

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

/* x (..., K) seen as matrices of `rows` rows: the leading dims merge into one
 * row dim when their strides allow (contiguous, row slices, broadcast), else
 * the op loops over the outer ones. */
typedef struct rows_view {
    int64_t rows, rs, cs;  /* one matrix: rows x K, row stride, column stride */
    int64_t count;         /* matrices */
    int outer;             /* dims before the matrix's row dim */
} rows_view;

static rows_view view_rows(const opf_tensor *x) {
    rows_view v = {.rows = 1, .rs = 0, .cs = x->strides[x->ndim - 1], .count = 1, .outer = 0};
    int64_t last = x->ndim - 2; /* innermost leading dim */
    if (last < 0) return v;
    v.rows = x->sizes[last];
    v.rs = x->strides[last];
    int d = (int)last - 1;
    for (; d >= 0; d--) { /* merge outward while the strides chain */
        if (x->sizes[d] == 1) continue;
        if (v.rows == 1) {
            v.rows = x->sizes[d];
            v.rs = x->strides[d];
            continue;
        }
        if (x->strides[d] != v.rs * v.rows) break;
        v.rows *= x->sizes[d];
    }
    v.outer = d + 1;
    for (int e = 0; e < v.outer; e++) v.count *= x->sizes[e];
    return v;
}

/* element offset of matrix number idx of the view */
static int64_t matrix_offset(const opf_tensor *x, const rows_view *v, int64_t idx) {
    int64_t off = 0;
    for (int d = v->outer - 1; d >= 0; d--) {
        off += (idx % x->sizes[d]) * x->strides[d];
        idx /= x->sizes[d];
    }
    return off;
}

/* element offset of logical row `row` (row-major over x's leading dims) */
static int64_t row_offset(const opf_tensor *x, const rows_view *v, int64_t row) {
    return matrix_offset(x, v, row / v->rows) + (row % v->rows) * v->rs;
}

/* ---- GEMM results of any float type ----------------------------------------------------------- */

/* Rows per chunk when a row chunk of an (rows, n) float32 scratch is made at
 * a time: ~8 MiB, at least 64 rows, at most all of them. */
static int64_t chunk_rows(int64_t rows, int64_t n) {
    int64_t c = n > 0 ? ((int64_t)2 << 20) / n : rows;
    if (c < 64) c = 64;
    return c > rows ? (rows > 0 ? rows : 1) : c;
}

/* How a product with results of type dt is run: float32 results and 16-bit
 * ones whose K fits one GEMM slice are written by the GEMM's epilogue in one
 * call; 16-bit results over several slices keep float32 partial sums in a C
 * of `chunk` rows (~8 MiB) at a time. gemm_floats: the GEMM's workspace, for
 * the full chunk and the last one (it is not monotonic in the rows);
 * ws_floats: that and the C. */
typedef struct out_plan {
    int64_t chunk, gemm_floats, ws_floats;
    int c_scratch;
} out_plan;

/* The GEMM workspace for (rows, n, kd) products over `total` rows run `chunk` rows at a time */
static int64_t chunked_ws(const gemm_kernels *k, int64_t chunk, int64_t total, int64_t n, int64_t kd) {
    int64_t full = gemm_workspace_floats(k, chunk, n, kd), last = total % chunk;
    int64_t tail = last ? gemm_workspace_floats(k, last, n, kd) : 0;
    return full > tail ? full : tail;
}

static out_plan plan_out(const gemm_kernels *k, opf_dtype dt, int64_t m, int64_t n, int64_t kd) {
    out_plan p = {.c_scratch = dt != OPF_F32 && kd > gemm_slice_depth(k, dt, dt)};
    p.chunk = p.c_scratch ? chunk_rows(m, n) : (m > 0 ? m : 1);
    p.gemm_floats = chunked_ws(k, p.chunk, m, n, kd);
    p.ws_floats = p.gemm_floats + (p.c_scratch ? p.chunk * n : 0);
    return p;
}

/* gemm_f32x, failing the op when the workspace was sized for another product (a bug of ours: the
 * error says so instead of writing past the workspace) */
#define RUN_GEMM(op, ...)                                                                              \
    do {                                                                                               \
        if (gemm_f32x(__VA_ARGS__))                                                                    \
            opf_fail(op, "internal error: the GEMM workspace is smaller than its plan needs (please "    \
                         "report it with the shapes)");                                               \
    } while (0)

/* out (m, n; row stride n) = act(A (m, kd) B (kd, n) + bias), its
 * pre-activation to pre when not NULL, both of type dt (A and B of the same
 * type; float32 bias). ws: p->ws_floats floats. */
static void gemm_out(const char *op, const gemm_kernels *k, const out_plan *p, int64_t m, int64_t n, int64_t kd,
                     const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb, int64_t csb, void *out,
                     void *pre, opf_dtype dt, const float *bias, int act, float *ws) {
    float *cbuf = p->c_scratch ? ws + p->gemm_floats : NULL;
    for (int64_t r0 = 0; r0 < m; r0 += p->chunk) {
        int64_t rows = m - r0 < p->chunk ? m - r0 : p->chunk;
        gemm_epilogue ep = {.bias = bias, .bias_kind = bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, .act = act, .rsp = n,
                            .out_dt = dt};
        float *c = cbuf;
        if (dt == OPF_F32) {
            c = (float *)out + r0 * n;
            ep.preact = pre ? (float *)pre + r0 * n : NULL;
        } else {
            ep.out16 = at(out, r0 * n, dt);
            ep.pre16 = pre ? at(pre, r0 * n, dt) : NULL;
        }
        RUN_GEMM(op, k, rows, n, kd, at((void *)a, r0 * rsa, dt), dt, rsa, csa, b, dt, rsb, csb, c, n, &ep, ws,
                 p->gemm_floats);
    }
}

/* ---- matmul ------------------------------------------------------------------------------ */

static void matmul_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(a, stack, 0);
    OPF_ARG_TENSOR(b, stack, 1);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor a = opf_tensor_info(MM, "a", a_h), b = opf_tensor_info(MM, "b", b_h);
    opf_dtype dt = check_operand(MM, "a", &a, "a", &a);
    check_operand(MM, "b", &b, "a", &a);
    opf_check_same_dtype(MM, "b", &b, "a", &a);
    if ((a.ndim != 2 && a.ndim != 3) || a.ndim != b.ndim)
        opf_fail(MM, "arguments 'a' and 'b' must both be 2-d (M,K),(K,N) or 3-d (B,M,K),(B,K,N), got %lld-d and %lld-d",
                 (long long)a.ndim, (long long)b.ndim);
    int nd = (int)a.ndim;
    int64_t batch = nd == 3 ? a.sizes[0] : 1, m = a.sizes[nd - 2], kd = a.sizes[nd - 1], n = b.sizes[nd - 1];
    if (b.sizes[nd - 2] != kd)
        opf_fail(MM, "argument 'b' must have %lld rows (the columns of 'a'), got %lld", (long long)kd,
                 (long long)b.sizes[nd - 2]);
    if (nd == 3 && b.sizes[0] != batch)
        opf_fail(MM, "argument 'b' must have batch size %lld (that of 'a'), got %lld", (long long)batch,
                 (long long)b.sizes[0]);
    int64_t sizes[3] = {batch, m, n};
    OPF_OWNED AtenTensorHandle c_h = opf_empty(MM, nd, sizes + (3 - nd), a.dtype, &a);
    opf_tensor c = opf_tensor_info(MM, "out", c_h);
    if (opf_is_meta(&a)) {
        OPF_RETURN(stack, 0, c_h);
        return;
    }
    int64_t asb = nd == 3 ? a.strides[0] : 0, bsb = nd == 3 ? b.strides[0] : 0;
    const gemm_kernels *k = gemm_kernels_for(opf_isa_current());
    out_plan plan = plan_out(k, dt, m, n, kd);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = dt != OPF_F64 ? opf_workspace(MM, plan.ws_floats, &a, &ws) : NULL;
    for (int64_t i = 0; i < batch; i++) {
        if (dt == OPF_F64) {
            gemm_ref_f64(m, n, kd, (const double *)a.data + i * asb, a.strides[nd - 2], a.strides[nd - 1],
                         (const double *)b.data + i * bsb, b.strides[nd - 2], b.strides[nd - 1],
                         (double *)c.data + i * m * n, n, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            continue;
        }
        gemm_out(MM, k, &plan, m, n, kd, at(a.data, i * asb, dt), a.strides[nd - 2], a.strides[nd - 1],
                 at(b.data, i * bsb, dt), b.strides[nd - 2], b.strides[nd - 1], at(c.data, i * m * n, dt), NULL, dt,
                 NULL, ACT_NONE, ws);
    }
    opf_log_call(MM, t0, 3, (opf_tensor[]){a, b, c});
    OPF_RETURN(stack, 0, c_h);
}

/* matmul_backward(grad (..., M, N), a (..., M, K), b (..., K, N)) -> (da = grad b^T, db = a^T grad), both
 * contiguous: two GEMMs that read grad, a and b in place through their strides */
static void matmul_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char MMB[] = "opforge::matmul_backward";
    OPF_ARG_TENSOR(g, stack, 0);
    OPF_ARG_TENSOR(a, stack, 1);
    OPF_ARG_TENSOR(b, stack, 2);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor g = opf_tensor_info(MMB, "grad", g_h), a = opf_tensor_info(MMB, "a", a_h), b = opf_tensor_info(MMB, "b", b_h);
    opf_dtype dt = check_operand(MMB, "a", &a, "a", &a);
    check_operand(MMB, "b", &b, "a", &a);
    check_operand(MMB, "grad", &g, "a", &a);
    opf_check_same_dtype(MMB, "b", &b, "a", &a);
    opf_check_same_dtype(MMB, "grad", &g, "a", &a);
    if ((a.ndim != 2 && a.ndim != 3) || a.ndim != b.ndim)
        opf_fail(MMB, "arguments 'a' and 'b' must both be 2-d (M,K),(K,N) or 3-d (B,M,K),(B,K,N), got %lld-d and %lld-d",
                 (long long)a.ndim, (long long)b.ndim);
    int nd = (int)a.ndim;
    int64_t batch = nd == 3 ? a.sizes[0] : 1, m = a.sizes[nd - 2], kd = a.sizes[nd - 1], n = b.sizes[nd - 1];
    if (b.sizes[nd - 2] != kd || (nd == 3 && b.sizes[0] != batch))
        opf_fail(MMB, "argument 'b' must be (..., %lld, N) with the batch of 'a', got %lld rows", (long long)kd,
                 (long long)b.sizes[nd - 2]);
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
        const gemm_kernels *k = gemm_kernels_for(opf_isa_current());
        out_plan pa = plan_out(k, dt, m, kd, n), pb = plan_out(k, dt, kd, n, m);
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h =
            opf_workspace(MMB, pa.ws_floats > pb.ws_floats ? pa.ws_floats : pb.ws_floats, &a, &ws);
        for (int64_t i = 0; i < batch; i++) {
            const void *gi = at(g.data, i * gsb, dt), *ai = at(a.data, i * asb, dt), *bi = at(b.data, i * bsb, dt);
            /* da (m, kd) = grad (m, n) . b^T (n, kd) */
            gemm_out(MMB, k, &pa, m, kd, n, gi, grs, gcs, bi, bcs, brs, at(da.data, i * m * kd, dt), NULL, dt, NULL,
                     ACT_NONE, ws);
            /* db (kd, n) = a^T (kd, m) . grad (m, n) */
            gemm_out(MMB, k, &pb, kd, n, m, ai, acs, ars, gi, grs, gcs, at(db.data, i * kd * n, dt), NULL, dt, NULL,
                     ACT_NONE, ws);
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
} linear_args;

static linear_args check_linear(const char *op, AtenTensorHandle x_h, AtenTensorHandle w_h,
                                AtenTensorHandle b_h) {
    linear_args l = {.x = opf_tensor_info(op, "x", x_h), .w = opf_tensor_info(op, "weight", w_h), .has_bias = b_h != NULL};
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
    linear_args l = check_linear(LIN, x_h, w_h, bias_h);
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
    rows_view v = view_rows(&l.x);
    if (l.dt == OPF_F64) {
        for (int64_t i = 0; i < v.count; i++) {
            int64_t xo = matrix_offset(&l.x, &v, i), oo = i * v.rows * l.n;
            gemm_ref_f64(v.rows, l.n, l.k, (const double *)l.x.data + xo, v.rs, v.cs, l.w.data, l.w.strides[1],
                         l.w.strides[0], (double *)out.data + oo, l.n, 0.0, l.has_bias ? l.bias.data : NULL, l.has_bias ? l.bias.strides[0] : 0,
                         l.has_bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, (int)act, save ? (double *)pre.data + oo : NULL, l.n);
        }
    } else {
        const gemm_kernels *k = gemm_kernels_for(opf_isa_current());
        out_plan plan = plan_out(k, l.dt, v.rows, l.n, l.k);
        float *ws = NULL, *bias = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LIN, plan.ws_floats + l.n, &l.x, &ws);
        if (l.has_bias) {
            bias = ws + plan.ws_floats;
            cvt_load_f32(k->cvt, bias, l.bias.data, l.dt, l.n, l.bias.strides[0]);
        }
        for (int64_t i = 0; i < v.count; i++) {
            int64_t oo = i * v.rows * l.n;
            gemm_out(LIN, k, &plan, v.rows, l.n, l.k, at(l.x.data, matrix_offset(&l.x, &v, i), l.dt), v.rs, v.cs, l.w.data,
                     l.w.strides[1], l.w.strides[0], at(out.data, oo, l.dt), save ? at(pre.data, oo, l.dt) : NULL, l.dt,
                     bias, (int)act, ws);
        }
    }
    opf_log_call(LIN, t0, 3, (opf_tensor[]){l.x, l.w, out});
    OPF_RETURN(stack, 0, out_h);
    OPF_RETURN(stack, 1, pre_h);
}

/* The backward when preact may be overwritten (linear_backward_): float32,
 * bfloat16 or float16, an activation, preact and grad single matrices of unit
 * column stride, x's rows one or more matrices (one for 16-bit types). g'
 * replaces preact in one threaded pass that also sums dbias (16-bit types:
 * computed in float32, rounded once, as PyTorch's activation backward rounds
 * it), then
 * dx = g' weight and dweight = g'^T x are one GEMM each over all M rows (no
 * scratch for g', and dweight's sum over M stays in the GEMM's registers
 * instead of being re-read and re-written per row chunk). Returns 0 where it
 * does not apply (the caller takes the chunked path). */
static int backward_in_place(const linear_args *l, const opf_tensor *g, const opf_tensor *pre, int64_t act, int64_t m,
                             const opf_tensor *dx, const opf_tensor *dw, const opf_tensor *db) {
    rows_view gv = view_rows(g), pv = view_rows(pre), xv = view_rows(&l->x);
    const opf_dtype dt = l->dt;
    const int half = dt != OPF_F32;
    if (dt == OPF_F64 || !act || m == 0 || pre->numel == 0 || gv.count != 1 || pv.count != 1 || gv.cs != 1 || pv.cs != 1 ||
        pv.rs != l->n || (half && xv.count != 1))
        return 0;
    const gemm_kernels *k = gemm_kernels_for(opf_isa_current());
    void *gp = pre->data;
    out_plan pdx = plan_out(k, dt, m, l->k, l->n), pdw = plan_out(k, dt, l->n, l->k, xv.rows);
    const int64_t gws = pdx.ws_floats > pdw.ws_floats ? pdx.ws_floats : pdw.ws_floats; /* then a float32 dbias */
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LBWD, gws + l->n, &l->x, &ws);
    float *db32 = !l->has_bias ? NULL : half ? ws + gws : db->data;
    act_grad_rows(k->act, k->cvt, dt, gp, l->n, g->data, gv.rs, gp, l->n, m, l->n, (int)act, db32); /* and dbias */
    /* dx (m, k) = g' (m, n) . weight (n, k) */
    gemm_out(LBWD, k, &pdx, m, l->k, l->n, gp, l->n, 1, l->w.data, l->w.strides[0], l->w.strides[1], dx->data, NULL, dt, NULL,
             ACT_NONE, ws);
    /* dweight (n, k) = sum over x's matrices of g'^T (n, rows) . x (rows, k) */
    if (xv.count == 1) {
        gemm_out(LBWD, k, &pdw, l->n, l->k, xv.rows, gp, 1, l->n, l->x.data, xv.rs, xv.cs, dw->data, NULL, dt, NULL,
                 ACT_NONE, ws);
    } else {
        for (int64_t i = 0; i < xv.count; i++) {
            gemm_epilogue acc = {.beta = i ? 1.0f : 0.0f};
            RUN_GEMM(LBWD, k, l->n, l->k, xv.rows, (const float *)gp + i * xv.rows * l->n, OPF_F32, 1, l->n,
                     (const float *)l->x.data + matrix_offset(&l->x, &xv, i), OPF_F32, xv.rs, xv.cs, dw->data, l->k,
                     &acc, ws, pdw.gemm_floats);
        }
    }
    if (l->has_bias && half) cvt_store_f32(k->cvt, db->data, dt, db32, l->n);
    return 1;
}

/* The backward in row chunks of g', for any dtype, strides and activation.
 * An empty preact with an activation (a forward run with save_preact=False)
 * is recomputed a chunk at a time, x rows . weight^T + bias, into the g'
 * scratch: one more GEMM, and no (M, N) tensor kept between the passes. */
static void backward_chunked(const linear_args *l, const opf_tensor *g, const opf_tensor *pre, int64_t act, int64_t m,
                             const opf_tensor *dx, const opf_tensor *dw, const opf_tensor *db) {
    const int recompute = act && pre->numel == 0;
    rows_view gv = view_rows(g), pv = act && !recompute ? view_rows(pre) : gv, xv = view_rows(&l->x);
    const gemm_kernels *k = gemm_kernels_for(opf_isa_current());
    const int f64 = l->dt == OPF_F64, half = l->dt == OPF_BF16 || l->dt == OPF_F16;
    const int64_t es = f64 ? 8 : 4; /* g' is float64 or float32 */
    /* g' is made CHUNK rows at a time: the scratch is CHUNK x N, not M x N,
     * which keeps the backward's peak memory below eager PyTorch's (it
     * materialises the whole gradient of the pre-activation) */
    int64_t chunk = chunk_rows(xv.rows, l->n);
    int64_t gp_floats = (chunk * l->n * es + 3) / 4;
    /* the GEMMs, for the full chunk and the last one: dx rows (rows, k, n), dweight (n, k, rows), the
     * recomputed preact (rows, n, k) */
    int64_t gws = 0;
    for (int last = 0; !f64 && last < 2; last++) {
        int64_t rows = last ? xv.rows % chunk : chunk;
        if (rows == 0) continue;
        int64_t need[3] = {gemm_workspace_floats(k, rows, l->k, l->n), gemm_workspace_floats(k, l->n, l->k, rows),
                           recompute ? gemm_workspace_floats(k, rows, l->n, l->k) : 0};
        for (int g = 0; g < 3; g++) gws = need[g] > gws ? need[g] : gws;
    }
    /* one float32 row of grad and of preact (converted or gathered), a float32
     * bias for the recomputation, and for 16-bit types float32 dx rows,
     * dweight and dbias */
    int64_t extra = 3 * l->n + (half ? chunk * l->k + l->n * l->k + l->n : 0);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(LBWD, gp_floats + gws + extra, &l->x, &ws);
    char *gp = (char *)ws;
    float *gemm_scratch = ws + gp_floats, *grow = gemm_scratch + gws, *prow = grow + l->n, *bias32 = prow + l->n;
    float *hbuf = bias32 + l->n;
    float *dx32 = half ? hbuf : NULL, *dw32 = half ? hbuf + chunk * l->k : dw->data;
    float *db32 = half ? dw32 + l->n * l->k : db->data;
    if (recompute && l->has_bias && !f64) cvt_load_f32(k->cvt, bias32, l->bias.data, l->dt, l->n, l->bias.strides[0]);
    int first = 1;
    for (int64_t i = 0; i < xv.count; i++) {          /* x's matrices */
        for (int64_t r0 = 0; r0 < xv.rows; r0 += chunk) { /* row chunks of one matrix */
            int64_t rows = xv.rows - r0 < chunk ? xv.rows - r0 : chunk, row0 = i * xv.rows + r0;
            int64_t xo = matrix_offset(&l->x, &xv, i) + r0 * xv.rs;
            if (recompute && f64) /* preact rows (rows, n) = x rows . weight^T + bias, into the g' scratch */
                gemm_ref_f64(rows, l->n, l->k, (const double *)l->x.data + xo, xv.rs, xv.cs, l->w.data, l->w.strides[1],
                             l->w.strides[0], (double *)gp, l->n, 0.0, l->has_bias ? l->bias.data : NULL,
                             l->has_bias ? l->bias.strides[0] : 0,
                             l->has_bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            else if (recompute) {
                gemm_epilogue ep = {.bias = l->has_bias ? bias32 : NULL,
                                    .bias_kind = l->has_bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE};
                RUN_GEMM(LBWD, k, rows, l->n, l->k, at(l->x.data, xo, l->dt), l->dt, xv.rs, xv.cs, l->w.data, l->dt,
                         l->w.strides[1], l->w.strides[0], (float *)gp, l->n, &ep, gemm_scratch, gws);
            }
            for (int64_t r = 0; r < rows; r++) { /* gather g' = grad * act'(preact) */
                int64_t go = row_offset(g, &gv, row0 + r), po = act && !recompute ? row_offset(pre, &pv, row0 + r) : 0;
                if (f64) {
                    const double *gr = (const double *)g->data + go;
                    double *dst = (double *)gp + r * l->n;
                    const double *pr = recompute ? dst : (const double *)pre->data + po;
                    for (int64_t j = 0; j < l->n; j++)
                        dst[j] = act ? gr[j * gv.cs] * act_grad_f64((int)act, pr[recompute ? j : j * pv.cs]) : gr[j * gv.cs];
                    continue;
                }
                float *dst = (float *)gp + r * l->n;
                const float *gr = at(g->data, go, l->dt), *pr = recompute ? dst : act ? at(pre->data, po, l->dt) : NULL;
                if (recompute && half) { /* rounded as the forward stores it: the gradients of a kept preact */
                    k->cvt->from_f32((uint16_t *)prow, dst, l->dt, l->n);
                    k->cvt->to_f32(dst, (const uint16_t *)prow, l->dt, l->n);
                }
                if (half || gv.cs != 1) { /* convert / gather to float32 rows first */
                    cvt_load_f32(k->cvt, act ? grow : dst, at(g->data, go, l->dt), l->dt, l->n, gv.cs);
                    gr = act ? grow : dst;
                }
                if (act && !recompute && (half || pv.cs != 1)) {
                    cvt_load_f32(k->cvt, prow, at(pre->data, po, l->dt), l->dt, l->n, pv.cs);
                    pr = prow;
                }
                if (act) k->act->grad(dst, gr, pr, l->n, (int)act);
                else if (gr != dst) for (int64_t j = 0; j < l->n; j++) dst[j] = gr[j];
            }
            if (f64) {
                gemm_ref_f64(rows, l->k, l->n, (const double *)gp, l->n, 1, l->w.data, l->w.strides[0], l->w.strides[1],
                             (double *)dx->data + row0 * l->k, l->k, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                gemm_ref_f64(l->n, l->k, rows, (const double *)gp, 1, l->n, (const double *)l->x.data + xo, xv.rs, xv.cs,
                             dw->data, l->k, first ? 0.0 : 1.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                for (int64_t j = 0; l->has_bias && j < l->n; j++) {
                    double sum = first ? 0.0 : ((double *)db->data)[j];
                    for (int64_t r = 0; r < rows; r++) sum += ((const double *)gp)[r * l->n + j];
                    ((double *)db->data)[j] = sum;
                }
            } else {
                gemm_epilogue none = {0}, acc = {.beta = first ? 0.0f : 1.0f};
                float *dxr = half ? dx32 : (float *)dx->data + row0 * l->k;
                /* dx rows (rows, k) = g' (rows, n) . weight (n, k) */
                RUN_GEMM(LBWD, k, rows, l->k, l->n, gp, OPF_F32, l->n, 1, l->w.data, l->dt, l->w.strides[0],
                         l->w.strides[1], dxr, l->k, &none, gemm_scratch, gws);
                if (half) cvt_store_f32(k->cvt, at(dx->data, row0 * l->k, l->dt), l->dt, dx32, rows * l->k);
                /* dweight (n, k) += g'^T (n, rows) . x rows (rows, k) */
                RUN_GEMM(LBWD, k, l->n, l->k, rows, gp, OPF_F32, 1, l->n, at(l->x.data, xo, l->dt), l->dt, xv.rs, xv.cs,
                         dw32, l->k, &acc, gemm_scratch, gws);
                if (l->has_bias) colsum_f32(k->cvt, db32, gp, OPF_F32, l->n, rows, l->n, !first);
            }
            first = 0;
        }
    }
    if (first) { /* no rows at all: zero gradients of weight and bias */
        for (int64_t e = 0; e < l->n * l->k; e++) {
            if (f64) ((double *)dw->data)[e] = 0.0;
            else dw32[e] = 0.0f;
        }
        for (int64_t j = 0; l->has_bias && j < l->n; j++) {
            if (f64) ((double *)db->data)[j] = 0.0;
            else db32[j] = 0.0f;
        }
    }
    if (half) {
        cvt_store_f32(k->cvt, dw->data, l->dt, dw32, l->n * l->k);
        if (l->has_bias) cvt_store_f32(k->cvt, db->data, l->dt, db32, l->n);
    }
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
    linear_args l = check_linear(LBWD, x_h, w_h, bias_h);
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
    int64_t m = 1; /* rows: the product of x's leading dims */
    for (int64_t d = 0; d < l.x.ndim - 1; d++) m *= l.x.sizes[d];

    OPF_OWNED AtenTensorHandle dx_h = opf_empty(LBWD, l.x.ndim, l.x.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle dw_h = opf_empty(LBWD, 2, l.w.sizes, l.x.dtype, &l.x);
    OPF_OWNED AtenTensorHandle db_h = opf_empty(LBWD, 1, l.has_bias ? &l.n : &empty, l.x.dtype, &l.x);
    opf_tensor dx = opf_tensor_info(LBWD, "dx", dx_h), dw = opf_tensor_info(LBWD, "dweight", dw_h),
               db = opf_tensor_info(LBWD, "dbias", db_h);
    if (!opf_is_meta(&l.x) && (!in_place || !backward_in_place(&l, &g, &pre, act, m, &dx, &dw, &db)))
        backward_chunked(&l, &g, &pre, act, m, &dx, &dw, &db);
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
