/*
 * Every compiled cross_entropy variant against the reference (double, one
 * rounding), through the whole-problem drivers: C = 1, 7, 123, 4097, 32000
 * classes, 1, 3 and 37 rows, every dtype, the grid of weight x label
 * smoothing x softcap x reduction (a few corners of it at C = 32000), rows
 * ignored (ignore_index), -inf logits (the target's too: loss inf) and a row
 * of -inf only (NaN, as torch), and logits at every other element (the
 * strided path). Checks: per-row losses, the reduced loss, lse, dlogits
 * (ignored rows exactly 0), cross_entropy_check_target naming the first bad row, and the
 * reduction workspace between guard words. Tolerance per dtype as
 * test_softmax.c.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/cross_entropy.h"
#include "check.h"

static const int64_t CS[] = {1, 7, 123, 4097, 32000};
static const int64_t ROWS[] = {1, 3, 37};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const int64_t IGNORE = -100;

static double rtol(opf_dtype dt) {
    return dt == OPF_F64 ? 1e-12 : dt == OPF_F32 ? 2e-5 : dt == OPF_BF16 ? 0x1p-7 : 0x1p-10;
}

static int close_to(opf_dtype dt, double g, double w, double atol) {
    if (isnan(w) || isnan(g)) return isnan(w) && isnan(g);
    if (isinf(w) || isinf(g)) return g == w;
    return fabs(g - w) <= rtol(dt) * fabs(w) + atol;
}

typedef struct cross_entropy_case {
    opf_dtype dt;
    int64_t rows, C, xs;
    int weight, reduction;
    double eps, cap;
} cross_entropy_case;

static void run_case(const cross_entropy_kernels *k, cross_entropy_case c) {
    const size_t es = opf_dtype_size(c.dt);
    const int64_t n = c.rows * c.C;
    char *x = calloc((size_t)(n * c.xs), es), *w = calloc((size_t)c.C, es), *gl = calloc((size_t)c.rows, es);
    char *losses = calloc((size_t)c.rows, es), *losses_r = calloc((size_t)c.rows, es), loss[8], loss_r[8], g[8];
    char *dx = calloc((size_t)n, es), *dx_r = calloc((size_t)n, es);
    double *lse = calloc((size_t)c.rows, sizeof(double)), *lse_r = calloc((size_t)c.rows, sizeof(double));
    int64_t *t = malloc(sizeof(int64_t) * (size_t)c.rows);
    unsigned long long seed = 0x2545f4914f6cdd1dull ^ (unsigned long long)(c.C * 7919 + c.rows);
    for (int64_t i = 0; i < n; i++) {
        double v = check_uniform(&seed) * 16.0 - 8.0;
        if (i % 17 == 3) v = -INFINITY;
        opf_store_elem(x, i * c.xs, c.dt, v);
    }
    for (int64_t j = 0; j < c.C; j++) opf_store_elem(w, j, c.dt, 0.25 + check_uniform(&seed));
    for (int64_t r = 0; r < c.rows; r++) {
        t[r] = (int64_t)(check_uniform(&seed) * (double)c.C);
        if (r % 4 == 1) t[r] = IGNORE;
        opf_store_elem(gl, r, c.dt, check_uniform(&seed) * 2.0 - 1.0);
    }
    if (c.rows >= 37) /* a row of -inf only, not ignored */
        for (int64_t j = 0; j < c.C; j++) opf_store_elem(x, (6 * c.C + j) * c.xs, c.dt, -INFINITY);
    opf_store_elem(g, 0, c.dt, 0.75);
    int64_t lead[1] = {c.rows}, xst[2] = {c.C * c.xs, c.xs}, tst[1] = {1};
    cross_entropy_problem p = {.dt = c.dt,
                               .rows = c.rows,
                               .classes = c.C,
                               .lead_ndim = 1,
                               .lead_sizes = lead,
                               .logits = x,
                               .logits_strides = xst,
                               .target = t,
                               .target_strides = tst,
                               .weight = c.weight ? w : NULL,
                               .weight_stride = 1,
                               .ignore_index = IGNORE,
                               .label_smoothing = c.eps,
                               .softcap = c.cap,
                               .reduction = c.reduction,
                               .grad_losses = gl,
                               .grad_losses_strides = tst,
                               .grad_loss = g};
    int64_t value = 0;
    CHECK(cross_entropy_check_target(&p, &value) == -1, "valid targets refused");
    float *ws = check_ws_alloc(cross_entropy_fwd_workspace(&p));
    p.losses = losses_r, p.loss = loss_r, p.lse = lse_r;
    cross_entropy_fwd(&cross_entropy_kernels_ref, &p, ws);
    p.dlogits = dx_r, p.lse_saved = lse_r, p.lse_dt = OPF_F64;
    cross_entropy_bwd(&cross_entropy_kernels_ref, &p);
    p.losses = losses, p.loss = loss, p.lse = lse;
    cross_entropy_fwd(k, &p, ws);
    p.dlogits = dx, p.lse_saved = lse;
    cross_entropy_bwd(k, &p);
    check_ws_free(ws, "cross_entropy_fwd");

    char what[160];
    snprintf(what, sizeof what, "%s %s rows=%lld C=%lld xs=%lld weight=%d eps=%g cap=%g reduction=%d", k->name,
             DT_NAME[c.dt], (long long)c.rows, (long long)c.C, (long long)c.xs, c.weight, c.eps, c.cap, c.reduction);
    double atol = c.dt == OPF_F64 ? 1e-12 : 1e-5 * (1 + (double)c.rows);
    for (int64_t r = 0; r < c.rows; r++) {
        double a = opf_load_elem(losses, r, c.dt), b = opf_load_elem(losses_r, r, c.dt);
        CHECK(close_to(c.dt, a, b, c.dt == OPF_F64 ? 1e-12 : 1e-4), "%s: loss of row %lld %.9g, want %.9g", what,
              (long long)r, a, b);
        CHECK(close_to(c.dt == OPF_F64 ? OPF_F64 : OPF_F32, lse[r], lse_r[r], 1e-6),
              "%s: lse of row %lld %.9g, want %.9g", what, (long long)r, lse[r], lse_r[r]);
    }
    double a = opf_load_elem(loss, 0, c.dt), b = opf_load_elem(loss_r, 0, c.dt);
    CHECK(close_to(c.dt, a, b, atol), "%s: reduced loss %.9g, want %.9g", what, a, b);
    int64_t bad = -1, nbad = 0;
    double gb = 0, wb = 0;
    for (int64_t i = 0; i < n; i++) {
        double u = opf_load_elem(dx, i, c.dt), v = opf_load_elem(dx_r, i, c.dt);
        int ok = close_to(c.dt, u, v, c.dt == OPF_F64 ? 1e-12 : 1e-6);
        if (t[i / c.C] == IGNORE) ok = ok && u == 0.0;
        if (!ok && bad < 0) bad = i, gb = u, wb = v;
        nbad += !ok;
    }
    CHECK(nbad == 0, "%s: dlogits %lld mismatches, first at (%lld, %lld): got %.9g want %.9g", what, (long long)nbad,
          (long long)(bad / c.C), (long long)(bad % c.C), gb, wb);
    free(x), free(w), free(gl), free(losses), free(losses_r), free(dx), free(dx_r), free(lse), free(lse_r), free(t);
}

/* the target of row 2 out of range: named with its row; ignore_index accepted */
static void check_targets(void) {
    int64_t t[4] = {0, IGNORE, 9, 1}, lead[1] = {4}, st[1] = {1}, value = 0;
    cross_entropy_problem p = {.rows = 4,
                               .classes = 9,
                               .lead_ndim = 1,
                               .lead_sizes = lead,
                               .target = t,
                               .target_strides = st,
                               .ignore_index = IGNORE};
    CHECK(cross_entropy_check_target(&p, &value) == 2 && value == 9, "target 9 of 9 classes at row 2 not found");
    t[2] = -1;
    CHECK(cross_entropy_check_target(&p, &value) == 2 && value == -1, "target -1 at row 2 not found");
    t[2] = 8;
    CHECK(cross_entropy_check_target(&p, &value) == -1, "valid targets refused");
}

static void test_variant(const cross_entropy_kernels *k) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++)
        for (size_t a = 0; a < sizeof CS / sizeof *CS; a++)
            for (size_t b = 0; b < sizeof ROWS / sizeof *ROWS; b++)
                for (int opt = 0; opt < 24; opt++) {
                    cross_entropy_case c = {.dt = (opf_dtype)dt,
                                            .rows = ROWS[b],
                                            .C = CS[a],
                                            .xs = 1,
                                            .weight = opt & 1,
                                            .eps = opt & 2 ? 0.1 : 0.0,
                                            .cap = opt & 4 ? 30.0 : 0.0,
                                            .reduction = opt / 8};
                    if (CS[a] == 32000 && opt % 7 != 0) continue; /* corners only at the largest C */
                    run_case(k, c);
                    if (opt == 23 || (CS[a] <= 123 && opt == 6)) c.xs = 2, run_case(k, c);
                }
}

int main(void) {
    check_targets();
    CHECK_EACH_VARIANT(cross_entropy_kernels_for, test_variant);
    return check_report("test_cross_entropy");
}
