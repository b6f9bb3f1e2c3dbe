/*
 * Fused linear: row views of x, chunk plans, workspace layouts, the forward
 * and both backward strategies, and the float64 reference path. See linear.h.
 */
#include "linear.h"

static void *at(const void *p, int64_t i, opf_dtype dt) { return (char *)p + i * (int64_t)opf_dtype_size(dt); }

/* a GEMM that refuses its workspace ends the kernel with the error */
#define TRY(call)                                     \
    do {                                              \
        if ((call) != 0) return LINEAR_ERR_WORKSPACE; \
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

/* ---- GEMM results of any float type ------------------------------------------------------------ */

int64_t linear_chunk_rows(int64_t rows, int64_t n) {
    int64_t c = n > 0 ? ((int64_t)2 << 20) / n : rows;
    if (c < 64) c = 64;
    return c > rows ? (rows > 0 ? rows : 1) : c;
}

/* The GEMM workspace for (rows, n, kdim) products over `total` rows run `chunk` rows at a time */
static int64_t chunked_ws(const gemm_kernels *gemm, int64_t chunk, int64_t total, int64_t n, int64_t kdim) {
    int64_t full = gemm_workspace_floats(gemm, chunk, n, kdim), last = total % chunk;
    int64_t tail = last ? gemm_workspace_floats(gemm, last, n, kdim) : 0;
    return full > tail ? full : tail;
}

linear_gemm_plan linear_gemm_plan_for(const gemm_kernels *gemm, opf_dtype dt, int64_t m, int64_t n, int64_t kdim) {
    linear_gemm_plan p = {.c_scratch = dt != OPF_F32 && kdim > gemm_slice_depth(gemm, dt, dt)};
    p.chunk = p.c_scratch ? linear_chunk_rows(m, n) : (m > 0 ? m : 1);
    p.gemm_floats = chunked_ws(gemm, p.chunk, m, n, kdim);
    p.ws_floats = p.gemm_floats + (p.c_scratch ? p.chunk * n : 0);
    return p;
}

int linear_gemm(const gemm_kernels *gemm, const linear_gemm_plan *plan, int64_t m, int64_t n, int64_t kdim,
                const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb, int64_t csb, void *out, void *pre,
                opf_dtype dt, const float *bias, int act, float *ws) {
    float *cbuf = plan->c_scratch ? ws + plan->gemm_floats : NULL;
    for (int64_t r0 = 0; r0 < m; r0 += plan->chunk) {
        int64_t rows = m - r0 < plan->chunk ? m - r0 : plan->chunk;
        gemm_epilogue ep = {
            .bias = bias, .bias_kind = bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, .act = act, .rsp = n, .out_dt = dt};
        float *c = cbuf;
        if (dt == OPF_F32) {
            c = (float *)out + r0 * n;
            ep.preact = pre ? (float *)pre + r0 * n : NULL;
        } else {
            ep.out16 = at(out, r0 * n, dt);
            ep.pre16 = pre ? at(pre, r0 * n, dt) : NULL;
        }
        TRY(gemm_f32x(gemm, rows, n, kdim, at(a, r0 * rsa, dt), dt, rsa, csa, b, dt, rsb, csb, c, n, &ep, ws,
                      plan->gemm_floats));
    }
    return 0;
}

/* ---- forward ----------------------------------------------------------------------------------- */

/* the GEMM's plan, then a float32 copy of the bias */
typedef struct fwd_layout {
    linear_gemm_plan plan;
    int64_t bias, floats;
} fwd_layout;

static fwd_layout fwd_layout_for(const gemm_kernels *gemm, const linear_problem *p) {
    rows_view v = view_rows(&p->x);
    fwd_layout l = {.plan = linear_gemm_plan_for(gemm, p->dt, v.rows, p->out_features, p->in_features)};
    l.bias = l.plan.ws_floats;
    l.floats = l.bias + p->out_features;
    return l;
}

int64_t linear_fwd_workspace(const gemm_kernels *gemm, const linear_problem *p) {
    return p->dt == OPF_F64 ? 0 : fwd_layout_for(gemm, p).floats;
}

static void fwd_ref(const linear_problem *p) {
    const int64_t n = p->out_features, kdim = p->in_features;
    rows_view v = view_rows(&p->x);
    for (int64_t i = 0; i < v.count; i++) {
        int64_t xo = matrix_offset(&p->x, &v, i), oo = i * v.rows * n;
        gemm_ref_f64(v.rows, n, kdim, (const double *)p->x.data + xo, v.rs, v.cs, p->weight, p->weight_strides[1],
                     p->weight_strides[0], (double *)p->out + oo, n, 0.0, p->bias, p->bias ? p->bias_stride : 0,
                     p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, p->act, p->preact ? (double *)p->preact + oo : NULL, n);
    }
}

int linear_fwd(const gemm_kernels *gemm, const linear_problem *p, float *ws, int64_t ws_floats) {
    if (p->dt == OPF_F64) {
        fwd_ref(p);
        return 0;
    }
    const int64_t n = p->out_features, kdim = p->in_features;
    fwd_layout l = fwd_layout_for(gemm, p);
    if (ws_floats < l.floats) return LINEAR_ERR_WORKSPACE;
    rows_view v = view_rows(&p->x);
    float *bias = NULL;
    if (p->bias) {
        bias = ws + l.bias;
        cvt_load_f32(gemm->cvt, bias, p->bias, p->dt, n, p->bias_stride);
    }
    for (int64_t i = 0; i < v.count; i++) {
        int64_t oo = i * v.rows * n;
        TRY(linear_gemm(gemm, &l.plan, v.rows, n, kdim, at(p->x.data, matrix_offset(&p->x, &v, i), p->dt), v.rs, v.cs,
                        p->weight, p->weight_strides[1], p->weight_strides[0], at(p->out, oo, p->dt),
                        p->preact ? at(p->preact, oo, p->dt) : NULL, p->dt, bias, p->act, ws));
    }
    return 0;
}

/* ---- backward in place --------------------------------------------------------------------------- */

linear_bwd_strategy linear_bwd_plan(const linear_problem *p, int preact_donated) {
    if (!preact_donated || p->dt == OPF_F64 || !p->act || p->m == 0 || !p->saved_preact.data) return LINEAR_BWD_CHUNKED;
    rows_view gv = view_rows(&p->grad), pv = view_rows(&p->saved_preact), xv = view_rows(&p->x);
    if (gv.count != 1 || pv.count != 1 || gv.cs != 1 || pv.cs != 1 || pv.rs != p->out_features ||
        (p->dt != OPF_F32 && xv.count != 1))
        return LINEAR_BWD_CHUNKED;
    return LINEAR_BWD_IN_PLACE;
}

/* the larger of the two GEMMs' workspaces, then a float32 dbias */
typedef struct in_place_layout {
    linear_gemm_plan dx, dweight;
    int64_t dbias, floats;
} in_place_layout;

static in_place_layout in_place_layout_for(const gemm_kernels *gemm, const linear_problem *p) {
    const int64_t n = p->out_features, kdim = p->in_features;
    rows_view xv = view_rows(&p->x);
    in_place_layout l = {.dx = linear_gemm_plan_for(gemm, p->dt, p->m, kdim, n),
                         .dweight = linear_gemm_plan_for(gemm, p->dt, n, kdim, xv.rows)};
    l.dbias = l.dx.ws_floats > l.dweight.ws_floats ? l.dx.ws_floats : l.dweight.ws_floats;
    l.floats = l.dbias + n;
    return l;
}

/* g' replaces preact in one threaded pass that also sums dbias (16-bit types:
 * computed in float32, rounded once, as PyTorch's activation backward rounds
 * it), then dx and dweight are one GEMM each over all M rows. */
static int bwd_in_place(const gemm_kernels *gemm, const linear_problem *p, float *ws, int64_t ws_floats) {
    const int64_t n = p->out_features, kdim = p->in_features;
    const opf_dtype dt = p->dt;
    const int half = dt != OPF_F32;
    in_place_layout l = in_place_layout_for(gemm, p);
    if (ws_floats < l.floats) return LINEAR_ERR_WORKSPACE;
    rows_view gv = view_rows(&p->grad), xv = view_rows(&p->x);
    void *gp = p->saved_preact.data;
    float *db32 = !p->bias ? NULL : half ? ws + l.dbias : p->dbias;
    act_grad_rows(gemm->act, gemm->cvt, dt, gp, n, p->grad.data, gv.rs, gp, n, p->m, n, p->act, db32); /* and dbias */
    /* dx (m, k) = g' (m, n) . weight (n, k) */
    TRY(linear_gemm(gemm, &l.dx, p->m, kdim, n, gp, n, 1, p->weight, p->weight_strides[0], p->weight_strides[1], p->dx,
                    NULL, dt, NULL, ACT_NONE, ws));
    /* dweight (n, k) = sum over x's matrices of g'^T (n, rows) . x (rows, k) */
    if (xv.count == 1) {
        TRY(linear_gemm(gemm, &l.dweight, n, kdim, xv.rows, gp, 1, n, p->x.data, xv.rs, xv.cs, p->dweight, NULL, dt,
                        NULL, ACT_NONE, ws));
    } else {
        for (int64_t i = 0; i < xv.count; i++) {
            gemm_epilogue acc = {.beta = i ? 1.0f : 0.0f};
            TRY(gemm_f32x(gemm, n, kdim, xv.rows, (const float *)gp + i * xv.rows * n, OPF_F32, 1, n,
                          (const float *)p->x.data + matrix_offset(&p->x, &xv, i), OPF_F32, xv.rs, xv.cs, p->dweight,
                          kdim, &acc, ws, l.dweight.gemm_floats));
        }
    }
    if (p->bias && half) cvt_store_f32(gemm->cvt, p->dbias, dt, db32, n);
    return 0;
}

/* ---- backward in row chunks ---------------------------------------------------------------------- */

/* g' (chunk x n, float32 or float64), the GEMMs' workspace, one float32 row of
 * grad and of preact (converted or gathered), a float32 bias for the
 * recomputation, and for 16-bit types float32 dx rows, dweight and dbias */
typedef struct chunked_layout {
    int64_t chunk, gemm_floats;
    int64_t gemm_ws, grad_row, preact_row, bias, dx, dweight, dbias, floats;
} chunked_layout;

static chunked_layout chunked_layout_for(const gemm_kernels *gemm, const linear_problem *p) {
    const int64_t n = p->out_features, kdim = p->in_features;
    const int f64 = p->dt == OPF_F64, half = p->dt == OPF_BF16 || p->dt == OPF_F16;
    const int recompute = p->act && !p->saved_preact.data;
    rows_view xv = view_rows(&p->x);
    chunked_layout l = {.chunk = linear_chunk_rows(xv.rows, n)};
    /* the GEMMs, for the full chunk and the last one: dx rows (rows, k, n),
     * dweight (n, k, rows), the recomputed preact (rows, n, k) */
    for (int last = 0; !f64 && last < 2; last++) {
        int64_t rows = last ? xv.rows % l.chunk : l.chunk;
        if (rows == 0) continue;
        int64_t need[3] = {gemm_workspace_floats(gemm, rows, kdim, n), gemm_workspace_floats(gemm, n, kdim, rows),
                           recompute ? gemm_workspace_floats(gemm, rows, n, kdim) : 0};
        for (int g = 0; g < 3; g++) l.gemm_floats = need[g] > l.gemm_floats ? need[g] : l.gemm_floats;
    }
    l.gemm_ws = (l.chunk * n * (f64 ? 8 : 4) + 3) / 4;
    l.grad_row = l.gemm_ws + l.gemm_floats;
    l.preact_row = l.grad_row + n;
    l.bias = l.preact_row + n;
    l.dx = l.bias + n;
    l.dweight = l.dx + (half ? l.chunk * kdim : 0);
    l.dbias = l.dweight + (half ? n * kdim : 0);
    l.floats = l.dbias + (half ? n : 0);
    return l;
}

/* g' rows (rows, n) in double from grad and preact (or the recomputed preact
 * already in gp) */
static void gather_grad_f64(const linear_problem *p, const rows_view *gv, const rows_view *pv, int recompute,
                            int64_t row0, int64_t rows, double *gp) {
    const int64_t n = p->out_features;
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
    const int64_t n = p->out_features;
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
            cvt_load_f32(gemm->cvt, act ? grow : dst, at(p->grad.data, go, p->dt), p->dt, n, gv->cs);
            gr = act ? grow : dst;
        }
        if (act && !recompute && (half || pv->cs != 1)) {
            cvt_load_f32(gemm->cvt, prow, at(p->saved_preact.data, po, p->dt), p->dt, n, pv->cs);
            pr = prow;
        }
        if (act)
            gemm->act->grad(dst, gr, pr, n, act);
        else if (gr != dst)
            for (int64_t j = 0; j < n; j++) dst[j] = gr[j];
    }
}

static int bwd_chunked(const gemm_kernels *gemm, const linear_problem *p, float *ws, int64_t ws_floats) {
    const int64_t n = p->out_features, kdim = p->in_features;
    const opf_dtype dt = p->dt;
    const int recompute = p->act && !p->saved_preact.data;
    const int f64 = dt == OPF_F64, half = dt == OPF_BF16 || dt == OPF_F16;
    chunked_layout l = chunked_layout_for(gemm, p);
    if (ws_floats < l.floats) return LINEAR_ERR_WORKSPACE;
    rows_view gv = view_rows(&p->grad), pv = p->act && !recompute ? view_rows(&p->saved_preact) : gv;
    rows_view xv = view_rows(&p->x);
    void *gp = ws;
    float *gemm_ws = ws + l.gemm_ws, *bias32 = ws + l.bias;
    float *dx32 = half ? ws + l.dx : NULL, *dw32 = half ? ws + l.dweight : p->dweight;
    float *db32 = half ? ws + l.dbias : p->dbias;
    if (recompute && p->bias && !f64) cvt_load_f32(gemm->cvt, bias32, p->bias, dt, n, p->bias_stride);
    int first = 1;
    for (int64_t i = 0; i < xv.count; i++) {                /* x's matrices */
        for (int64_t r0 = 0; r0 < xv.rows; r0 += l.chunk) { /* row chunks of one matrix */
            int64_t rows = xv.rows - r0 < l.chunk ? xv.rows - r0 : l.chunk, row0 = i * xv.rows + r0;
            int64_t xo = matrix_offset(&p->x, &xv, i) + r0 * xv.rs;
            if (recompute && f64) /* preact rows (rows, n) = x rows . weight^T + bias, into the g' scratch */
                gemm_ref_f64(rows, n, kdim, (const double *)p->x.data + xo, xv.rs, xv.cs, p->weight,
                             p->weight_strides[1], p->weight_strides[0], gp, n, 0.0, p->bias,
                             p->bias ? p->bias_stride : 0, p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
            else if (recompute) {
                gemm_epilogue ep = {.bias = p->bias ? bias32 : NULL,
                                    .bias_kind = p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE};
                TRY(gemm_f32x(gemm, rows, n, kdim, at(p->x.data, xo, dt), dt, xv.rs, xv.cs, p->weight, dt,
                              p->weight_strides[1], p->weight_strides[0], gp, n, &ep, gemm_ws, l.gemm_floats));
            }
            if (f64) {
                gather_grad_f64(p, &gv, &pv, recompute, row0, rows, gp);
                gemm_ref_f64(rows, kdim, n, gp, n, 1, p->weight, p->weight_strides[0], p->weight_strides[1],
                             (double *)p->dx + row0 * kdim, kdim, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                gemm_ref_f64(n, kdim, rows, gp, 1, n, (const double *)p->x.data + xo, xv.rs, xv.cs, p->dweight, kdim,
                             first ? 0.0 : 1.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
                for (int64_t j = 0; p->bias && j < n; j++) {
                    double sum = first ? 0.0 : ((double *)p->dbias)[j];
                    for (int64_t r = 0; r < rows; r++) sum += ((const double *)gp)[r * n + j];
                    ((double *)p->dbias)[j] = sum;
                }
            } else {
                gather_grad_f32(gemm, p, &gv, &pv, recompute, row0, rows, gp, ws + l.grad_row, ws + l.preact_row);
                gemm_epilogue none = {0}, acc = {.beta = first ? 0.0f : 1.0f};
                float *dxr = half ? dx32 : (float *)p->dx + row0 * kdim;
                /* dx rows (rows, k) = g' (rows, n) . weight (n, k) */
                TRY(gemm_f32x(gemm, rows, kdim, n, gp, OPF_F32, n, 1, p->weight, dt, p->weight_strides[0],
                              p->weight_strides[1], dxr, kdim, &none, gemm_ws, l.gemm_floats));
                if (half) cvt_store_f32(gemm->cvt, at(p->dx, row0 * kdim, dt), dt, dx32, rows * kdim);
                /* dweight (n, k) += g'^T (n, rows) . x rows (rows, k) */
                TRY(gemm_f32x(gemm, n, kdim, rows, gp, OPF_F32, 1, n, at(p->x.data, xo, dt), dt, xv.rs, xv.cs, dw32,
                              kdim, &acc, gemm_ws, l.gemm_floats));
                if (p->bias) colsum_f32(gemm->cvt, db32, gp, OPF_F32, n, rows, n, !first);
            }
            first = 0;
        }
    }
    if (first) { /* no rows at all: zero gradients of weight and bias */
        for (int64_t e = 0; e < n * kdim; e++) {
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
        cvt_store_f32(gemm->cvt, p->dweight, dt, dw32, n * kdim);
        if (p->bias) cvt_store_f32(gemm->cvt, p->dbias, dt, db32, n);
    }
    return 0;
}

/* ---- backward ---------------------------------------------------------------------------------- */

int64_t linear_bwd_workspace(const gemm_kernels *gemm, const linear_problem *p, linear_bwd_strategy strategy) {
    return strategy == LINEAR_BWD_IN_PLACE ? in_place_layout_for(gemm, p).floats : chunked_layout_for(gemm, p).floats;
}

int linear_bwd(const gemm_kernels *gemm, const linear_problem *p, linear_bwd_strategy strategy, float *ws,
               int64_t ws_floats) {
    return strategy == LINEAR_BWD_IN_PLACE ? bwd_in_place(gemm, p, ws, ws_floats) : bwd_chunked(gemm, p, ws, ws_floats);
}
