/*
 * Every compiled norm variant against the scalar reference, through the
 * whole-tensor drivers: rms_norm, add_rms_norm and layer_norm, forward and
 * backward, every dtype, hidden 1, 7, 123, 4097 and rows 1, 3, 37, with and
 * without weight (and bias), the Gemma offset, and three layouts (contiguous;
 * padded rows under two leading dims; a hidden stride of 2, which the variants
 * hand to the reference). Workspaces come from check_ws_alloc. The reference
 * itself is checked against a double-precision formula, and the weight
 * gradients for the same bits at 1, 2 and 3 threads.
 */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/kernels/norm.h"
#include "check.h"

static const int64_t HIDDEN[] = {1, 7, 123, 4097};
static const int64_t ROWS[] = {1, 3, 37};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};

/* Variants sum a row in another order: float32 results within a few ulps plus a share of the largest value
 * (cancellation in dx); 16-bit results within one ulp of their type of the reference. */
static double rtol_of(opf_dtype dt) {
    return dt == OPF_F64 ? 1e-12 : dt == OPF_F32 ? 3e-5 : dt == OPF_BF16 ? 1.01 / 128 : 1.01 / 1024;
}

enum { LAYOUT_DENSE, LAYOUT_PADDED, LAYOUT_STRIDED, LAYOUTS };
static const char *const LAYOUT_NAME[] = {"dense", "padded", "hidden-stride-2"};

typedef struct operand {
    void *buf;
    norm_mat m;
} operand;

/* An (rows, h) operand of dtype dt in `layout`, filled with values in [-scale, scale) + shift. */
static operand make_mat(norm_shape *sh, int layout, unsigned long long seed, double scale, double shift) {
    const int64_t rows = sh->rows, h = sh->hidden;
    int64_t cs = layout == LAYOUT_STRIDED ? 2 : 1, rs = layout == LAYOUT_DENSE ? h : h * cs + 5;
    int64_t span = rows * rs + h * cs + 8;
    operand o = {.buf = calloc((size_t)span, 8)};
    o.m.data = o.buf;
    o.m.cs = cs;
    if (sh->nlead == 2) { /* (rows, 1): a size-1 dim of any stride */
        o.m.rs[0] = rs, o.m.rs[1] = 12345;
    } else {
        o.m.rs[0] = rs;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < h; i++)
            opf_store_elem(o.buf, r * rs + i * cs, sh->dt, shift + scale * (2 * check_uniform(&seed) - 1));
    return o;
}

static operand make_vec(norm_shape *sh, int layout, unsigned long long seed, double scale, double shift) {
    norm_shape one = *sh;
    one.rows = 1, one.nlead = 1;
    operand o = make_mat(&one, layout, seed, scale, shift);
    return o;
}

static double elem(opf_dtype dt, const void *p, int64_t i) { return opf_load_elem(p, i, dt); }

/* got vs want, n elements of dtype dt (contiguous) */
static void compare(const char *what, const char *variant, const norm_shape *sh, int layout, opf_dtype dt,
                    const void *got, const void *want, int64_t n) {
    double maxabs = 0;
    for (int64_t i = 0; i < n; i++) maxabs = fmax(maxabs, fabs(elem(dt, want, i)));
    const double rtol = rtol_of(dt), atol = (dt == OPF_F64 ? 1e-12 : 3e-5) * maxabs;
    int64_t bad = -1, nbad = 0;
    double maxerr = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = elem(dt, got, i), w = elem(dt, want, i), e = fabs(g - w);
        if (isnan(g) && isnan(w)) continue;
        if (e > maxerr || isnan(e)) maxerr = e;
        if (!(e <= atol + rtol * fabs(w))) {
            if (bad < 0) bad = i;
            nbad++;
        }
    }
    CHECK(nbad == 0,
          "%s %s %s %s rows=%lld hidden=%lld: %lld of %lld beyond tolerance, first at %lld: got %.9g want %.9g, "
          "max err %g",
          what, variant, DT_NAME[sh->dt], LAYOUT_NAME[layout], (long long)sh->rows, (long long)sh->hidden,
          (long long)nbad, (long long)n, (long long)bad, bad >= 0 ? elem(dt, got, bad) : 0.0,
          bad >= 0 ? elem(dt, want, bad) : 0.0, maxerr);
}

static norm_shape shape_of(opf_dtype dt, int64_t rows, int64_t h, int layout, double eps, int offset) {
    norm_shape sh = {.rows = rows, .hidden = h, .dt = dt, .eps = eps, .offset = offset};
    sh.nlead = layout == LAYOUT_PADDED ? 2 : 1;
    sh.lead[0] = rows, sh.lead[1] = 1;
    return sh;
}

typedef struct outs {
    void *y, *s, *dx, *dr, *dw, *db;
    float *mean, *rstd;
} outs;

static outs outs_alloc(const norm_shape *sh) {
    size_t n = (size_t)(sh->rows * sh->hidden), h = (size_t)sh->hidden;
    outs o = {calloc(n, 8),
              calloc(n, 8),
              calloc(n, 8),
              calloc(n, 8),
              calloc(h, 8),
              calloc(h, 8),
              calloc((size_t)sh->rows, 4),
              calloc((size_t)sh->rows, 4)};
    return o;
}

static void outs_free(outs *o) {
    free(o->y), free(o->s), free(o->dx), free(o->dr), free(o->dw), free(o->db), free(o->mean), free(o->rstd);
}

/* rms_norm (residual 0) or add_rms_norm (1), forward and backward, k against the reference */
static void test_rms(const norm_kernels *k, opf_dtype dt, int64_t rows, int64_t h, int layout, int weight, int offset,
                     int add) {
    norm_shape sh = shape_of(dt, rows, h, layout, 1e-5, offset);
    operand x = make_mat(&sh, layout, 1 + (unsigned long long)h, 2.0, 0.3);
    operand res = make_mat(&sh, layout, 2 + (unsigned long long)h, 1.0, 0.0);
    operand g = make_mat(&sh, layout, 3 + (unsigned long long)rows, 1.0, 0.0);
    operand gs = make_mat(&sh, layout, 4 + (unsigned long long)rows, 1.0, 0.0);
    operand w = make_vec(&sh, layout, 5, 0.5, offset ? 0.0 : 1.0);
    norm_mat none = {0};
    const norm_mat *wm = weight ? &w.m : &none;
    outs want = outs_alloc(&sh), got = outs_alloc(&sh);
    const int64_t n = rows * h;
    const char *what = add ? "add_rms_norm" : "rms_norm";
    norm_rms_fwd(&norm_kernels_ref, &sh, want.y, add ? want.s : NULL, want.rstd, &x.m, add ? &res.m : NULL, wm);
    norm_rms_fwd(k, &sh, got.y, add ? got.s : NULL, got.rstd, &x.m, add ? &res.m : NULL, wm);
    compare(what, k->name, &sh, layout, dt, got.y, want.y, n);
    compare(what, k->name, &sh, layout, OPF_F32, got.rstd, want.rstd, rows);
    if (add) compare("add_rms_norm sum", k->name, &sh, layout, dt, got.s, want.s, n);

    /* backward from the reference's saved values: x (or the sum) and rstd */
    norm_mat sm = {.data = want.s, .cs = 1}, *xin = &x.m;
    sm.rs[0] = h, sm.rs[1] = 0;
    if (add) xin = &sm;
    float *ws_want = check_ws_alloc(norm_bwd_workspace(&sh, weight, 0));
    float *ws_got = check_ws_alloc(norm_bwd_workspace(&sh, weight, 0));
    norm_rms_bwd(&norm_kernels_ref, &sh, want.dx, add ? want.dr : NULL, weight ? want.dw : NULL, &g.m,
                 add ? &gs.m : &none, xin, want.rstd, wm, ws_want);
    norm_rms_bwd(k, &sh, got.dx, add ? got.dr : NULL, weight ? got.dw : NULL, &g.m, add ? &gs.m : &none, xin, want.rstd,
                 wm, ws_got);
    check_ws_free(ws_want, "rms backward (reference)");
    check_ws_free(ws_got, "rms backward");
    compare(add ? "add_rms_norm dx" : "rms_norm dx", k->name, &sh, layout, dt, got.dx, want.dx, n);
    if (add) compare("add_rms_norm dresidual", k->name, &sh, layout, dt, got.dr, want.dr, n);
    if (add) compare("add_rms_norm dresidual = dx", k->name, &sh, layout, dt, got.dr, got.dx, n);
    if (weight)
        compare(add ? "add_rms_norm dweight" : "rms_norm dweight", k->name, &sh, layout, dt, got.dw, want.dw, h);
    free(x.buf), free(res.buf), free(g.buf), free(gs.buf), free(w.buf);
    outs_free(&want), outs_free(&got);
}

static void test_ln(const norm_kernels *k, opf_dtype dt, int64_t rows, int64_t h, int layout, int weight, int bias) {
    norm_shape sh = shape_of(dt, rows, h, layout, 1e-5, 0);
    operand x = make_mat(&sh, layout, 11 + (unsigned long long)h, 2.0, 1.5);
    operand g = make_mat(&sh, layout, 12 + (unsigned long long)rows, 1.0, 0.0);
    operand w = make_vec(&sh, layout, 13, 0.5, 1.0), b = make_vec(&sh, layout, 14, 0.5, 0.0);
    norm_mat none = {0};
    const norm_mat *wm = weight ? &w.m : &none, *bm = bias ? &b.m : &none;
    outs want = outs_alloc(&sh), got = outs_alloc(&sh);
    const int64_t n = rows * h;
    norm_ln_fwd(&norm_kernels_ref, &sh, want.y, want.mean, want.rstd, &x.m, wm, bm);
    norm_ln_fwd(k, &sh, got.y, got.mean, got.rstd, &x.m, wm, bm);
    compare("layer_norm", k->name, &sh, layout, dt, got.y, want.y, n);
    compare("layer_norm mean", k->name, &sh, layout, OPF_F32, got.mean, want.mean, rows);
    compare("layer_norm rstd", k->name, &sh, layout, OPF_F32, got.rstd, want.rstd, rows);
    float *ws_want = check_ws_alloc(norm_bwd_workspace(&sh, weight, bias));
    float *ws_got = check_ws_alloc(norm_bwd_workspace(&sh, weight, bias));
    norm_ln_bwd(&norm_kernels_ref, &sh, want.dx, weight ? want.dw : NULL, bias ? want.db : NULL, &g.m, &x.m, want.mean,
                want.rstd, wm, ws_want);
    norm_ln_bwd(k, &sh, got.dx, weight ? got.dw : NULL, bias ? got.db : NULL, &g.m, &x.m, want.mean, want.rstd, wm,
                ws_got);
    check_ws_free(ws_want, "layer_norm backward (reference)");
    check_ws_free(ws_got, "layer_norm backward");
    compare("layer_norm dx", k->name, &sh, layout, dt, got.dx, want.dx, n);
    if (weight) compare("layer_norm dweight", k->name, &sh, layout, dt, got.dw, want.dw, h);
    if (bias) compare("layer_norm dbias", k->name, &sh, layout, dt, got.db, want.db, h);
    free(x.buf), free(g.buf), free(w.buf), free(b.buf);
    outs_free(&want), outs_free(&got);
}

static void test_variant(const norm_kernels *k) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++)
        for (size_t hi = 0; hi < sizeof HIDDEN / sizeof *HIDDEN; hi++)
            for (size_t ri = 0; ri < sizeof ROWS / sizeof *ROWS; ri++)
                for (int layout = 0; layout < LAYOUTS; layout++) {
                    int64_t h = HIDDEN[hi], rows = ROWS[ri];
                    test_rms(k, dt, rows, h, layout, 0, 0, 0);
                    test_rms(k, dt, rows, h, layout, 1, 0, 0);
                    test_rms(k, dt, rows, h, layout, 1, 1, 0);
                    test_rms(k, dt, rows, h, layout, 0, 0, 1);
                    test_rms(k, dt, rows, h, layout, 1, 1, 1);
                    test_ln(k, dt, rows, h, layout, 0, 0);
                    test_ln(k, dt, rows, h, layout, 1, 1);
                    test_ln(k, dt, rows, h, layout, 0, 1);
                }
}

/* The reference's float64 rows against the formulas in long double. */
static void test_reference_formulas(void) {
    enum { H = 123 };
    norm_shape sh = shape_of(OPF_F64, 1, H, LAYOUT_DENSE, 1e-5, 0);
    operand x = make_mat(&sh, LAYOUT_DENSE, 21, 2.0, 0.3), w = make_vec(&sh, LAYOUT_DENSE, 22, 0.5, 1.0);
    operand b = make_vec(&sh, LAYOUT_DENSE, 23, 0.5, 0.0);
    const double *xv = x.buf, *wv = w.buf, *bv = b.buf;
    double y[H];
    float rstd, mean;
    norm_rms_fwd(&norm_kernels_ref, &sh, y, NULL, &rstd, &x.m, NULL, &w.m);
    long double ss = 0, sum = 0, var = 0;
    for (int i = 0; i < H; i++) ss += (long double)xv[i] * xv[i], sum += xv[i];
    long double rs = 1.0L / sqrtl(ss / H + 1e-5L);
    for (int i = 0; i < H; i++)
        CHECK(fabs(y[i] - (double)(xv[i] * rs * wv[i])) <= 1e-13, "ref rms_norm element %d: %.17g vs %.17g", i, y[i],
              (double)(xv[i] * rs * wv[i]));
    norm_ln_fwd(&norm_kernels_ref, &sh, y, &mean, &rstd, &x.m, &w.m, &b.m);
    long double mu = sum / H;
    for (int i = 0; i < H; i++) var += (xv[i] - mu) * (xv[i] - mu);
    rs = 1.0L / sqrtl(var / H + 1e-5L);
    for (int i = 0; i < H; i++) {
        double want = (double)((xv[i] - mu) * rs * wv[i] + bv[i]);
        CHECK(fabs(y[i] - want) <= 1e-13, "ref layer_norm element %d: %.17g vs %.17g", i, y[i], want);
    }
    free(x.buf), free(w.buf), free(b.buf);
}

static void set_threads(int threads) {
    char env[8];
    snprintf(env, sizeof env, "%d", threads);
    setenv("OPFORGE_NUM_THREADS", env, 1);
}

/* Weight and bias gradients (and dx) with the same bits at 1, 2 and 3 threads, over many row blocks. */
static void test_thread_count_independence(const norm_kernels *k) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        norm_shape sh = shape_of(dt, 1000, 123, LAYOUT_DENSE, 1e-6, 0);
        operand x = make_mat(&sh, LAYOUT_DENSE, 31, 2.0, 0.5), g = make_mat(&sh, LAYOUT_DENSE, 32, 1.0, 0.0);
        operand w = make_vec(&sh, LAYOUT_DENSE, 33, 0.5, 1.0);
        outs o[3];
        for (int t = 0; t < 3; t++) {
            set_threads(t + 1);
            o[t] = outs_alloc(&sh);
            norm_ln_fwd(k, &sh, o[t].y, o[t].mean, o[t].rstd, &x.m, &w.m, &w.m);
            float *ws = check_ws_alloc(norm_bwd_workspace(&sh, 1, 1));
            norm_ln_bwd(k, &sh, o[t].dx, o[t].dw, o[t].db, &g.m, &x.m, o[t].mean, o[t].rstd, &w.m, ws);
            check_ws_free(ws, "layer_norm backward");
            ws = check_ws_alloc(norm_bwd_workspace(&sh, 1, 0));
            norm_rms_bwd(k, &sh, o[t].y, NULL, o[t].s, &g.m, &(norm_mat){0}, &x.m, o[t].rstd, &w.m, ws);
            check_ws_free(ws, "rms backward");
        }
        size_t es = opf_dtype_size(dt), nb = (size_t)(sh.rows * sh.hidden) * es, hb = (size_t)sh.hidden * es;
        for (int t = 1; t < 3; t++) {
            CHECK(memcmp(o[t].dx, o[0].dx, nb) == 0, "%s %s: layer_norm dx differs at %d threads", k->name, DT_NAME[dt],
                  t + 1);
            CHECK(memcmp(o[t].dw, o[0].dw, hb) == 0 && memcmp(o[t].db, o[0].db, hb) == 0,
                  "%s %s: layer_norm dweight/dbias differ at %d threads", k->name, DT_NAME[dt], t + 1);
            CHECK(memcmp(o[t].s, o[0].s, hb) == 0, "%s %s: rms_norm dweight differs at %d threads", k->name,
                  DT_NAME[dt], t + 1);
        }
        for (int t = 0; t < 3; t++) outs_free(&o[t]);
        free(x.buf), free(g.buf), free(w.buf);
    }
    set_threads(2);
}

static void test_empty(const norm_kernels *k) {
    /* no rows: nothing written, a workspace of no floats */
    norm_shape sh = shape_of(OPF_F32, 0, 7, LAYOUT_DENSE, 1e-6, 0);
    CHECK(norm_bwd_workspace(&sh, 1, 1) == 0, "workspace for no rows");
    float *ws = check_ws_alloc(0), dw[7], db[7];
    norm_mat x = {.data = dw, .cs = 1}, none = {0};
    norm_ln_bwd(k, &sh, NULL, dw, db, &x, &x, NULL, NULL, &none, ws);
    for (int i = 0; i < 7; i++) CHECK(dw[i] == 0 && db[i] == 0, "no rows: dweight %d = %g", i, dw[i]);
    check_ws_free(ws, "empty");
}

static void test_all(const norm_kernels *k) {
    test_variant(k);
    test_thread_count_independence(k);
    test_empty(k);
}

int main(void) {
    test_reference_formulas();
    CHECK_EACH_VARIANT(norm_kernels_for, test_all);
    return check_report("test_norm");
}
