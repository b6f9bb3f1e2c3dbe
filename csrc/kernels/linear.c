/*
 * Fused linear and matmul: row views of x, the plans (chunks, GEMM plans,
 * workspace layouts), the forward, both backward strategies, matmul's batch
 * loops, and the float64 reference paths. See linear.h.
 */
#include "linear.h"

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static void *at(const void *p, int64_t i, opf_dtype dt) { return (char *)p + i * (int64_t)opf_dtype_size(dt); }

/* a GEMM that refuses its workspace ends the kernel with the error (and a claimed product declined, with
 * that one) */
#define TRY(call)                                                                                 \
    do {                                                                                          \
        const int try_rc_ = (call);                                                               \
        if (try_rc_ != 0) return try_rc_ == LINEAR_ERR_DECLINED ? try_rc_ : LINEAR_ERR_WORKSPACE; \
    } while (0)

/* ---- row views ---------------------------------------------------------------------------------- */

/* v (..., cols) seen as matrices of `rows` rows: the leading dims merge into
 * one row dim when their strides allow (contiguous, row slices, broadcast),
 * else the kernel loops over the outer ones. */
typedef struct rows_view {
    int64_t rows, rs, cs; /* one matrix: rows x cols, row stride, column stride */
    int64_t count;        /* matrices */
    int outer;            /* dims before the matrix's row dim */
} rows_view;

static rows_view view_rows(const linear_view *x) {
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
static int64_t matrix_offset(const linear_view *x, const rows_view *v, int64_t idx) {
    int64_t off = 0;
    for (int d = v->outer - 1; d >= 0; d--) {
        off += (idx % x->sizes[d]) * x->strides[d];
        idx /= x->sizes[d];
    }
    return off;
}

/* element offset of logical row `row` (row-major over x's leading dims) */
static int64_t row_offset(const linear_view *x, const rows_view *v, int64_t row) {
    return matrix_offset(x, v, row / v->rows) + (row % v->rows) * v->rs;
}

/* M: the product of x's leading dims */
static int64_t rows_of(const linear_view *x) {
    const rows_view v = view_rows(x);
    return v.rows * v.count;
}

/* ---- GEMM results of any float type ------------------------------------------------------------ */

int64_t linear_chunk_rows(int64_t rows, int64_t n) {
    int64_t c = n > 0 ? ((int64_t)2 << 20) / n : rows;
    if (c < 64) c = 64;
    return c > rows ? (rows > 0 ? rows : 1) : c;
}

static linear_gemm_plan linear_gemm_plan_make(const gemm_kernels *gemm, opf_dtype dt, int64_t m, int64_t n, int64_t k,
                                              int64_t threads) {
    linear_gemm_plan p = {.dt = dt,
                          .m = m,
                          .n = n,
                          .k = k,
                          .c_scratch = dt != OPF_F32 && k > gemm_slice_depth(gemm, dt, dt),
                          .gemm = gemm,
                          .threads = threads};
    p.chunk = p.c_scratch ? linear_chunk_rows(m, n) : (m > 0 ? m : 1);
    p.full = gemm_plan_make(gemm, p.chunk, n, k, dt, dt, threads);
    p.last = gemm_plan_make(gemm, m % p.chunk, n, k, dt, dt, threads);
    p.gemm_floats = max64(gemm_workspace(&p.full), gemm_workspace(&p.last));
    p.floats = p.gemm_floats + (p.c_scratch ? p.chunk * n : 0);
    return p;
}

/* The epilogue of a product writing out (and pre) from their row r0 (row stride n) */
static gemm_epilogue product_epilogue(opf_dtype dt, int64_t n, int64_t r0, void *out, void *pre, const float *bias,
                                      int act) {
    gemm_epilogue ep = {
        .bias = bias, .bias_kind = bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, .act = act, .rsp = n, .out_dt = dt};
    if (dt == OPF_F32) {
        ep.preact = pre ? (float *)pre + r0 * n : NULL;
    } else {
        ep.out16 = at(out, r0 * n, dt);
        ep.pre16 = pre ? at(pre, r0 * n, dt) : NULL;
    }
    return ep;
}

/* out (m, n; row stride n) = act(A (m, k) B (k, n) + bias), its pre-activation
 * to pre when not NULL, both of the plan's type (float32 bias or NULL). ws:
 * plan->floats floats (none for a claimed plan). */
static int linear_gemm(const linear_gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b,
                       int64_t rsb, int64_t csb, void *out, void *pre, const float *bias, int act, float *ws) {
    const int64_t m = plan->m, n = plan->n;
    const opf_dtype dt = plan->dt;
    float *cbuf = plan->c_scratch ? ws + plan->gemm_floats : NULL;
    for (int64_t r0 = 0; r0 < m; r0 += plan->chunk) {
        const gemm_plan *part = m - r0 < plan->chunk ? &plan->last : &plan->full; /* the last chunk is shorter */
        const gemm_epilogue ep = product_epilogue(dt, n, r0, out, pre, bias, act);
        float *c = dt == OPF_F32 ? (float *)out + r0 * n : cbuf;
        if (plan->claimed) { /* the provider's, with no workspace: it declines only after a change of mode */
            if (gemm_run_claimed(part, at(a, r0 * rsa, dt), rsa, csa, b, rsb, csb, c, n, &ep, plan->class_m) != 0)
                return LINEAR_ERR_DECLINED;
            continue;
        }
        TRY(gemm_run(part, at(a, r0 * rsa, dt), rsa, csa, b, rsb, csb, c, n, &ep, ws, plan->gemm_floats));
    }
    return 0;
}

/* any non-NULL pointer: a claim reads which of the epilogue's pointers are set, never their data */
static const float claim_mark;

/* The plan remade as one product with no workspace where the GEMM provider claims its products as the
 * plan runs them (each row chunk: the classes auto mode measured; A and B of these layouts; a bias, an
 * activation and a kept pre-activation as given) */
static void linear_gemm_plan_claim(linear_gemm_plan *p, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb, int bias,
                                   int act, int pre) {
    p->settled = 1;
    if (p->dt == OPF_F64 || p->m <= 0 || p->n <= 0 || p->k <= 0) return;
    void *mark = (void *)&claim_mark;
    const gemm_epilogue ep = product_epilogue(p->dt, 0, 0, mark, pre ? mark : NULL, bias ? &claim_mark : NULL, act);
    const gemm_plan *mine = NULL; /* the first product the provider does not claim: the full chunks', or a
                                     shorter last chunk's */
    if (!gemm_provider_claims(&p->full, rsa, csa, rsb, csb, &ep))
        mine = &p->full;
    else if (p->m % p->chunk && !gemm_provider_claims(&p->last, rsa, csa, rsb, csb, &ep))
        mine = &p->last;
    p->settled = gemm_provider_settled(mine ? mine : &p->full, rsa, csa, rsb, csb, &ep);
    if (mine) return;
    const gemm_plan whole = gemm_plan_make(p->gemm, p->m, p->n, p->k, p->dt, p->dt, p->threads);
    p->claimed = 1;
    p->c_scratch = 0;
    p->class_m = p->chunk;
    p->chunk = p->m;
    p->full = whole;
    p->last = gemm_plan_make(p->gemm, 0, p->n, p->k, p->dt, p->dt, p->threads);
    p->gemm_floats = p->floats = 0;
}

/* ---- forward ----------------------------------------------------------------------------------- */

/* the product's workspace, then a float32 copy of the bias */
static void fwd_layout(linear_fwd_plan *l, const linear_problem *p) {
    l->bias = l->product.floats;
    l->floats = l->bias + (p->bias ? p->n : 0);
}

linear_fwd_plan linear_fwd_plan_make(const gemm_kernels *gemm, const linear_problem *p, int64_t threads) {
    linear_fwd_plan l = {.gemm = gemm};
    if (p->dt == OPF_F64) return l;
    rows_view v = view_rows(&p->x);
    l.product = linear_gemm_plan_make(gemm, p->dt, v.rows, p->n, p->k, threads);
    fwd_layout(&l, p);
    return l;
}

void linear_fwd_plan_claim(linear_fwd_plan *plan, const linear_problem *p) {
    if (p->dt == OPF_F64) return;
    rows_view v = view_rows(&p->x);
    linear_gemm_plan_claim(&plan->product, v.rs, v.cs, p->weight_strides[1], p->weight_strides[0], p->bias != NULL,
                           p->act, p->preact != NULL);
    fwd_layout(plan, p);
}

int64_t linear_fwd_workspace(const linear_fwd_plan *plan) { return plan->floats; }

static void fwd_ref(const linear_problem *p) {
    const int64_t n = p->n, k = p->k;
    rows_view v = view_rows(&p->x);
    for (int64_t i = 0; i < v.count; i++) {
        int64_t xo = matrix_offset(&p->x, &v, i), oo = i * v.rows * n;
        gemm_ref_f64(v.rows, n, k, (const double *)p->x.data + xo, v.rs, v.cs, p->weight, p->weight_strides[1],
                     p->weight_strides[0], (double *)p->out + oo, n, 0.0, p->bias, p->bias ? p->bias_stride : 0,
                     p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, p->act, p->preact ? (double *)p->preact + oo : NULL, n);
    }
}

int linear_fwd(const linear_fwd_plan *plan, const linear_problem *p, float *ws, int64_t ws_floats) {
    if (p->dt == OPF_F64) {
        fwd_ref(p);
        return 0;
    }
    if (ws_floats < plan->floats) return LINEAR_ERR_WORKSPACE;
    const int64_t n = p->n;
    rows_view v = view_rows(&p->x);
    float *bias = NULL;
    if (p->bias) {
        bias = ws + plan->bias;
        convert_load_f32(plan->gemm->cvt, bias, p->bias, p->dt, n, p->bias_stride);
    }
    for (int64_t i = 0; i < v.count; i++) {
        int64_t oo = i * v.rows * n;
        TRY(linear_gemm(&plan->product, at(p->x.data, matrix_offset(&p->x, &v, i), p->dt), v.rs, v.cs, p->weight,
                        p->weight_strides[1], p->weight_strides[0], at(p->out, oo, p->dt),
                        p->preact ? at(p->preact, oo, p->dt) : NULL, bias, p->act, ws));
    }
    return 0;
}

/* ---- backward in place --------------------------------------------------------------------------- */

static linear_bwd_strategy bwd_strategy(const linear_problem *p, int preact_donated) {
    if (p->dt == OPF_F64 || rows_of(&p->x) == 0) return LINEAR_BWD_CHUNKED;
    rows_view gv = view_rows(&p->grad), xv = view_rows(&p->x);
    if (gv.count != 1 || gv.cs != 1 || (p->dt != OPF_F32 && xv.count != 1)) return LINEAR_BWD_CHUNKED;
    if (!p->act) return LINEAR_BWD_DIRECT; /* g' is grad: the GEMMs read it where it is */
    if (!preact_donated || !p->saved_preact.data) return LINEAR_BWD_CHUNKED;
    rows_view pv = view_rows(&p->saved_preact);
    if (pv.count != 1 || pv.cs != 1 || pv.rs != p->n) return LINEAR_BWD_CHUNKED;
    return LINEAR_BWD_IN_PLACE;
}

/* the larger of the GEMMs' workspaces, then a float32 dbias */
static void in_place_layout(linear_bwd_plan *l, const linear_problem *p) {
    rows_view xv = view_rows(&p->x);
    l->in_place.dbias = max64(l->in_place.dx.floats,
                              xv.count == 1 ? l->in_place.dweight.floats : gemm_workspace(&l->in_place.dweight_each));
    l->floats = l->in_place.dbias + p->n;
}

static void in_place_plan(linear_bwd_plan *l, const linear_problem *p) {
    const int64_t n = p->n, k = p->k;
    rows_view xv = view_rows(&p->x);
    l->in_place.dx = linear_gemm_plan_make(l->gemm, p->dt, rows_of(&p->x), k, n, l->threads);
    l->in_place.dweight = linear_gemm_plan_make(l->gemm, p->dt, n, k, xv.rows, l->threads);
    l->in_place.dweight_each = gemm_plan_make(l->gemm, n, k, xv.rows, OPF_F32, OPF_F32, l->threads);
    in_place_layout(l, p);
}

/* The direct backward's two GEMMs (see bwd_in_place: g' is grad, read where it is) */
void linear_bwd_plan_claim(linear_bwd_plan *plan, const linear_problem *p) {
    if (plan->strategy != LINEAR_BWD_DIRECT) return;
    rows_view gv = view_rows(&p->grad), xv = view_rows(&p->x);
    linear_gemm_plan_claim(&plan->in_place.dx, gv.rs, 1, p->weight_strides[0], p->weight_strides[1], 0, ACT_NONE, 0);
    if (xv.count == 1) linear_gemm_plan_claim(&plan->in_place.dweight, 1, gv.rs, xv.rs, xv.cs, 0, ACT_NONE, 0);
    in_place_layout(plan, p);
}

/* In place: g' replaces preact in one threaded pass that also sums dbias
 * (16-bit types: computed in float32, rounded once, as PyTorch's activation
 * backward rounds it). Direct (no activation): g' is grad, read where it is,
 * and dbias its column sums. Then dx and dweight are one GEMM each over all M
 * rows. */
static int bwd_in_place(const linear_bwd_plan *l, const linear_problem *p, float *ws) {
    const gemm_kernels *gemm = l->gemm;
    const int64_t n = p->n, k = p->k;
    const opf_dtype dt = p->dt;
    const int half = dt != OPF_F32, direct = l->strategy == LINEAR_BWD_DIRECT;
    rows_view gv = view_rows(&p->grad), xv = view_rows(&p->x);
    void *gp = direct ? p->grad.data : p->saved_preact.data;
    const int64_t rsg = direct ? gv.rs : n; /* g''s row stride */
    float *db32 = !p->bias ? NULL : half ? ws + l->in_place.dbias : p->dbias;
    if (!direct)
        act_grad_rows(gemm->act, gemm->cvt, dt, gp, n, p->grad.data, gv.rs, gp, n, l->in_place.dx.m, n, p->act, db32,
                      l->threads); /* and dbias */
    else if (db32)
        colsum_f32(gemm->cvt, db32, gp, dt, rsg, l->in_place.dx.m, n, 0);
    /* dx (m, k) = g' (m, n) . weight (n, k) */
    if (p->dx)
        TRY(linear_gemm(&l->in_place.dx, gp, rsg, 1, p->weight, p->weight_strides[0], p->weight_strides[1], p->dx, NULL,
                        NULL, ACT_NONE, ws));
    /* dweight (n, k) = sum over x's matrices of g'^T (n, rows) . x (rows, k) */
    if (p->dweight && xv.count == 1) {
        TRY(linear_gemm(&l->in_place.dweight, gp, 1, rsg, p->x.data, xv.rs, xv.cs, p->dweight, NULL, NULL, ACT_NONE,
                        ws));
    } else if (p->dweight) {
        const gemm_plan *each = &l->in_place.dweight_each;
        for (int64_t i = 0; i < xv.count; i++) {
            gemm_epilogue acc = {.beta = i ? 1.0f : 0.0f};
            TRY(gemm_run(each, (const float *)gp + i * xv.rows * rsg, 1, rsg,
                         (const float *)p->x.data + matrix_offset(&p->x, &xv, i), xv.rs, xv.cs, p->dweight, k, &acc, ws,
                         gemm_workspace(each)));
        }
    }
    if (p->bias && half) convert_store_f32(gemm->cvt, p->dbias, dt, db32, n);
    return 0;
}

/* ---- backward in row chunks ---------------------------------------------------------------------- */

static void chunked_plan(linear_bwd_plan *l, const linear_problem *p) {
    const int64_t n = p->n, k = p->k;
    const int f64 = p->dt == OPF_F64, half = p->dt == OPF_BF16 || p->dt == OPF_F16;
    const int recompute = p->act && !p->saved_preact.data;
    rows_view xv = view_rows(&p->x);
    const int64_t chunk = linear_chunk_rows(xv.rows, n);
    l->chunked.chunk = chunk;
    /* the GEMMs, for the full chunk and the last one: dx rows (rows, k, n),
     * dweight (n, k, rows), the recomputed preact (rows, n, k) */
    for (int last = 0; !f64 && last < 2; last++) {
        const int64_t rows = last ? xv.rows % chunk : chunk;
        l->chunked.dx[last] = gemm_plan_make(l->gemm, rows, k, n, OPF_F32, p->dt, l->threads);
        l->chunked.dweight[last] = gemm_plan_make(l->gemm, n, k, rows, OPF_F32, p->dt, l->threads);
        l->chunked.recompute[last] = gemm_plan_make(l->gemm, rows, n, k, p->dt, p->dt, l->threads);
        if (rows == 0) continue; /* no last chunk: its plans run nothing */
        int64_t need[3] = {gemm_workspace(&l->chunked.dx[last]), gemm_workspace(&l->chunked.dweight[last]),
                           recompute ? gemm_workspace(&l->chunked.recompute[last]) : 0};
        for (int g = 0; g < 3; g++) l->chunked.gemm_floats = max64(l->chunked.gemm_floats, need[g]);
    }
    l->chunked.gemm_ws = (chunk * n * (f64 ? 8 : 4) + 3) / 4;
    l->chunked.grad_row = l->chunked.gemm_ws + l->chunked.gemm_floats;
    l->chunked.preact_row = l->chunked.grad_row + n;
    l->chunked.bias = l->chunked.preact_row + n;
    l->chunked.dx32 = l->chunked.bias + n;
    l->chunked.dweight32 = l->chunked.dx32 + (half ? chunk * k : 0);
    l->chunked.dbias32 = l->chunked.dweight32 + (half ? n * k : 0);
    l->floats = l->chunked.dbias32 + (half ? n : 0);
}

/* g' rows (rows, n) in double from grad and preact (or the recomputed preact
 * already in gp) */
static void gather_grad_f64(const linear_problem *p, const rows_view *gv, const rows_view *pv, int recompute,
                            int64_t row0, int64_t rows, double *gp) {
    const int64_t n = p->n;
    for (int64_t r = 0; r < rows; r++) {
        const double *gr = (const double *)p->grad.data + row_offset(&p->grad, gv, row0 + r);
        double *dst = gp + r * n;
        const double *pr = recompute ? dst
                           : p->act  ? (const double *)p->saved_preact.data + row_offset(&p->saved_preact, pv, row0 + r)
                                     : NULL;
        for (int64_t j = 0; j < n; j++)
            dst[j] = p->act ? gr[j * gv->cs] * act_grad_f64(p->act, pr[recompute ? j : j * pv->cs]) : gr[j * gv->cs];
    }
}

/* the same in float32 for float32, bfloat16 and float16; grow and prow: one
 * float32 row each */
static void gather_grad_f32(const gemm_kernels *gemm, const linear_problem *p, const rows_view *gv, const rows_view *pv,
                            int recompute, int64_t row0, int64_t rows, float *gp, float *grow, float *prow) {
    const int64_t n = p->n;
    const int half = p->dt != OPF_F32, act = p->act;
    for (int64_t r = 0; r < rows; r++) {
        int64_t go = row_offset(&p->grad, gv, row0 + r);
        int64_t po = act && !recompute ? row_offset(&p->saved_preact, pv, row0 + r) : 0;
        float *dst = gp + r * n;
        const float *gr = at(p->grad.data, go, p->dt);
        const float *pr = recompute ? dst : act ? at(p->saved_preact.data, po, p->dt) : NULL;
        if (recompute && half) { /* rounded as the forward stores it: the gradients of a kept preact */
            gemm->cvt->from_f32((uint16_t *)prow, dst, p->dt, n);
            gemm->cvt->to_f32(dst, (const uint16_t *)prow, p->dt, n);
        }
        if (half || gv->cs != 1) { /* convert / gather to float32 rows first */
            convert_load_f32(gemm->cvt, act ? grow : dst, at(p->grad.data, go, p->dt), p->dt, n, gv->cs);
            gr = act ? grow : dst;
        }
        if (act && !recompute && (half || pv->cs != 1)) {
            convert_load_f32(gemm->cvt, prow, at(p->saved_preact.data, po, p->dt), p->dt, n, pv->cs);
            pr = prow;
        }
        if (act)
            gemm->act->grad(dst, gr, pr, n, act);
        else if (gr != dst)
            for (int64_t j = 0; j < n; j++) dst[j] = gr[j];
    }
}

static int bwd_chunked(const linear_bwd_plan *plan, const linear_problem *p, float *ws) {
    const gemm_kernels *gemm = plan->gemm;
    const int64_t n = p->n, k = p->k, chunk = plan->chunked.chunk, gemm_floats = plan->chunked.gemm_floats;
    const opf_dtype dt = p->dt;
    const int recompute = p->act && !p->saved_preact.data;
    const int f64 = dt == OPF_F64, half = dt == OPF_BF16 || dt == OPF_F16;
    rows_view gv = view_rows(&p->grad), pv = p->act && !recompute ? view_rows(&p->saved_preact) : gv;
    rows_view xv = view_rows(&p->x);
    void *gp = ws;
    float *gemm_ws = ws + plan->chunked.gemm_ws, *bias32 = ws + plan->chunked.bias;
    float *dx32 = half ? ws + plan->chunked.dx32 : NULL, *dw32 = half ? ws + plan->chunked.dweight32 : p->dweight;
    float *db32 = half ? ws + plan->chunked.dbias32 : p->dbias;
    if (recompute && p->bias && !f64) convert_load_f32(gemm->cvt, bias32, p->bias, dt, n, p->bias_stride);
    int first = 1;
    for (int64_t i = 0; i < xv.count; i++) {              /* x's matrices */
        for (int64_t r0 = 0; r0 < xv.rows; r0 += chunk) { /* row chunks of one matrix */
            const int64_t rows = xv.rows - r0 < chunk ? xv.rows - r0 : chunk, row0 = i * xv.rows + r0;
            const int tail = rows < chunk; /* the last chunk's plans */
            int64_t xo = matrix_offset(&p->x, &xv, i) + r0 * xv.rs;
            if (recompute && f64) /* preact rows (rows, n) = x rows . weight^T + bias, into the g' scratch */
                gemm_ref_f64(rows, n, k, (const double *)p->x.data + xo, xv.rs, xv.cs, p->weight, p->weight_strides[1],
                             p->weight_strides[0], gp, n, 0.0, p->bias, p->bias ? p->bias_stride : 0,
                             p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            else if (recompute) {
                gemm_epilogue ep = {.bias = p->bias ? bias32 : NULL,
                                    .bias_kind = p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE};
                TRY(gemm_run(&plan->chunked.recompute[tail], at(p->x.data, xo, dt), xv.rs, xv.cs, p->weight,
                             p->weight_strides[1], p->weight_strides[0], gp, n, &ep, gemm_ws, gemm_floats));
            }
            if (f64) {
                gather_grad_f64(p, &gv, &pv, recompute, row0, rows, gp);
                if (p->dx)
                    gemm_ref_f64(rows, k, n, gp, n, 1, p->weight, p->weight_strides[0], p->weight_strides[1],
                                 (double *)p->dx + row0 * k, k, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                if (p->dweight)
                    gemm_ref_f64(n, k, rows, gp, 1, n, (const double *)p->x.data + xo, xv.rs, xv.cs, p->dweight, k,
                                 first ? 0.0 : 1.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                for (int64_t j = 0; p->bias && j < n; j++) {
                    double sum = first ? 0.0 : ((double *)p->dbias)[j];
                    for (int64_t r = 0; r < rows; r++) sum += ((const double *)gp)[r * n + j];
                    ((double *)p->dbias)[j] = sum;
                }
            } else {
                gather_grad_f32(gemm, p, &gv, &pv, recompute, row0, rows, gp, ws + plan->chunked.grad_row,
                                ws + plan->chunked.preact_row);
                gemm_epilogue none = {0}, acc = {.beta = first ? 0.0f : 1.0f};
                /* dx rows (rows, k) = g' (rows, n) . weight (n, k) */
                if (p->dx) {
                    float *dxr = half ? dx32 : (float *)p->dx + row0 * k;
                    TRY(gemm_run(&plan->chunked.dx[tail], gp, n, 1, p->weight, p->weight_strides[0],
                                 p->weight_strides[1], dxr, k, &none, gemm_ws, gemm_floats));
                    if (half) convert_store_f32(gemm->cvt, at(p->dx, row0 * k, dt), dt, dx32, rows * k);
                }
                /* dweight (n, k) += g'^T (n, rows) . x rows (rows, k) */
                if (p->dweight)
                    TRY(gemm_run(&plan->chunked.dweight[tail], gp, 1, n, at(p->x.data, xo, dt), xv.rs, xv.cs, dw32, k,
                                 &acc, gemm_ws, gemm_floats));
                if (p->bias) colsum_f32(gemm->cvt, db32, gp, OPF_F32, n, rows, n, !first);
            }
            first = 0;
        }
    }
    if (first) { /* no rows at all: zero gradients of weight and bias */
        for (int64_t e = 0; p->dweight && e < n * k; e++) {
            if (f64)
                ((double *)p->dweight)[e] = 0.0;
            else
                dw32[e] = 0.0f;
        }
        for (int64_t j = 0; p->bias && j < n; j++) {
            if (f64)
                ((double *)p->dbias)[j] = 0.0;
            else
                db32[j] = 0.0f;
        }
    }
    if (half) {
        if (p->dweight) convert_store_f32(gemm->cvt, p->dweight, dt, dw32, n * k);
        if (p->bias) convert_store_f32(gemm->cvt, p->dbias, dt, db32, n);
    }
    return 0;
}

/* ---- backward ---------------------------------------------------------------------------------- */

linear_bwd_plan linear_bwd_plan_make(const gemm_kernels *gemm, const linear_problem *p, int preact_donated,
                                     int64_t threads) {
    linear_bwd_plan l = {.gemm = gemm, .strategy = bwd_strategy(p, preact_donated), .threads = threads};
    if (l.strategy != LINEAR_BWD_CHUNKED)
        in_place_plan(&l, p);
    else
        chunked_plan(&l, p);
    return l;
}

int64_t linear_bwd_workspace(const linear_bwd_plan *plan) { return plan->floats; }

int linear_bwd(const linear_bwd_plan *plan, const linear_problem *p, float *ws, int64_t ws_floats) {
    if (ws_floats < plan->floats) return LINEAR_ERR_WORKSPACE;
    return plan->strategy == LINEAR_BWD_CHUNKED ? bwd_chunked(plan, p, ws) : bwd_in_place(plan, p, ws);
}

/* ---- matmul ------------------------------------------------------------------------------------ */

/* element strides of one matrix of a 2-d or 3-d view: batch (0 for 2-d), row, column */
typedef struct batch_strides {
    int64_t batch, row, col;
} batch_strides;

static batch_strides strides_of(const linear_view *v) {
    const int64_t nd = v->ndim;
    return (batch_strides){.batch = nd == 3 ? v->strides[0] : 0, .row = v->strides[nd - 2], .col = v->strides[nd - 1]};
}

matmul_fwd_plan matmul_fwd_plan_make(const gemm_kernels *gemm, opf_dtype dt, int64_t batch, int64_t m, int64_t n,
                                     int64_t k, int64_t threads) {
    matmul_fwd_plan l = {.dt = dt, .batch = batch, .m = m, .n = n, .k = k};
    if (dt == OPF_F64) return l;
    l.product = linear_gemm_plan_make(gemm, dt, m, n, k, threads);
    l.floats = l.product.floats;
    return l;
}

void matmul_fwd_plan_claim(matmul_fwd_plan *plan, const linear_view *a, const linear_view *b) {
    if (plan->dt == OPF_F64) return;
    const batch_strides as = strides_of(a), bs = strides_of(b);
    linear_gemm_plan_claim(&plan->product, as.row, as.col, bs.row, bs.col, 0, ACT_NONE, 0);
    plan->floats = plan->product.floats;
}

int64_t matmul_fwd_workspace(const matmul_fwd_plan *plan) { return plan->floats; }

int matmul_fwd(const matmul_fwd_plan *plan, void *c, const linear_view *a, const linear_view *b, float *ws,
               int64_t ws_floats) {
    if (ws_floats < plan->floats) return LINEAR_ERR_WORKSPACE;
    const int64_t m = plan->m, n = plan->n, k = plan->k;
    const opf_dtype dt = plan->dt;
    const batch_strides as = strides_of(a), bs = strides_of(b);
    for (int64_t i = 0; i < plan->batch; i++) {
        const void *ai = at(a->data, i * as.batch, dt), *bi = at(b->data, i * bs.batch, dt);
        void *ci = at(c, i * m * n, dt);
        if (dt == OPF_F64)
            gemm_ref_f64(m, n, k, ai, as.row, as.col, bi, bs.row, bs.col, ci, n, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE,
                         NULL, 0);
        else
            TRY(linear_gemm(&plan->product, ai, as.row, as.col, bi, bs.row, bs.col, ci, NULL, NULL, ACT_NONE, ws));
    }
    return 0;
}

matmul_bwd_plan matmul_bwd_plan_make(const gemm_kernels *gemm, opf_dtype dt, int64_t batch, int64_t m, int64_t n,
                                     int64_t k, int64_t threads) {
    matmul_bwd_plan l = {.dt = dt, .batch = batch, .m = m, .n = n, .k = k};
    if (dt == OPF_F64) return l;
    l.da = linear_gemm_plan_make(gemm, dt, m, k, n, threads);
    l.db = linear_gemm_plan_make(gemm, dt, k, n, m, threads);
    l.floats = max64(l.da.floats, l.db.floats);
    return l;
}

void matmul_bwd_plan_claim(matmul_bwd_plan *plan, const linear_view *grad, const linear_view *a, const linear_view *b) {
    if (plan->dt == OPF_F64) return;
    const batch_strides gs = strides_of(grad), as = strides_of(a), bs = strides_of(b);
    linear_gemm_plan_claim(&plan->da, gs.row, gs.col, bs.col, bs.row, 0, ACT_NONE, 0); /* grad . b^T */
    linear_gemm_plan_claim(&plan->db, as.col, as.row, gs.row, gs.col, 0, ACT_NONE, 0); /* a^T . grad */
    plan->floats = max64(plan->da.floats, plan->db.floats);
}

int64_t matmul_bwd_workspace(const matmul_bwd_plan *plan) { return plan->floats; }

int matmul_bwd(const matmul_bwd_plan *plan, void *da, void *db, const linear_view *grad, const linear_view *a,
               const linear_view *b, float *ws, int64_t ws_floats) {
    if (ws_floats < plan->floats) return LINEAR_ERR_WORKSPACE;
    const int64_t m = plan->m, n = plan->n, k = plan->k;
    const opf_dtype dt = plan->dt;
    const batch_strides gs = strides_of(grad), as = strides_of(a), bs = strides_of(b);
    for (int64_t i = 0; i < plan->batch; i++) {
        const void *gi = at(grad->data, i * gs.batch, dt), *ai = at(a->data, i * as.batch, dt);
        const void *bi = at(b->data, i * bs.batch, dt);
        void *dai = da ? at(da, i * m * k, dt) : NULL, *dbi = db ? at(db, i * k * n, dt) : NULL;
        if (dt == OPF_F64) {
            if (dai)
                gemm_ref_f64(m, k, n, gi, gs.row, gs.col, bi, bs.col, bs.row, dai, k, 0.0, NULL, 0, GEMM_BIAS_NONE,
                             ACT_NONE, NULL, 0);
            if (dbi)
                gemm_ref_f64(k, n, m, ai, as.col, as.row, gi, gs.row, gs.col, dbi, n, 0.0, NULL, 0, GEMM_BIAS_NONE,
                             ACT_NONE, NULL, 0);
            continue;
        }
        /* da (m, k) = grad (m, n) . b^T (n, k) */
        if (dai) TRY(linear_gemm(&plan->da, gi, gs.row, gs.col, bi, bs.col, bs.row, dai, NULL, NULL, ACT_NONE, ws));
        /* db (k, n) = a^T (k, m) . grad (m, n) */
        if (dbi) TRY(linear_gemm(&plan->db, ai, as.col, as.row, gi, gs.row, gs.col, dbi, NULL, NULL, ACT_NONE, ws));
    }
    return 0;
}
