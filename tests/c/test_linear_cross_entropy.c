/*
 * The fused linear + cross-entropy of every compiled row-code variant (with
 * the GEMM of the same ISA) against the float64 reference: loss and lse, the
 * gradients made in the forward (mean, sum), the backward that recomputes
 * them from lse with a scalar gradient (mean, sum) and with a non-uniform
 * per-token gradient (none), and the scaling backward; float32, bfloat16,
 * float16 (the loss, its gradient and the forward's gradients float32, the
 * loss as precise as float32's on the 16-bit operands and, for bfloat16, on
 * logits rounded to bfloat16 as the kernels' block holds them); odd sizes T 1, 7, 37, H 1, 7, 123, V 1, 7, 123, 4097; ignored
 * rows, bias, label smoothing, softcap; the default block plan and one of
 * 16-row blocks, so that both sweeps cross token and vocab block boundaries;
 * strided hidden and weight; bfloat16 with H past the GEMMs' K slice; the same bits at 1 and 2 threads; non-finite
 * logits (a -inf bias, a NaN hidden row) and one class. Every workspace sits
 * between guard words, sized exactly as linear_cross_entropy_workspace says.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the thread count per test */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/linear_cross_entropy.h"
#include "check.h"

typedef struct cfg {
    int64_t t, h, v;
    opf_dtype dt;
    int reduction, bias, extras; /* extras: label smoothing 0.1, softcap 2.5, ignored rows, strided operands */
    int64_t block_floats;
} cfg;

/* count elements of dt and their exact float64 copy */
typedef struct arr {
    void *lo;
    double *hi;
    int64_t count;
} arr;

static arr arr_rand(int64_t count, opf_dtype dt, unsigned long long seed, double amp) {
    size_t c = (size_t)(count > 0 ? count : 1);
    arr a = {malloc(c * opf_dtype_size(dt)), malloc(c * sizeof(double)), count};
    seed = seed * 2654435761ull + 1;
    for (int64_t i = 0; i < count; i++) {
        opf_store_elem(a.lo, i, dt, (check_uniform(&seed) * 2.0 - 1.0) * amp);
        a.hi[i] = opf_load_elem(a.lo, i, dt);
    }
    return a;
}

/* NaN-filled: an element a kernel leaves unwritten shows */
static arr arr_empty(int64_t count, opf_dtype dt) {
    size_t c = (size_t)(count > 0 ? count : 1);
    arr a = {malloc(c * opf_dtype_size(dt)), malloc(c * sizeof(double)), count};
    memset(a.lo, 0xff, c * opf_dtype_size(dt));
    for (int64_t i = 0; i < count; i++) a.hi[i] = NAN;
    return a;
}

static void arr_free(arr *a) { free(a->lo), free(a->hi); }

static double tol_of(opf_dtype dt) { return dt == OPF_F32 ? 2e-4 : dt == OPF_F16 ? 1e-2 : 4e-2; }

/* The loss and lse are float32 sums of exact products of the (16-bit) operands, which the reference has
 * exactly: float32's tolerance whatever the operands. The gradients round du to a 16-bit operand where the
 * GEMM multiplies pairs (and the backward's results to the dtype): the operands' tolerance. */
#define LOSS_TOL tol_of(OPF_F32)

/* max |got - want| relative to max(max |want|, 1e-3, times T for a sum over the rows): the operands
 * are O(1), so a result near 0 is a cancellation (V = 1 with label smoothing: 1 - 0.9 - 0.1), exact
 * only up to float32 rounding, which a sum reduction adds up over the rows */
static void compare(const char *what, const cfg *c, const char *variant, const void *got, opf_dtype gdt,
                    const double *want, int64_t count, double tol) {
    double err = 0.0, mag = 1e-3 * (c->reduction == LINEAR_CROSS_ENTROPY_SUM ? (double)c->t : 1.0);
    int64_t worst = -1;
    for (int64_t i = 0; i < count; i++)
        if (isfinite(want[i])) mag = fmax(mag, fabs(want[i]));
    for (int64_t i = 0; i < count; i++) {
        double g = opf_load_elem(got, i, gdt), e = fabs(g - want[i]);
        if ((isnan(want[i]) && isnan(g)) || g == want[i]) continue; /* NaN, or the same infinity */
        if (!(e <= err)) err = e, worst = i;
        if (isnan(err)) break; /* a NaN is the worst: later finite errors must not replace it */
    }
    CHECK(worst < 0 || err / mag <= tol,
          "%s %s: T=%lld H=%lld V=%lld dt=%d reduction=%d bias=%d extras=%d block=%lld: index %lld got %g want %g, "
          "max error %g of %g",
          variant, what, (long long)c->t, (long long)c->h, (long long)c->v, (int)c->dt, c->reduction, c->bias,
          c->extras, (long long)c->block_floats, (long long)worst, worst < 0 ? 0.0 : opf_load_elem(got, worst, gdt),
          worst < 0 ? 0.0 : want[worst], err, mag);
}

static void set_threads(int threads) {
    char env[16];
    snprintf(env, sizeof env, "%d", threads);
    setenv("OPFORGE_NUM_THREADS", env, 1);
}

/* runs linear_cross_entropy_run under a plan at this run's thread count, with a guarded workspace of exactly linear_cross_entropy_workspace
 * floats */
static int run(const linear_cross_entropy_kernels *kern, const gemm_kernels *gemm,
               const linear_cross_entropy_problem *p, const char *what) {
    const linear_cross_entropy_plan plan = linear_cross_entropy_plan_make(gemm, p, opf_num_threads());
    int64_t floats = linear_cross_entropy_workspace(&plan);
    float *ws = check_ws_alloc(floats);
    int rc = linear_cross_entropy_run(kern, &plan, p, ws, floats);
    check_ws_free(ws, what);
    CHECK(rc == 0, "%s: linear_cross_entropy_run returned %d", what, rc);
    return rc;
}

/* du kept (mean / sum; float32, bfloat16 for bfloat16 operands): a forward given dlogits makes the loss and lse as before and du
 * (for a gradient of 1), running no gradient GEMM; the backward given it runs the two GEMMs per block on it,
 * times a scalar gradient of gscalar and of 1 (the GEMM's alpha, and none), against the reference's gradients
 * for gscalar (want: rdh, rdw, rdb); the same bits at 1 and 2 threads. p / bp: test_case's forward (its
 * gradient pointers cleared here) and backward problems. */
static void test_kept(const linear_cross_entropy_kernels *kern, const cfg *c, const linear_cross_entropy_problem *p,
                      const linear_cross_entropy_problem *bp, const arr *lref, const arr *rdh, const arr *rdw,
                      const arr *rdb, const float *lse_ref, double gscalar) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const int64_t t = c->t, h = c->h, v = c->v, nloss = 1;
    const opf_dtype dt = c->dt, ldt = p->loss_dt;
    const size_t es = opf_dtype_size(dt);
    arr dl = arr_empty(t * v, dt == OPF_BF16 ? OPF_BF16 : OPF_F32), loss = arr_empty(1, ldt), dh = arr_empty(t * h, dt),
        dw = arr_empty(v * h, dt);
    arr db = arr_empty(v, dt), want_h = arr_empty(t * h, OPF_F64), want_w = arr_empty(v * h, OPF_F64);
    arr want_b = arr_empty(v, OPF_F64);
    float *lse = malloc((size_t)(t + 1) * sizeof(float));
    double *lse_hi = malloc((size_t)(t + 1) * sizeof(double));
    linear_cross_entropy_problem f = *p;
    f.dhidden = f.dweight = f.dbias = NULL;
    f.dlogits = dl.lo, f.loss = loss.lo, f.lse = lse;
    if (run(kern, gemm, &f, "forward, du kept") == 0) {
        compare("loss (du kept)", c, kern->name, loss.lo, ldt, lref->hi, nloss, LOSS_TOL);
        for (int64_t i = 0; i < t; i++) lse_hi[i] = lse_ref[i];
        compare("lse (du kept)", c, kern->name, lse, OPF_F32, lse_hi, t, LOSS_TOL);
    }
    for (int unit = 0; unit < 2; unit++) {
        const double g = unit ? 1.0 : gscalar;
        float g32 = (float)g; /* the loss's dtype: float32 for these operands */
        for (int64_t i = 0; i < t * h; i++) want_h.hi[i] = rdh->hi[i] * g / gscalar;
        for (int64_t i = 0; i < v * h; i++) want_w.hi[i] = rdw->hi[i] * g / gscalar;
        for (int64_t i = 0; i < v; i++) want_b.hi[i] = rdb->hi[i] * g / gscalar;
        linear_cross_entropy_problem b = *bp;
        b.dlogits = dl.lo, b.lse = lse, b.grad = &g32;
        b.dhidden = dh.lo, b.dweight = dw.lo, b.dbias = c->bias ? db.lo : NULL;
        memset(dh.lo, 0xff, (size_t)(t * h > 0 ? t * h : 1) * es); /* NaN: all must be rewritten */
        memset(dw.lo, 0xff, (size_t)(v * h > 0 ? v * h : 1) * es);
        if (run(kern, gemm, &b, unit ? "backward, du kept, gradient 1" : "backward, du kept") != 0) continue;
        compare(unit ? "dhidden (du kept, 1)" : "dhidden (du kept)", c, kern->name, dh.lo, dt, want_h.hi, t * h,
                tol_of(dt));
        compare(unit ? "dweight (du kept, 1)" : "dweight (du kept)", c, kern->name, dw.lo, dt, want_w.hi, v * h,
                tol_of(dt));
        if (c->bias)
            compare(unit ? "dbias (du kept, 1)" : "dbias (du kept)", c, kern->name, db.lo, dt, want_b.hi, v,
                    tol_of(dt));
        if (unit || t * h == 0 || v * h == 0) continue;
        void *dh2 = malloc((size_t)(t * h) * es), *dw2 = malloc((size_t)(v * h) * es);
        memcpy(dh2, dh.lo, (size_t)(t * h) * es), memcpy(dw2, dw.lo, (size_t)(v * h) * es);
        set_threads(1);
        run(kern, gemm, &b, "backward, du kept, 1 thread");
        set_threads(2);
        CHECK(memcmp(dh2, dh.lo, (size_t)(t * h) * es) == 0 && memcmp(dw2, dw.lo, (size_t)(v * h) * es) == 0,
              "%s: T=%lld H=%lld V=%lld dt=%d: du kept, gradients differ between 1 and 2 threads", kern->name,
              (long long)t, (long long)h, (long long)v, (int)dt);
        free(dh2), free(dw2);
    }
    arr_free(&dl), arr_free(&loss), arr_free(&dh), arr_free(&dw), arr_free(&db);
    arr_free(&want_h), arr_free(&want_w), arr_free(&want_b);
    free(lse), free(lse_hi);
}

static void test_case(const linear_cross_entropy_kernels *kern, const cfg *c) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const int64_t t = c->t, h = c->h, v = c->v, hs = c->extras ? 2 : 1; /* strided: every other column */
    const opf_dtype dt = c->dt, ldt = linear_cross_entropy_loss_dtype(dt);
    CHECK(ldt == (dt == OPF_F64 ? OPF_F64 : OPF_F32), "the loss of dt=%d must be promote(dt, float32), got %d", (int)dt,
          (int)ldt);
    arr hid = arr_rand(t * h * hs, dt, (unsigned long long)(t * 31 + h), 1.0);
    arr w = arr_rand(v * h, dt, (unsigned long long)(v * 7 + h), 1.5 / sqrt((double)h));
    arr b = arr_rand(v, dt, 99, 0.5);
    arr gtok = arr_rand(t, ldt, 5, 1.0); /* a non-uniform per-token gradient (none), of the loss's dtype */
    int64_t *target = malloc((size_t)(t > 0 ? t : 1) * sizeof(int64_t));
    unsigned long long s = 12345 + (unsigned long long)v;
    for (int64_t i = 0; i < t; i++) {
        target[i] = (int64_t)(check_uniform(&s) * (double)v);
        if (c->extras && i % 3 == 1) target[i] = -100;
    }
    const double gscalar = 1.75;
    void *gsc = malloc(8);
    opf_store_elem(gsc, 0, ldt, gscalar);
    double gsc_hi = opf_load_elem(gsc, 0, ldt);
    linear_cross_entropy_problem p = {
        .t = t,
        .h = h,
        .v = v,
        .dt = dt,
        .loss_dt = ldt,
        .grads_dt = ldt, /* the forward's: scaled by linear_cross_entropy_scale into dt */
        .hidden = hid.lo,
        .hidden_strides = {h * hs, hs},
        /* weight read transposed when extras: (V,H) at element v + k V of an (H,V) array */
        .weight = w.lo,
        .weight_strides = {c->extras ? 1 : h, c->extras ? v : 1},
        .target = target,
        .target_stride = 1,
        .bias = c->bias ? b.lo : NULL,
        .bias_stride = 1,
        .ignore_index = -100,
        .label_smoothing = c->extras ? 0.1 : 0.0,
        .softcap = c->extras ? 2.5 : 0.0,
        .reduction = c->reduction,
        .block_floats = c->block_floats};
    linear_cross_entropy_problem ref = p;
    ref.dt = OPF_F64, ref.hidden = hid.hi, ref.weight = w.hi, ref.bias = c->bias ? b.hi : NULL;
    ref.logits_bf16 = dt == OPF_BF16; /* bfloat16 operands: bfloat16 logits, as eager's */
    const int64_t nloss = c->reduction == LINEAR_CROSS_ENTROPY_NONE ? t : 1;
    arr loss = arr_empty(nloss, ldt), lref = arr_empty(nloss, OPF_F64);
    float *lse = malloc((size_t)(t + 1) * sizeof(float)), *lse_ref = malloc((size_t)(t + 1) * sizeof(float));
    arr dh = arr_empty(t * h, dt), dw = arr_empty(v * h, dt), db = arr_empty(v, dt);
    arr fdh = arr_empty(t * h, ldt), fdw = arr_empty(v * h, ldt), fdb = arr_empty(v, ldt); /* the forward's */
    arr rdh = arr_empty(t * h, OPF_F64), rdw = arr_empty(v * h, OPF_F64), rdb = arr_empty(v, OPF_F64);
    double *lse_hi = malloc((size_t)(t + 1) * sizeof(double));
    const char *name = kern->name;

    /* forward: loss and lse; mean / sum with the gradients of the same call */
    const int fused = c->reduction != LINEAR_CROSS_ENTROPY_NONE;
    p.loss = loss.lo, p.lse = lse, ref.loss = lref.hi, ref.lse = lse_ref;
    if (fused) {
        p.dhidden = fdh.lo, p.dweight = fdw.lo, p.dbias = c->bias ? fdb.lo : NULL;
        ref.dhidden = rdh.hi, ref.dweight = rdw.hi, ref.dbias = c->bias ? rdb.hi : NULL;
    }
    double *row = malloc((size_t)(v + 1) * sizeof(double));
    linear_cross_entropy_ref_f64(&ref, row);
    if (run(kern, gemm, &p, "forward") == 0) {
        compare("loss", c, name, loss.lo, ldt, lref.hi, nloss, LOSS_TOL);
        for (int64_t i = 0; i < t; i++) lse_hi[i] = lse_ref[i];
        compare("lse", c, name, lse, OPF_F32, lse_hi, t, LOSS_TOL);
        if (fused) {
            compare("dhidden (forward)", c, name, fdh.lo, ldt, rdh.hi, t * h, tol_of(dt));
            compare("dweight (forward)", c, name, fdw.lo, ldt, rdw.hi, v * h, tol_of(dt));
            if (c->bias) compare("dbias (forward)", c, name, fdb.lo, ldt, rdb.hi, v, tol_of(dt));
            /* the scaling backward: grad * the forward's gradients, rounded once to dt */
            arr sdh = arr_empty(t * h, dt);
            linear_cross_entropy_scale(gemm->cvt, dt, sdh.lo, ldt, fdh.lo, t * h, gsc);
            for (int64_t i = 0; i < t * h; i++) sdh.hi[i] = opf_load_elem(fdh.lo, i, ldt) * gsc_hi;
            compare("dhidden (scaled)", c, name, sdh.lo, dt, sdh.hi, t * h, tol_of(dt) * 0.1);
            arr_free(&sdh);
        }
    }

    /* backward from lse: a scalar gradient (mean, sum) or the per-token one (none) */
    linear_cross_entropy_problem bp = p, br = ref;
    bp.lse_given = br.lse_given = 1;
    bp.grads_dt = dt; /* the backward's gradients: hidden's dtype */
    bp.lse = lse, br.lse = lse_ref;
    bp.grad = c->reduction == LINEAR_CROSS_ENTROPY_NONE ? gtok.lo : gsc, bp.grad_stride = 1;
    br.grad = c->reduction == LINEAR_CROSS_ENTROPY_NONE ? (const void *)gtok.hi : (const void *)&gsc_hi,
    br.grad_stride = 1;
    bp.dhidden = dh.lo, bp.dweight = dw.lo, bp.dbias = c->bias ? db.lo : NULL;
    br.dhidden = rdh.hi, br.dweight = rdw.hi, br.dbias = c->bias ? rdb.hi : NULL;
    memset(dh.lo, 0xff, (size_t)(t * h > 0 ? t * h : 1) * opf_dtype_size(dt)); /* NaN: all must be rewritten */
    memset(dw.lo, 0xff, (size_t)(v * h > 0 ? v * h : 1) * opf_dtype_size(dt));
    linear_cross_entropy_ref_f64(&br, row);
    free(row);
    if (run(kern, gemm, &bp, "backward") == 0) {
        compare("dhidden", c, name, dh.lo, dt, rdh.hi, t * h, tol_of(dt));
        compare("dweight", c, name, dw.lo, dt, rdw.hi, v * h, tol_of(dt));
        if (c->bias) compare("dbias", c, name, db.lo, dt, rdb.hi, v, tol_of(dt));
    }

    if (fused) test_kept(kern, c, &p, &bp, &lref, &rdh, &rdw, &rdb, lse_ref, gscalar);

    /* the same bits at 1 and 2 threads: the backward again at the other count */
    if (t * h > 0 && v * h > 0) {
        size_t es = opf_dtype_size(dt);
        void *dh1 = malloc((size_t)(t * h) * es), *dw1 = malloc((size_t)(v * h) * es);
        memcpy(dh1, dh.lo, (size_t)(t * h) * es), memcpy(dw1, dw.lo, (size_t)(v * h) * es);
        set_threads(1);
        run(kern, gemm_kernels_for(opf_isa_current()), &bp, "backward, 1 thread");
        set_threads(2);
        CHECK(memcmp(dh1, dh.lo, (size_t)(t * h) * es) == 0 && memcmp(dw1, dw.lo, (size_t)(v * h) * es) == 0,
              "%s: T=%lld H=%lld V=%lld dt=%d: gradients differ between 1 and 2 threads", name, (long long)t,
              (long long)h, (long long)v, (int)dt);
        /* one of the two not wanted (NULL): the other the same bits, the unwanted one's memory untouched
         * (a frozen head or hidden) */
        for (int skip = 0; skip < 2; skip++) {
            linear_cross_entropy_problem q = bp;
            arr *left = skip ? &dw : &dh;
            const size_t left_bytes = (size_t)(skip ? v * h : t * h) * es;
            memset(left->lo, 0xff, left_bytes);
            if (skip)
                q.dweight = NULL;
            else
                q.dhidden = NULL;
            run(kern, gemm_kernels_for(opf_isa_current()), &q,
                skip ? "backward without dweight" : "backward without dhidden");
            size_t touched = 0;
            for (size_t e = 0; e < left_bytes; e++) touched += ((const unsigned char *)left->lo)[e] != 0xff;
            CHECK(touched == 0 &&
                      memcmp(skip ? dh1 : dw1, skip ? dh.lo : dw.lo, (size_t)(skip ? t * h : v * h) * es) == 0,
                  "%s: T=%lld H=%lld V=%lld dt=%d: with %s not wanted, %zu of its bytes written or the other differs",
                  name, (long long)t, (long long)h, (long long)v, (int)dt, skip ? "dweight" : "dhidden", touched);
            memcpy(left->lo, skip ? dw1 : dh1, left_bytes);
        }
        free(dh1), free(dw1);
    }

    arr_free(&hid), arr_free(&w), arr_free(&b), arr_free(&gtok), arr_free(&loss), arr_free(&lref);
    arr_free(&dh), arr_free(&dw), arr_free(&db), arr_free(&rdh), arr_free(&rdw), arr_free(&rdb);
    arr_free(&fdh), arr_free(&fdw), arr_free(&fdb);
    free(target), free(gsc), free(lse), free(lse_ref), free(lse_hi);
}

static void test_variant(const linear_cross_entropy_kernels *kern) {
    static const int64_t ts[] = {1, 7, 37}, hs[] = {1, 7, 123}, vs[] = {1, 7, 123, 4097};
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (int ti = 0; ti < 3; ti++)
        for (int hi = 0; hi < 3; hi++)
            for (int vi = 0; vi < 4; vi++)
                for (int di = 0; di < 3; di++)
                    for (int red = 0; red < 3; red++)
                        for (int extras = 0; extras < 2; extras++) {
                            /* the large vocab with every combination only at the largest T and H */
                            if (vs[vi] == 4097 && (ts[ti] != 37 || hs[hi] != 123) && extras) continue;
                            cfg c = {.t = ts[ti],
                                     .h = hs[hi],
                                     .v = vs[vi],
                                     .dt = dts[di],
                                     .reduction = red,
                                     .bias = extras || (ti + vi) % 2,
                                     .extras = extras,
                                     .block_floats = (ti + hi + red) % 2 ? 256 : 0};
                            test_case(kern, &c);
                        }
    /* more tokens than any GEMM's K slice is deep (1024 with AVX-512, 384 with AVX2, 256 in the reference): a
     * float32 forward making the gradients runs chunks of one slice's depth over the whole vocabulary */
    for (int red = 0; red < 3; red++) {
        cfg c = {.t = 1100, .h = 9, .v = 60, .dt = OPF_F32, .reduction = red, .bias = 1, .extras = red == 1};
        test_case(kern, &c);
    }
}

/* the plan's errors: a workspace one float short is refused, not overrun */
static void test_short_workspace(void) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    arr hid = arr_rand(7 * 5, OPF_F32, 1, 1.0), w = arr_rand(9 * 5, OPF_F32, 2, 1.0);
    int64_t target[7] = {0, 1, 2, 3, 4, 5, 8};
    float loss, lse[7];
    linear_cross_entropy_problem p = {.t = 7,
                                      .h = 5,
                                      .v = 9,
                                      .dt = OPF_F32,
                                      .hidden = hid.lo,
                                      .hidden_strides = {5, 1},
                                      .weight = w.lo,
                                      .weight_strides = {5, 1},
                                      .target = target,
                                      .target_stride = 1,
                                      .ignore_index = -100,
                                      .reduction = LINEAR_CROSS_ENTROPY_MEAN,
                                      .loss = &loss,
                                      .lse = lse};
    const linear_cross_entropy_plan plan = linear_cross_entropy_plan_make(gemm, &p, opf_num_threads());
    int64_t floats = linear_cross_entropy_workspace(&plan);
    float *ws = check_ws_alloc(floats - 1);
    CHECK(linear_cross_entropy_run(linear_cross_entropy_kernels_for(opf_isa_current()), &plan, &p, ws, floats - 1) ==
              LINEAR_CROSS_ENTROPY_ERR_WORKSPACE,
          "a short workspace must be refused");
    check_ws_free(ws, "short workspace");
    target[3] = 9;
    CHECK(linear_cross_entropy_bad_target(&p) == 3, "target 9 of 9 classes at 3 must be found, got %lld",
          (long long)linear_cross_entropy_bad_target(&p));
    target[3] = -100;
    CHECK(linear_cross_entropy_bad_target(&p) == -1, "ignore_index is a valid target");
    arr_free(&hid), arr_free(&w);
}

/* count elements of a, all finite (or all not) */
static int64_t count_finite(const double *a, int64_t count) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++) n += isfinite(a[i]) != 0;
    return n;
}

/* Non-finite logits, as torch gives them: a class masked by a -inf bias leaves the loss finite without
 * label smoothing (its term eps / V sum_v z_tv was 0 x -inf = NaN) and +inf with it, the gradients finite
 * either way; a NaN in hidden row 1 makes the loss of token 1, all of dhidden's row 1 and all of dweight
 * NaN (the vector exp clamped NaN to a finite value: a made-up row 1 and NaN in the target's weight rows
 * only). The loss and the backward from lse, both reductions, against the float64 reference. */
static void test_nonfinite_case(const linear_cross_entropy_kernels *kern, int reduction, int smoothing, int nan_row) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    enum { T = 6, H = 16, V = 40 };
    const cfg c = {.t = T, .h = H, .v = V, .dt = OPF_F32, .reduction = reduction, .bias = 1, .extras = smoothing};
    arr hid = arr_rand(T * H, OPF_F32, 3, 1.0), w = arr_rand(V * H, OPF_F32, 4, 0.5), b = arr_rand(V, OPF_F32, 5, 0.5);
    if (nan_row)
        ((float *)hid.lo)[1 * H + 3] = NAN, hid.hi[1 * H + 3] = NAN;
    else
        ((float *)b.lo)[7] = -INFINITY, b.hi[7] = -INFINITY;
    int64_t target[T] = {0, 1, 2, 3, 4, 0};
    const int64_t nloss = reduction == LINEAR_CROSS_ENTROPY_NONE ? T : 1;
    arr loss = arr_empty(nloss, OPF_F32), lref = arr_empty(nloss, OPF_F64), ones = arr_empty(T, OPF_F32);
    arr dh = arr_empty(T * H, OPF_F32), dw = arr_empty(V * H, OPF_F32), db = arr_empty(V, OPF_F32);
    arr rdh = arr_empty(T * H, OPF_F64), rdw = arr_empty(V * H, OPF_F64), rdb = arr_empty(V, OPF_F64);
    for (int64_t i = 0; i < T; i++) ((float *)ones.lo)[i] = 1.0f, ones.hi[i] = 1.0;
    float lse[T], lse_ref[T];
    double row[V];
    linear_cross_entropy_problem p = {.t = T,
                                      .h = H,
                                      .v = V,
                                      .dt = OPF_F32,
                                      .hidden = hid.lo,
                                      .hidden_strides = {H, 1},
                                      .weight = w.lo,
                                      .weight_strides = {H, 1},
                                      .target = target,
                                      .target_stride = 1,
                                      .bias = b.lo,
                                      .bias_stride = 1,
                                      .ignore_index = -100,
                                      .label_smoothing = smoothing ? 0.1 : 0.0,
                                      .reduction = reduction,
                                      .loss = loss.lo,
                                      .lse = lse};
    linear_cross_entropy_problem ref = p;
    ref.dt = OPF_F64, ref.hidden = hid.hi, ref.weight = w.hi, ref.bias = b.hi, ref.loss = lref.hi, ref.lse = lse_ref;
    linear_cross_entropy_ref_f64(&ref, row);
    /* the reference's own loss: what torch gives */
    const int64_t want_finite = nan_row ? (reduction == LINEAR_CROSS_ENTROPY_NONE ? T - 1 : 0) : smoothing ? 0 : nloss;
    CHECK(count_finite(lref.hi, nloss) == want_finite && (nan_row || !smoothing || lref.hi[0] == INFINITY),
          "reference: reduction=%d smoothing=%d nan_row=%d: %lld finite losses of %lld, want %lld (loss[0] %g)",
          reduction, smoothing, nan_row, (long long)count_finite(lref.hi, nloss), (long long)nloss,
          (long long)want_finite, lref.hi[0]);
    if (run(kern, gemm, &p, "non-finite forward") == 0)
        compare("loss (non-finite)", &c, kern->name, loss.lo, OPF_F32, lref.hi, nloss, LOSS_TOL);
    p.lse_given = ref.lse_given = 1;
    p.grad = ones.lo, ref.grad = ones.hi, p.grad_stride = ref.grad_stride = 1; /* 1 per token, or the one of mean */
    p.dhidden = dh.lo, p.dweight = dw.lo, p.dbias = db.lo;
    ref.dhidden = rdh.hi, ref.dweight = rdw.hi, ref.dbias = rdb.hi;
    linear_cross_entropy_ref_f64(&ref, row);
    CHECK(count_finite(rdh.hi, T * H) == T * H - (nan_row ? H : 0) &&
              count_finite(rdw.hi, V * H) == (nan_row ? 0 : V * H),
          "reference: reduction=%d smoothing=%d nan_row=%d: %lld finite of dhidden, %lld of dweight", reduction,
          smoothing, nan_row, (long long)count_finite(rdh.hi, T * H), (long long)count_finite(rdw.hi, V * H));
    if (run(kern, gemm, &p, "non-finite backward") == 0) {
        compare("dhidden (non-finite)", &c, kern->name, dh.lo, OPF_F32, rdh.hi, T * H, tol_of(OPF_F32));
        compare("dweight (non-finite)", &c, kern->name, dw.lo, OPF_F32, rdw.hi, V * H, tol_of(OPF_F32));
        compare("dbias (non-finite)", &c, kern->name, db.lo, OPF_F32, rdb.hi, V, tol_of(OPF_F32));
    }
    arr_free(&hid), arr_free(&w), arr_free(&b), arr_free(&loss), arr_free(&lref), arr_free(&ones);
    arr_free(&dh), arr_free(&dw), arr_free(&db), arr_free(&rdh), arr_free(&rdw), arr_free(&rdb);
}

/* One class (V = 1) with label smoothing, with and without softcap: every log-probability is log 1 = 0, so
 * the loss is exactly 0 (as torch's), not the rounding left by lse - (1 - eps) z_y - eps z, nor that of a
 * target z capped by another tanh than the lse's */
static void test_one_class(const linear_cross_entropy_kernels *kern, double softcap) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    enum { T = 7, H = 5 };
    arr hid = arr_rand(T * H, OPF_F32, 7, 3.0), w = arr_rand(H, OPF_F32, 8, 1.0), loss = arr_empty(T, OPF_F32);
    int64_t target[T] = {0};
    float lse[T];
    double lref[T], row[1];
    linear_cross_entropy_problem p = {.t = T,
                                      .h = H,
                                      .v = 1,
                                      .dt = OPF_F32,
                                      .hidden = hid.lo,
                                      .hidden_strides = {H, 1},
                                      .weight = w.lo,
                                      .weight_strides = {H, 1},
                                      .target = target,
                                      .target_stride = 1,
                                      .ignore_index = -100,
                                      .label_smoothing = 0.1,
                                      .softcap = softcap,
                                      .reduction = LINEAR_CROSS_ENTROPY_NONE,
                                      .loss = loss.lo,
                                      .lse = lse};
    linear_cross_entropy_problem ref = p;
    float lse_ref[T];
    ref.dt = OPF_F64, ref.hidden = hid.hi, ref.weight = w.hi, ref.loss = lref, ref.lse = lse_ref;
    linear_cross_entropy_ref_f64(&ref, row);
    if (run(kern, gemm, &p, "one class") == 0)
        for (int64_t t = 0; t < T; t++)
            CHECK(((float *)loss.lo)[t] == 0.0f && lref[t] == 0.0,
                  "%s: V = 1 with label smoothing, softcap %g: loss[%lld] %g (reference %g), want exactly 0",
                  kern->name, softcap, (long long)t, ((float *)loss.lo)[t], lref[t]);
    arr_free(&hid), arr_free(&w), arr_free(&loss);
}

static void test_nonfinite(const linear_cross_entropy_kernels *kern) {
    for (int reduction = LINEAR_CROSS_ENTROPY_NONE; reduction <= LINEAR_CROSS_ENTROPY_MEAN; reduction++)
        for (int smoothing = 0; smoothing < 2; smoothing++)
            for (int nan_row = 0; nan_row < 2; nan_row++) test_nonfinite_case(kern, reduction, smoothing, nan_row);
    test_one_class(kern, 0.0);
    test_one_class(kern, 2.5);
}

/* bfloat16 with H deeper than every GEMM table's K slice (2048 pairs at most): the bfloat16 logits block
 * then takes the GEMM's float32 partial sums in a block of its own; both plans, bias and the extras */
static void test_deep_bf16(const linear_cross_entropy_kernels *kern) {
    for (int red = 0; red < 3; red++)
        for (int extras = 0; extras < 2; extras++) {
            cfg c = {.t = 21,
                     .h = 2100,
                     .v = 37,
                     .dt = OPF_BF16,
                     .reduction = red,
                     .bias = 1,
                     .extras = extras,
                     .block_floats = extras ? 256 : 0};
            test_case(kern, &c);
        }
}

#define TEST_ALL(k)        \
    do {                   \
        test_variant(k);   \
        test_nonfinite(k); \
        test_deep_bf16(k); \
    } while (0)

/* The Python layer decides whether the blocks span the vocabulary as min(max(t, 1), CHUNK_TOKENS) * max(v, 1) <=
 * BLOCK_FLOATS on sizes that may be symbolic: the kernel's layout must agree, on both sides of the line and at the
 * extremes. */
static int spans_rule(int64_t t, int64_t v) {
    const int64_t c = LINEAR_CROSS_ENTROPY_CHUNK_TOKENS, tt = t < 1 ? 1 : t;
    return (tt < c ? tt : c) * (v < 1 ? 1 : v) <= LINEAR_CROSS_ENTROPY_BLOCK_FLOATS;
}

static void test_vocab_in_one_block_rule(void) {
    const int64_t b = LINEAR_CROSS_ENTROPY_BLOCK_FLOATS, c = LINEAR_CROSS_ENTROPY_CHUNK_TOKENS;
    const int64_t sizes[] = {0,    1,     2,     15,    16,    17,     255,    256,   257,   2047, 2048, 2049,
                             4096, 16383, 16384, 16385, 65536, 262144, 262145, b / 3, b - 1, b,    b + 1};
    const int n = (int)(sizeof sizes / sizeof *sizes);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++) {
            int64_t t = sizes[i], v = sizes[j];
            CHECK(linear_cross_entropy_vocab_in_one_block(t, v) == spans_rule(t, v),
                  "linear_cross_entropy_vocab_in_one_block(%lld, %lld) = %d, the rule says %d", (long long)t,
                  (long long)v, linear_cross_entropy_vocab_in_one_block(t, v), spans_rule(t, v));
        }
        const int64_t t = sizes[i], tt = t < 1 ? 1 : t < c ? t : c;
        for (int64_t v = b / tt - 2; v <= b / tt + 2; v++) {
            if (v < 1) continue;
            CHECK(linear_cross_entropy_vocab_in_one_block(t, v) == spans_rule(t, v),
                  "linear_cross_entropy_vocab_in_one_block(%lld, %lld) = %d at the line", (long long)t, (long long)v,
                  linear_cross_entropy_vocab_in_one_block(t, v));
        }
    }
}

/* A float32 forward that makes the gradients takes blocks up to the weight's size (between the default
 * budget and LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX): chunks of 256 tokens by the whole vocabulary at
 * 260 x 256 -> 16400 (past the default budget); the backward, bfloat16 and an explicit budget keep theirs. */
static void test_grads_block_budget(void) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    float dummy;
    linear_cross_entropy_problem p = {
        .t = 260, .h = 256, .v = 16400, .dt = OPF_F32, .grads_dt = OPF_F32, .dhidden = &dummy, .dweight = &dummy};
    linear_cross_entropy_plan l = linear_cross_entropy_plan_make(gemm, &p, 2);
    CHECK(l.tc == 256 && l.vb == 16400, "float32 forward with gradients: blocks %lld x %lld, want 256 x 16400",
          (long long)l.tc, (long long)l.vb);
    linear_cross_entropy_problem q = p;
    q.lse_given = 1;
    l = linear_cross_entropy_plan_make(gemm, &q, 2);
    CHECK(l.vb < q.v, "the backward keeps the default budget: blocks %lld x %lld", (long long)l.tc, (long long)l.vb);
    q = p, q.dt = OPF_BF16;
    l = linear_cross_entropy_plan_make(gemm, &q, 2);
    CHECK(l.vb < q.v, "bfloat16 keeps the default budget: blocks %lld x %lld", (long long)l.tc, (long long)l.vb);
    q = p, q.block_floats = 256;
    l = linear_cross_entropy_plan_make(gemm, &q, 2);
    CHECK(l.tc * l.vb <= 256, "an explicit budget holds: blocks %lld x %lld", (long long)l.tc, (long long)l.vb);
    q = p, q.v = 1 << 20, q.h = 4096; /* a weight of 4G floats: the block is capped */
    l = linear_cross_entropy_plan_make(gemm, &q, 2);
    CHECK(l.tc * l.vb <= LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX && l.tc * l.vb > LINEAR_CROSS_ENTROPY_BLOCK_FLOATS,
          "the budget is capped: blocks %lld x %lld", (long long)l.tc, (long long)l.vb);
}

/* A provider of the test's own: claims every product and runs it on opforge's kernels with a workspace
 * (and a float32 C for partial sums) of its own; or, declining, takes nothing. */
static int provider_declines, provider_ran;

static int own_run(const gemm_call *k) {
    if (provider_declines) return 0;
    const gemm_plan *g = k->plan;
    const int64_t floats = gemm_workspace(g);
    float *ws = malloc((size_t)(floats > 0 ? floats : 1) * sizeof(float));
    float *c = k->c ? k->c : malloc((size_t)(g->m * k->rsc) * sizeof(float)); /* out16's partial sums */
    const int rc = gemm_run_own(g, k->a, k->rsa, k->csa, k->b, k->rsb, k->csb, c, k->rsc, k->ep, ws, floats);
    if (c != k->c) free(c);
    free(ws);
    provider_ran++;
    return rc == 0;
}

static int claims_all(const gemm_call *k) { return 1; }

/* The backward reading kept du under a provider that claims its products: the plan claimed (no packing,
 * no float32 scratch of 16-bit gradients), the gradients those of the unclaimed plan; a provider that
 * declines the claimed products after all: LINEAR_CROSS_ENTROPY_ERR_DECLINED, and the unclaimed plan runs. */
static void test_kept_claimed(void) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const linear_cross_entropy_kernels *kern = linear_cross_entropy_kernels_for(opf_isa_current());
    static const gemm_provider claiming = {.name = "claiming", .run = own_run, .claims = claims_all};
    for (int di = 0; di < 2; di++) {
        const opf_dtype dt = di ? OPF_BF16 : OPF_F32;
        const int64_t t = 37, h = 123, v = 4097;
        const size_t es = opf_dtype_size(dt);
        arr hid = arr_rand(t * h, dt, 1, 1.0), w = arr_rand(v * h, dt, 2, 0.2), b = arr_rand(v, dt, 3, 0.5);
        int64_t *target = malloc((size_t)t * sizeof(int64_t));
        for (int64_t i = 0; i < t; i++) target[i] = i % 5 == 2 ? -100 : (i * 811) % v;
        float loss, *lse = malloc((size_t)t * sizeof(float)), g = 0.625f;
        void *dl = malloc((size_t)(t * v) * es);
        linear_cross_entropy_problem p = {.t = t,
                                          .h = h,
                                          .v = v,
                                          .dt = dt,
                                          .loss_dt = OPF_F32,
                                          .grads_dt = dt,
                                          .hidden = hid.lo,
                                          .hidden_strides = {h, 1},
                                          .weight = w.lo,
                                          .weight_strides = {h, 1},
                                          .target = target,
                                          .target_stride = 1,
                                          .bias = b.lo,
                                          .bias_stride = 1,
                                          .ignore_index = -100,
                                          .reduction = LINEAR_CROSS_ENTROPY_MEAN,
                                          .loss = &loss,
                                          .lse = lse,
                                          .dlogits = dl};
        run(kern, gemm, &p, "forward, du kept");
        void *got[2][3];
        for (int claimed = 0; claimed < 2; claimed++) {
            linear_cross_entropy_problem q = p;
            q.lse_given = 1, q.grad = &g;
            q.dhidden = got[claimed][0] = malloc((size_t)(t * h) * es);
            q.dweight = got[claimed][1] = malloc((size_t)(v * h) * es);
            q.dbias = got[claimed][2] = malloc((size_t)v * es);
            gemm_provider_set(claimed ? &claiming : NULL);
            linear_cross_entropy_plan plan = linear_cross_entropy_plan_make(gemm, &q, opf_num_threads());
            const int64_t unclaimed = linear_cross_entropy_workspace(&plan);
            linear_cross_entropy_plan_claim(&plan, &q);
            CHECK(plan.claimed == claimed, "dt=%d: claimed %d under %s", (int)dt, plan.claimed,
                  claimed ? "a claiming provider" : "none");
            int64_t floats = linear_cross_entropy_workspace(&plan);
            if (claimed) /* the per-token sums, the bias and dbias' float32 scratch: no packing, no dhidden block */
                CHECK(floats == 4 * t + 2 * v * (dt == OPF_BF16) + v * (dt == OPF_F32) && floats < unclaimed,
                      "dt=%d: a claimed plan's workspace is %lld floats (unclaimed %lld)", (int)dt, (long long)floats,
                      (long long)unclaimed);
            float *ws = check_ws_alloc(floats);
            provider_ran = 0;
            provider_declines = 0;
            int rc = linear_cross_entropy_run(kern, &plan, &q, ws, floats);
            CHECK(rc == 0 && provider_ran == 2 * claimed, "dt=%d claimed=%d: rc %d, the provider ran %d products",
                  (int)dt, claimed, rc, provider_ran);
            if (claimed) { /* declined after all: the caller runs it again unclaimed */
                provider_declines = 1;
                rc = linear_cross_entropy_run(kern, &plan, &q, ws, floats);
                CHECK(rc == LINEAR_CROSS_ENTROPY_ERR_DECLINED, "dt=%d: a declined claimed product returned %d", (int)dt,
                      rc);
            }
            check_ws_free(ws, "kept du, claimed");
            gemm_provider_set(NULL);
        }
        const int64_t counts[3] = {t * h, v * h, v};
        for (int k = 0; k < 3; k++)
            CHECK(memcmp(got[0][k], got[1][k], (size_t)counts[k] * es) == 0,
                  "dt=%d: gradient %d differs between the claimed and the unclaimed plan", (int)dt, k);
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 3; k++) free(got[c][k]);
        arr_free(&hid), arr_free(&w), arr_free(&b);
        free(target), free(lse), free(dl);
    }
}

int main(void) {
    set_threads(2);
    CHECK_EACH_VARIANT(linear_cross_entropy_kernels_for, TEST_ALL);
    test_kept_claimed();
    test_short_workspace();
    test_vocab_in_one_block_rule();
    test_grads_block_budget();
    return check_report("test_linear_cross_entropy");
}
