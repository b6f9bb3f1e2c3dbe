/*
 * The CUDA kernels of the norms (csrc/cuda/norm.cu): rms_norm, add_rms_norm,
 * layer_norm and their backward, run on the CPU over tests/emu/cuda_emu.h,
 * against the C reference drivers (csrc/kernels/norm.h over
 * norm_kernels_ref): every dtype, weight / bias absent or given, the offset
 * flag, hidden sizes across the register paths (1, 2 and 4 packs per thread,
 * a warp or a block per row, the next row loaded early or not, the
 * backward's weights in registers or in shared memory) and the
 * generic path (odd sizes, rows too long for registers), strided layouts
 * (padded rows, a transposed x, leading dims that do not merge, a
 * misaligned start, a strided weight, a broadcast grad), no rows, no
 * columns, and bitwise repeatable weight gradients.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/norm.h"
#include "../../csrc/kernels/norm.h"
#include "../c/check.h"

static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const double EPS = 1e-5;

/* layouts of the row inputs (x, residual, grad, grad_sum) */
enum {
    DENSE,      /* contiguous */
    PAD_PACK,   /* rows padded by one 16-byte pack: still the fast path */
    PAD_ODD,    /* rows padded by 1 element: rows misaligned, the generic path */
    TRANSPOSED, /* (R, H) with strides (1, R) */
    SPLIT,      /* (2, S, H) a slice [:, :S] of (2, S + 1, H): leading dims that do not merge */
    MISALIGNED, /* contiguous from element 1 */
    WSTRIDED,   /* dense rows, weight and bias every other element */
    GBCAST,     /* dense rows, grad and grad_sum one row broadcast over the rows (stride 0) */
    NLAYOUTS
};
static const char *const LAYOUT_NAME[] = {"dense", "pad_pack",   "pad_odd",  "transposed",
                                          "split", "misaligned", "wstrided", "gbcast"};

/* what the launchers ran: every kernel of norm.cu must show up */
static const char *const KERNELS[] = {"rms_norm_fwd_vec",   "rms_norm_fwd_any",   "layer_norm_fwd_vec",
                                      "layer_norm_fwd_any", "rms_norm_bwd_vec",   "rms_norm_bwd_any",
                                      "layer_norm_bwd_vec", "layer_norm_bwd_any", "norm_bwd_reduce"};
#define NKERNELS (int)(sizeof KERNELS / sizeof *KERNELS)
static int seen[NKERNELS];
/* run each backward twice and compare the weight / bias gradients bit for bit */
static int twice;

static void saw(norm_cuda_launch l) {
    if (!l.kernel) return;
    for (int i = 0; i < NKERNELS; i++)
        if (strcmp(l.kernel, KERNELS[i]) == 0) seen[i]++;
}

/* An input view: sizes (lead..., H), strides in elements, data inside buf. */
typedef struct view {
    int ndim;
    int64_t sizes[4], strides[4];
    char *buf;
    void *data;
} view;

static void fill(opf_dtype dt, void *p, int64_t n, double lo, double hi, unsigned long long seed) {
    seed = seed * 2654435761ull + 12345;
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, lo + (hi - lo) * check_uniform(&seed));
}

/* A view of (lead..., H) in one of the layouts (bcast: rows of stride 0), filled with values in [lo, hi). */
static view make_view(opf_dtype dt, int nlead, const int64_t *lead, int64_t h, int layout, int bcast, double lo,
                      double hi, unsigned long long seed) {
    view v = {.ndim = nlead + 1};
    const int64_t es = (int64_t)opf_dtype_size(dt), V = 16 / es;
    int64_t rows = 1, start = 0;
    for (int d = 0; d < nlead; d++) v.sizes[d] = lead[d], rows *= lead[d];
    v.sizes[nlead] = h;
    v.strides[nlead] = 1;
    int64_t step = h + (layout == PAD_PACK ? V : layout == PAD_ODD ? 1 : 0);
    for (int d = nlead - 1; d >= 0; d--) v.strides[d] = step, step *= lead[d];
    if (layout == TRANSPOSED && nlead == 1) v.strides[0] = 1, v.strides[1] = rows;
    if (layout == SPLIT && nlead == 2) v.strides[0] = (lead[1] + 1) * h;
    if (layout == MISALIGNED) start = 1;
    if (bcast)
        for (int d = 0; d < nlead; d++) v.strides[d] = 0;
    int64_t span = 1;
    for (int d = 0; d <= nlead; d++)
        if (v.sizes[d] > 0) span += (v.sizes[d] - 1) * v.strides[d];
    span += start + V;
    v.buf = calloc((size_t)(span * es + 16), 1);
    v.data = v.buf + start * es;
    fill(dt, v.buf, span, lo, hi, seed);
    return v;
}

/* A weight / bias of h elements, every other one when strided. */
static view make_vec(opf_dtype dt, int64_t h, int strided, double lo, double hi, unsigned long long seed) {
    view v = {.ndim = 1, .sizes = {h}, .strides = {strided ? 2 : 1}};
    const int64_t es = (int64_t)opf_dtype_size(dt), n = 2 * h + 16;
    v.buf = calloc((size_t)(n * es + 16), 1);
    v.data = v.buf;
    fill(dt, v.buf, n, lo, hi, seed);
    return v;
}

static norm_mat mat_of(const view *v) {
    norm_mat m = {.data = v ? v->data : NULL};
    if (!v) return m;
    m.cs = v->strides[v->ndim - 1];
    for (int d = 0; d + 1 < v->ndim; d++) m.rs[d] = v->strides[d];
    return m;
}

/* what the glue does: the row inputs' leading dims merged with the outputs' row index */
static void set_rows(norm_cuda_args *a, const view *x, int n, const view *const *in) {
    const int nlead = x->ndim - 1;
    int64_t rowstride[4];
    const int64_t *strides[4] = {rowstride};
    int64_t step = 1;
    for (int d = nlead - 1; d >= 0; d--) rowstride[d] = step, step *= x->sizes[d];
    for (int k = 0; k < n; k++) {
        strides[1 + k] = in[k]->strides;
        a->in[k] = in[k]->data;
        a->in_cs[k] = in[k]->strides[nlead];
    }
    CHECK(opf_cuda_nd_make(&a->lead, nlead, x->sizes, 1 + n, strides) == 0, "lead dims");
}

typedef struct tol {
    double rtol, atol;
} tol;

static tol out_tol(opf_dtype dt) {
    switch (dt) {
    case OPF_F64: return (tol){1e-12, 1e-12};
    case OPF_F32: return (tol){2e-5, 2e-5};
    case OPF_BF16: return (tol){8e-3, 8e-3};
    default: return (tol){1.5e-3, 1.5e-3};
    }
}

/* n elements of got and want (dtype dt, or float32 when f32), within t; NaN matches NaN */
static void compare(const char *ctx, const char *what, opf_dtype dt, const void *got, const void *want, int64_t n,
                    tol t) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double a = opf_load_elem(got, i, dt), b = opf_load_elem(want, i, dt);
        if (isnan(a) && isnan(b)) continue;
        if (!(fabs(a - b) <= t.atol + t.rtol * fabs(b))) {
            if (first < 0) first = i;
            bad++;
        }
    }
    CHECK(bad == 0, "%s: %s: %lld of %lld mismatches, first at %lld: got %.9g want %.9g", ctx, what, (long long)bad,
          (long long)n, (long long)first, first >= 0 ? opf_load_elem(got, first, dt) : 0.0,
          first >= 0 ? opf_load_elem(want, first, dt) : 0.0);
}

static void *zalloc(int64_t n, size_t es) { return calloc((size_t)(n > 0 ? n : 1) * es + 16, 1); }

/* Every op in one layout: nlead leading dims lead, hidden h. */
static void run_case(opf_dtype dt, int nlead, const int64_t *lead, int64_t h, int layout, int has_w, int has_b,
                     int offset) {
    const size_t es = opf_dtype_size(dt);
    int64_t rows = 1;
    for (int d = 0; d < nlead; d++) rows *= lead[d];
    const int64_t n = rows * h;
    char ctx[256];
    snprintf(ctx, sizeof ctx, "%s rows=%lld h=%lld %s%s%s%s", DT_NAME[dt], (long long)rows, (long long)h,
             LAYOUT_NAME[layout], has_w ? " weight" : "", has_b ? " bias" : "", offset ? " offset" : "");
    const unsigned long long seed = (unsigned long long)(h * 131 + rows * 7 + layout * 3 + dt);
    view x = make_view(dt, nlead, lead, h, layout, 0, -2.0, 2.0, seed);
    view xm = make_view(dt, nlead, lead, h, layout, 0, 1.0, 5.0, seed + 1); /* far from zero mean: layer_norm */
    view res = make_view(dt, nlead, lead, h, layout, 0, -1.0, 1.0, seed + 2);
    view g = make_view(dt, nlead, lead, h, layout, layout == GBCAST, -1.0, 1.0, seed + 3);
    view gs = make_view(dt, nlead, lead, h, layout, layout == GBCAST, -0.5, 0.5, seed + 4);
    view w = make_vec(dt, h, layout == WSTRIDED, offset ? -0.5 : 0.5, offset ? 0.5 : 1.5, seed + 5);
    view b = make_vec(dt, h, layout == WSTRIDED, -0.5, 0.5, seed + 6);
    const view *wp = has_w ? &w : NULL, *bp = has_b ? &b : NULL;
    norm_shape sh = {.rows = rows, .hidden = h, .nlead = nlead, .dt = dt, .eps = EPS, .offset = offset};
    for (int d = 0; d < nlead; d++) sh.lead[d] = lead[d];
    /* rstd and mean: float32 sums of h terms in another order (the reference's runs sequentially) */
    const tol ts = {(dt == OPF_F64 ? 1e-6 : 1e-5) + 2e-9 * (double)h, 1e-6};
    tol t = out_tol(dt);
    if (dt == OPF_F32) t.rtol += 2e-9 * (double)h;
    /* weight / bias gradients: sums over the rows, in another order */
    const double grow = sqrt((double)(rows > 1 ? rows : 1));
    const tol tw = {t.rtol, t.atol * grow};
    norm_mat mx = mat_of(&x), mxm = mat_of(&xm), mres = mat_of(&res), mg = mat_of(&g), mgs = mat_of(&gs);
    norm_mat mw = mat_of(wp), mb = mat_of(bp);

    void *y = zalloc(n, es), *s = zalloc(n, es), *yr = zalloc(n, es), *sr = zalloc(n, es);
    float *rstd = zalloc(rows, 4), *mean = zalloc(rows, 4), *rstdr = zalloc(rows, 4), *meanr = zalloc(rows, 4);
    void *dx = zalloc(n, es), *dr = zalloc(n, es), *dxr = zalloc(n, es), *drr = zalloc(n, es);
    void *dw = zalloc(h, es), *db = zalloc(h, es), *dwr = zalloc(h, es), *dbr = zalloc(h, es);
    void *dw2 = zalloc(h, es), *db2 = zalloc(h, es);
    float *wsr = zalloc(norm_bwd_workspace(&sh, 1, 1), 4);
    char what[64];

    for (int add = 0; add < 2; add++) {
        const char *op = add ? "add_rms_norm" : "rms_norm";
        /* forward */
        norm_cuda_args a = {.dt = dt, .rows = rows, .hidden = h, .eps = EPS, .offset = offset};
        if (add)
            set_rows(&a, &x, 2, (const view *[]){&x, &res});
        else
            set_rows(&a, &x, 1, (const view *[]){&x});
        a.w = has_w ? w.data : NULL, a.wcs = w.strides[0];
        a.out = y, a.out2 = add ? s : NULL, a.rstd = rstd;
        norm_cuda_launch l = norm_cuda_rms_fwd(&a, NULL);
        saw(l);
        CHECK((rows == 0) == (l.grid == 0), "%s: %s forward launched %u blocks", ctx, op, l.grid);
        norm_rms_fwd(&norm_kernels_ref, &sh, yr, add ? sr : NULL, rstdr, &mx, add ? &mres : NULL, &mw);
        snprintf(what, sizeof what, "%s y", op);
        compare(ctx, what, dt, y, yr, n, t);
        snprintf(what, sizeof what, "%s rstd", op);
        compare(ctx, what, OPF_F32, rstd, rstdr, rows, ts);
        if (add) compare(ctx, "add_rms_norm sum", dt, s, sr, n, (tol){0, 0});

        /* backward, of the sum for add_rms_norm (as the op is called) */
        const view *xin = add ? NULL : &x;
        view sv = {.ndim = nlead + 1};
        if (add) { /* the sum the forward returned: contiguous */
            for (int d = 0; d <= nlead; d++) sv.sizes[d] = x.sizes[d];
            int64_t step = 1;
            for (int d = nlead; d >= 0; d--) sv.strides[d] = step, step *= sv.sizes[d];
            sv.data = sr;
            xin = &sv;
        }
        norm_mat mxin = mat_of(xin);
        for (int rep = 0; rep < 1 + twice; rep++) {
            norm_cuda_args b2 = {.dt = dt, .rows = rows, .hidden = h, .eps = EPS, .offset = offset};
            if (add)
                set_rows(&b2, xin, 3, (const view *[]){&g, xin, &gs});
            else
                set_rows(&b2, xin, 2, (const view *[]){&g, xin});
            b2.w = has_w ? w.data : NULL, b2.wcs = w.strides[0];
            b2.rstd = rstdr, b2.out = dx, b2.out2 = add ? dr : NULL, b2.dw = has_w ? (rep ? dw2 : dw) : NULL;
            float *ws = check_ws_alloc(norm_cuda_bwd_workspace(&b2));
            b2.ws = ws;
            saw(norm_cuda_rms_bwd(&b2, NULL));
            check_ws_free(ws, ctx);
        }
        norm_rms_bwd(&norm_kernels_ref, &sh, dxr, add ? drr : NULL, has_w ? dwr : NULL, &mg, add ? &mgs : NULL, &mxin,
                     rstdr, &mw, wsr);
        snprintf(what, sizeof what, "%s dx", op);
        compare(ctx, what, dt, dx, dxr, n, t);
        if (add) compare(ctx, "add_rms_norm dresidual", dt, dr, dx, n, (tol){0, 0});
        if (has_w) {
            snprintf(what, sizeof what, "%s dweight", op);
            compare(ctx, what, dt, dw, dwr, h, tw);
            CHECK(!twice || memcmp(dw, dw2, (size_t)h * es) == 0, "%s: %s dweight differs between two runs", ctx, op);
        }
    }

    /* layer_norm */
    {
        norm_cuda_args a = {.dt = dt, .rows = rows, .hidden = h, .eps = EPS};
        set_rows(&a, &xm, 1, (const view *[]){&xm});
        a.w = has_w ? w.data : NULL, a.wcs = w.strides[0];
        a.b = has_b ? b.data : NULL, a.bcs = b.strides[0];
        a.out = y, a.mean = mean, a.rstd = rstd;
        norm_cuda_launch l = norm_cuda_ln_fwd(&a, NULL);
        saw(l);
        CHECK((rows == 0) == (l.grid == 0), "%s: layer_norm forward launched %u blocks", ctx, l.grid);
        norm_ln_fwd(&norm_kernels_ref, &sh, yr, meanr, rstdr, &mxm, &mw, &mb);
        compare(ctx, "layer_norm y", dt, y, yr, n, t);
        compare(ctx, "layer_norm mean", OPF_F32, mean, meanr, rows, ts);
        compare(ctx, "layer_norm rstd", OPF_F32, rstd, rstdr, rows, ts);
        for (int rep = 0; rep < 1 + twice; rep++) {
            norm_cuda_args b2 = {.dt = dt, .rows = rows, .hidden = h, .eps = EPS};
            set_rows(&b2, &xm, 2, (const view *[]){&g, &xm});
            b2.w = has_w ? w.data : NULL, b2.wcs = w.strides[0];
            b2.mean = meanr, b2.rstd = rstdr, b2.out = dx;
            b2.dw = has_w ? (rep ? dw2 : dw) : NULL, b2.db = has_b ? (rep ? db2 : db) : NULL;
            float *ws = check_ws_alloc(norm_cuda_bwd_workspace(&b2));
            b2.ws = ws;
            saw(norm_cuda_ln_bwd(&b2, NULL));
            check_ws_free(ws, ctx);
        }
        norm_ln_bwd(&norm_kernels_ref, &sh, dxr, has_w ? dwr : NULL, has_b ? dbr : NULL, &mg, &mxm, meanr, rstdr, &mw,
                    wsr);
        compare(ctx, "layer_norm dx", dt, dx, dxr, n, t);
        if (has_w) {
            compare(ctx, "layer_norm dweight", dt, dw, dwr, h, tw);
            CHECK(!twice || memcmp(dw, dw2, (size_t)h * es) == 0, "%s: layer_norm dweight differs between two runs",
                  ctx);
        }
        if (has_b) {
            compare(ctx, "layer_norm dbias", dt, db, dbr, h, tw);
            CHECK(!twice || memcmp(db, db2, (size_t)h * es) == 0, "%s: layer_norm dbias differs between two runs", ctx);
        }
    }

    free(x.buf), free(xm.buf), free(res.buf), free(g.buf), free(gs.buf), free(w.buf), free(b.buf);
    free(y), free(s), free(yr), free(sr), free(rstd), free(mean), free(rstdr), free(meanr);
    free(dx), free(dr), free(dxr), free(drr), free(dw), free(db), free(dwr), free(dbr), free(dw2), free(db2), free(wsr);
}

/* No rows: nothing launched but the weight / bias gradients, which are zeros. */
static void test_no_rows(opf_dtype dt) {
    const int64_t h = 40;
    const size_t es = opf_dtype_size(dt);
    char *dw = calloc(h, es), *db = calloc(h, es), *x = calloc(16, 1), *w = calloc(h, es);
    for (int64_t i = 0; i < h; i++) opf_store_elem(dw, i, dt, 7.0), opf_store_elem(db, i, dt, 7.0);
    norm_cuda_args a = {.dt = dt, .rows = 0, .hidden = h, .eps = EPS};
    const int64_t lead = 0, rs = h, *strides[] = {&rs, &rs, &rs};
    opf_cuda_nd_make(&a.lead, 1, &lead, 3, strides);
    a.in[0] = a.in[1] = x, a.in_cs[0] = a.in_cs[1] = 1;
    a.w = w, a.wcs = 1, a.out = x, a.rstd = (float *)x, a.mean = (float *)x;
    CHECK(norm_cuda_rms_fwd(&a, NULL).grid == 0, "%s: rms_norm forward of no rows launched", DT_NAME[dt]);
    CHECK(norm_cuda_ln_fwd(&a, NULL).grid == 0, "%s: layer_norm forward of no rows launched", DT_NAME[dt]);
    a.dw = dw, a.db = db;
    CHECK(norm_cuda_bwd_workspace(&a) == 0, "%s: workspace of no rows", DT_NAME[dt]);
    float *ws = check_ws_alloc(0);
    a.ws = ws;
    saw(norm_cuda_ln_bwd(&a, NULL));
    int nonzero = 0;
    for (int64_t i = 0; i < h; i++) nonzero += opf_load_elem(dw, i, dt) != 0.0 || opf_load_elem(db, i, dt) != 0.0;
    CHECK(nonzero == 0, "%s: layer_norm_backward of no rows: %d gradients not zero", DT_NAME[dt], nonzero);
    for (int64_t i = 0; i < h; i++) opf_store_elem(dw, i, dt, 7.0);
    a.db = NULL;
    saw(norm_cuda_rms_bwd(&a, NULL));
    nonzero = 0;
    for (int64_t i = 0; i < h; i++) nonzero += opf_load_elem(dw, i, dt) != 0.0;
    CHECK(nonzero == 0, "%s: rms_norm_backward of no rows: %d gradients not zero", DT_NAME[dt], nonzero);
    check_ws_free(ws, "no rows");
    free(dw), free(db), free(x), free(w);
}

int main(void) {
    const int64_t r1[] = {1}, r2[] = {2}, r5[] = {5}, r37[] = {37}, r150[] = {150}, split[] = {2, 3}, r0[] = {0};
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        const opf_dtype d = (opf_dtype)dt;
        const int64_t V = 16 / (int64_t)opf_dtype_size(d);
        /* hidden sizes around the register paths, in packs: 1 pack, a warp of 1 / 2 / 4 packs, 2 warps of 2
         * packs, 4 packs per thread with 128 / 256 / 512 threads (the backward's weights in shared memory:
         * the fewest packs there and the most, 16384 16-bit values) */
        const int64_t fast[] = {V, 32 * V, 33 * V, 65 * V, 512 * V, 1025 * V, 2048 * V};
        for (size_t i = 0; i < sizeof fast / sizeof *fast; i++) {
            const int64_t *lead = fast[i] <= 65 * V ? r37 : fast[i] <= 512 * V ? r5 : r2;
            twice = i == 3 || i == 4 || i == 6;
            run_case(d, 1, lead, fast[i], DENSE, 1, 1, 0);
            twice = 0;
            if (i % 2) run_case(d, 1, lead, fast[i], DENSE, 0, 0, 0);
        }
        run_case(d, 1, r2, 2048 * V, DENSE, 1, 0, 1); /* offset, the weights in shared memory */
        if (d == OPF_F32 || d == OPF_BF16) {
            run_case(d, 1, r1, 2049 * V, DENSE, 1, 1, 0); /* a block of 1024 forward, the generic backward */
            if (d == OPF_F32) run_case(d, 1, r1, 4097 * V, DENSE, 1, 0, 0); /* the generic forward too */
        }
        /* not a whole number of packs: the generic kernels */
        const int64_t odd[] = {1, 31, 1001, 8193};
        for (size_t i = 0; i < sizeof odd / sizeof *odd; i++)
            run_case(d, 1, odd[i] <= 33 ? r37 : odd[i] <= 1001 ? r5 : r2, odd[i], DENSE, 1, 1, 0);
        twice = 1;
        run_case(d, 1, r150, 8 * V, DENSE, 1, 1, 0); /* many rows per block, many blocks */
        run_case(d, 1, r150, 3, DENSE, 1, 1, 0);     /* the same, generic (a slot per group) */
        twice = 0;
        run_case(d, 1, r37, 64 * V, DENSE, 1, 0, 1); /* offset */
        run_case(d, 1, r37, 13, DENSE, 1, 0, 1);
        /* every layout for two pack widths; for the others the ones that keep the fast path or merge no dims */
        for (int layout = PAD_PACK; layout < NLAYOUTS; layout++)
            if (d == OPF_F32 || d == OPF_BF16 || layout == PAD_PACK || layout == SPLIT || layout == GBCAST)
                run_case(d, layout == SPLIT ? 2 : 1, layout == SPLIT ? split : r37, 40 * V, layout, 1, 1, 0);
        run_case(d, 1, r0, 24, DENSE, 1, 1, 0);        /* no rows */
        run_case(d, 1, r5, 0, DENSE, 1, 1, 0);         /* no columns: rstd and mean NaN as on the CPU */
        run_case(d, 0, NULL, 100 * V, DENSE, 1, 1, 0); /* a 1-d x */
        test_no_rows(d);
    }
    for (int i = 0; i < NKERNELS; i++) CHECK(seen[i] > 0, "kernel %s never ran", KERNELS[i]);
    return check_report("test_norm (CUDA, emulated)");
}
