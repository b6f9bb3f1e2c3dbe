/*
 * The fused linear of every compiled GEMM variant against the float64
 * reference path of the same module: forward (out, preact) with and without
 * bias, each activation, float32 / bfloat16 / float16, x contiguous,
 * transposed, as several matrices that do not merge and as ones that do; odd
 * shapes; row counts around the backward's chunk boundary at 1-3 threads; a
 * 16-bit forward whose float32 C is made in row chunks; and the backward in
 * both strategies (in place over a donated preact, chunked), with preact
 * recomputed; the plans a GEMM provider claims (one product each, no
 * workspace), and a claim declined after all. Every workspace sits between
 * guard words, sized exactly as the workspace function says.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the thread count per test */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/linear.h"
#include "check.h"

/* x layouts: (m, K) contiguous; (m, K) transposed (with grad transposed too);
 * (3, rows, K) matrices of padded rows and column stride 2 (do not merge);
 * (3, rows, K) contiguous (merge into one) */
enum { X_CONTIGUOUS, X_TRANSPOSED, X_MATRICES, X_MERGING, X_LAYOUTS };

typedef struct cfg {
    int64_t rows, k, n; /* rows of one matrix of x: m = rows, or 3 rows for the 3-d layouts */
    int layout, bias, act;
    opf_dtype dt;
    int save;         /* the forward stores preact; without, the backward recomputes it */
    int forward_only; /* shapes too large for the float64 backward in a test */
} cfg;

/* an array of count elements of dt and its exact float64 copy */
typedef struct arr {
    void *lo;
    double *hi;
} arr;

static int in_place_runs; /* the in-place strategy must be reached, not only allowed for */
static int direct_runs;   /* and the direct one */

/* A GEMM provider of the test's own (gemm.h) that claims every product (gemm_provider_claims) and runs
 * it by the float32 oracle on float32 copies of the operands, finished by gemm_finish; with decline_at
 * N > 0, the Nth claimed call since claimed_calls was reset is declined after all (a mode changed
 * after the plan: the ones before it wrote their results), with N = -1 every one: the entry points
 * answer LINEAR_ERR_DECLINED and the tests run them again unclaimed, as the glue does. */
static int decline_at, claimed_calls, provider_runs, claimed_plans, claimed_backwards, declined_runs;

static float *dense_f32(const void *src, opf_dtype dt, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    float *d = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(float));
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) d[i * cols + j] = (float)opf_load_elem(src, i * rs + j * cs, dt);
    return d;
}

static int claiming_run(const gemm_call *k) {
    if (k->claimed && (decline_at < 0 || ++claimed_calls == decline_at)) return 0;
    const gemm_plan *p = k->plan;
    const int64_t m = p->m, n = p->n, kk = p->k;
    float *a = dense_f32(k->a, p->ta, m, kk, k->rsa, k->csa), *b = dense_f32(k->b, p->tb, kk, n, k->rsb, k->csb);
    float *prod = malloc((size_t)(m * n) * sizeof(float));
    const gemm_epilogue plain = {0};
    gemm_ref_f32(m, n, kk, a, kk, 1, b, n, 1, prod, n, &plain);
    gemm_finish(p, prod, OPF_F32, n, k->ep->beta != 0.0f, k->c, k->rsc, k->ep);
    free(a), free(b), free(prod);
    provider_runs++;
    return 1;
}

static int claiming_claims(const gemm_call *k) { return k->plan->m > 0; }

static const gemm_provider claiming = {.name = "claiming", .run = claiming_run, .claims = claiming_claims};

static arr arr_rand(int64_t count, opf_dtype dt, unsigned long long seed, double amp) {
    size_t c = (size_t)(count > 0 ? count : 1);
    arr a = {malloc(c * opf_dtype_size(dt)), malloc(c * sizeof(double))};
    seed = seed * 2654435761ull + 1;
    for (int64_t i = 0; i < count; i++) {
        opf_store_elem(a.lo, i, dt, (check_uniform(&seed) * 2.0 - 1.0) * amp);
        a.hi[i] = opf_load_elem(a.lo, i, dt);
    }
    return a;
}

/* filled with NaN, as output arrays are: a kernel that leaves one unwritten shows */
static arr arr_empty(int64_t count, opf_dtype dt) {
    size_t c = (size_t)(count > 0 ? count : 1);
    arr a = {malloc(c * opf_dtype_size(dt)), malloc(c * sizeof(double))};
    memset(a.lo, 0xff, c * opf_dtype_size(dt));
    return a;
}

static void arr_free(arr *a) { free(a->lo), free(a->hi); }

/* max |got - want| over count contiguous elements relative to max |want| (at least 1) */
static void compare(const char *what, const cfg *c, const char *variant, const void *got, const double *want,
                    int64_t count) {
    const double tol = c->dt == OPF_F32 ? 1e-4 : c->dt == OPF_F16 ? 1e-2 : 3e-2;
    double err = 0.0, mag = 1.0;
    int64_t worst = -1;
    for (int64_t i = 0; i < count; i++) {
        double g = opf_load_elem(got, i, c->dt), e = fabs(g - want[i]);
        mag = fmax(mag, fabs(want[i]));
        if (!(e <= err)) err = e, worst = i; /* a NaN is the worst */
    }
    CHECK(worst < 0 || err / mag <= tol,
          "%s %s: rows=%lld K=%lld N=%lld layout=%d bias=%d act=%d dt=%d save=%d: index %lld got %g want %g, "
          "max error %g of %g",
          variant, what, (long long)c->rows, (long long)c->k, (long long)c->n, c->layout, c->bias, c->act, (int)c->dt,
          c->save, (long long)worst, worst < 0 ? 0.0 : opf_load_elem(got, worst, c->dt), worst < 0 ? 0.0 : want[worst],
          err, mag);
}

/* the leading dims and strides of an x-like (..., cols) array in the layout; returns the elements it spans */
static int64_t layout_of(int layout, int64_t rows, int64_t cols, int64_t *ndim, int64_t *sizes, int64_t *strides) {
    switch (layout) {
    case X_TRANSPOSED:
        *ndim = 2, sizes[0] = rows, sizes[1] = cols, strides[0] = 1, strides[1] = rows;
        return rows * cols;
    case X_MATRICES:
        *ndim = 3, sizes[0] = 3, sizes[1] = rows, sizes[2] = cols;
        strides[0] = (rows + 1) * cols * 2, strides[1] = cols * 2, strides[2] = 2;
        return 3 * (rows + 1) * cols * 2;
    case X_MERGING:
        *ndim = 3, sizes[0] = 3, sizes[1] = rows, sizes[2] = cols;
        strides[0] = rows * cols, strides[1] = cols, strides[2] = 1;
        return 3 * rows * cols;
    default: *ndim = 2, sizes[0] = rows, sizes[1] = cols, strides[0] = cols, strides[1] = 1; return rows * cols;
    }
}

static void run(const gemm_kernels *gemm, cfg c) {
    const int64_t m = c.layout >= X_MATRICES ? 3 * c.rows : c.rows, k = c.k, n = c.n;
    const char *name = gemm->name;
    int64_t xsizes[3], xstrides[3], gsizes[3], gstrides[3], xdim, gdim;
    int64_t xcount = layout_of(c.layout, c.rows, k, &xdim, xsizes, xstrides);
    /* grad: transposed with a transposed x, else contiguous */
    int64_t gcount = layout_of(c.layout == X_TRANSPOSED   ? X_TRANSPOSED
                               : c.layout == X_CONTIGUOUS ? X_CONTIGUOUS
                                                          : X_MERGING,
                               c.rows, n, &gdim, gsizes, gstrides);
    const int64_t bias_stride = c.layout == X_MATRICES ? 3 : 1;
    arr x = arr_rand(xcount, c.dt, 1 + (unsigned long long)(m * 31 + k), 1.0);
    arr w = arr_rand(n * k, c.dt, 2 + (unsigned long long)n, 1.0 / sqrt((double)(k > 0 ? k : 1)));
    arr b = arr_rand(n * bias_stride, c.dt, 3, 0.5), grad = arr_rand(gcount, c.dt, 4, 1.0);
    arr out = arr_empty(m * n, c.dt), pre = arr_empty(m * n, c.dt);
    linear_problem p = {.n = n,
                        .k = k,
                        .dt = c.dt,
                        .act = c.act,
                        .x = {x.lo, xdim, xsizes, xstrides},
                        .weight = w.lo,
                        .bias = c.bias ? b.lo : NULL,
                        .bias_stride = bias_stride,
                        .out = out.lo,
                        .preact = c.act && c.save ? pre.lo : NULL};
    if (c.layout == X_TRANSPOSED)
        p.weight_strides[0] = 1, p.weight_strides[1] = n;
    else
        p.weight_strides[0] = k, p.weight_strides[1] = 1;
    /* the reference: the same views over the float64 copies, preact always stored */
    linear_problem r = p;
    r.dt = OPF_F64, r.x.data = x.hi, r.weight = w.hi, r.bias = c.bias ? b.hi : NULL, r.out = out.hi, r.preact = pre.hi;
    const int64_t threads = opf_num_threads(); /* each plan's, as the glue reads it */
    const linear_fwd_plan ref_plan = linear_fwd_plan_make(gemm, &r, threads);
    CHECK(linear_fwd_workspace(&ref_plan) == 0 && linear_fwd(&ref_plan, &r, NULL, 0) == 0, "float64 forward refused");

    linear_fwd_plan fwd = linear_fwd_plan_make(gemm, &p, threads);
    linear_fwd_plan_claim(&fwd, &p); /* nothing without a provider */
    int64_t wsn = linear_fwd_workspace(&fwd);
    if (fwd.product.claimed) {
        claimed_plans++;
        CHECK(wsn == (c.bias ? n : 0), "%s: a claimed forward's workspace is %lld floats, not the bias's", name,
              (long long)wsn);
    }
    float *ws = check_ws_alloc(wsn);
    int rc = linear_fwd(&fwd, &p, ws, wsn);
    check_ws_free(ws, "forward");
    if (rc == LINEAR_ERR_DECLINED) { /* the glue's answer: the plan unclaimed, with its workspace */
        CHECK(decline_at != 0, "%s: a claimed forward declined with a provider that does not", name);
        declined_runs++;
        fwd = linear_fwd_plan_make(gemm, &p, threads);
        wsn = linear_fwd_workspace(&fwd);
        ws = check_ws_alloc(wsn);
        rc = linear_fwd(&fwd, &p, ws, wsn);
        check_ws_free(ws, "forward, run again unclaimed");
    }
    CHECK(rc == 0, "%s forward refused its workspace of %lld floats", name, (long long)wsn);
    compare("out", &c, name, out.lo, out.hi, m * n);
    if (p.preact) compare("preact", &c, name, pre.lo, pre.hi, m * n);
    if (c.forward_only) {
        arr_free(&x), arr_free(&w), arr_free(&b), arr_free(&grad), arr_free(&out), arr_free(&pre);
        return;
    }

    /* backward: the reference from its float64 preact, then each strategy this problem has */
    arr dx = arr_empty(m * k, c.dt), dw = arr_empty(n * k, c.dt), db = arr_empty(n, c.dt);
    r.grad = (linear_view){grad.hi, gdim, gsizes, gstrides};
    r.saved_preact = (linear_view){c.act ? pre.hi : NULL, 2, (int64_t[]){m, n}, (int64_t[]){n, 1}};
    r.dx = dx.hi, r.dweight = dw.hi, r.dbias = c.bias ? db.hi : NULL;
    const linear_bwd_plan ref_bwd = linear_bwd_plan_make(gemm, &r, 0, threads);
    wsn = linear_bwd_workspace(&ref_bwd);
    ws = check_ws_alloc(wsn);
    CHECK(linear_bwd(&ref_bwd, &r, ws, wsn) == 0, "float64 backward refused");
    check_ws_free(ws, "float64 backward");

    void *donated = malloc((size_t)(m * n > 0 ? m * n : 1) * opf_dtype_size(c.dt));
    for (int in_place = 0; in_place < 2; in_place++) {
        if (p.preact) memcpy(donated, pre.lo, (size_t)(m * n) * opf_dtype_size(c.dt));
        linear_problem q = p;
        q.grad = (linear_view){grad.lo, gdim, gsizes, gstrides};
        q.saved_preact = (linear_view){p.preact ? donated : NULL, 2, (int64_t[]){m, n}, (int64_t[]){n, 1}};
        q.dx = dx.lo, q.dweight = dw.lo, q.dbias = c.bias ? db.lo : NULL;
        const size_t es = opf_dtype_size(c.dt); /* NaN in every output: one the strategy leaves unwritten shows */
        memset(dx.lo, 0xff, (size_t)(m * k) * es), memset(dw.lo, 0xff, (size_t)(n * k) * es);
        memset(db.lo, 0xff, (size_t)n * es);
        linear_bwd_plan bwd = linear_bwd_plan_make(gemm, &q, in_place, threads);
        linear_bwd_plan_claim(&bwd, &q);
        const linear_bwd_strategy s = bwd.strategy;
        CHECK(s == LINEAR_BWD_DIRECT || !(bwd.in_place.dx.claimed || bwd.in_place.dweight.claimed),
              "%s: a backward of strategy %d was claimed", name, (int)s);
        claimed_backwards += bwd.in_place.dx.claimed;
        if (in_place && s != LINEAR_BWD_IN_PLACE) break; /* only the chunked or the direct strategy applies */
        in_place_runs += in_place;
        direct_runs += s == LINEAR_BWD_DIRECT;
        CHECK(in_place || s != LINEAR_BWD_IN_PLACE, "%s: strategy in place without a donated preact", name);
        CHECK(s != LINEAR_BWD_DIRECT || !c.act, "%s: strategy direct with an activation", name);
        wsn = linear_bwd_workspace(&bwd);
        ws = check_ws_alloc(wsn);
        rc = linear_bwd(&bwd, &q, ws, wsn);
        check_ws_free(ws, in_place ? "backward in place" : c.act && !p.preact ? "backward recomputing" : "backward");
        if (rc == LINEAR_ERR_DECLINED) {
            declined_runs++;
            bwd = linear_bwd_plan_make(gemm, &q, in_place, threads);
            wsn = linear_bwd_workspace(&bwd);
            ws = check_ws_alloc(wsn);
            rc = linear_bwd(&bwd, &q, ws, wsn);
            check_ws_free(ws, "backward, run again unclaimed");
        }
        CHECK(rc == 0, "%s backward %d refused its workspace of %lld floats", name, (int)s, (long long)wsn);
        const char *tag = in_place                 ? "in place"
                          : s == LINEAR_BWD_DIRECT ? "direct"
                          : c.act && !p.preact     ? "recomputed"
                                                   : "chunked";
        char what[64];
        snprintf(what, sizeof what, "dx (%s)", tag);
        compare(what, &c, name, dx.lo, dx.hi, m * k);
        snprintf(what, sizeof what, "dweight (%s)", tag);
        compare(what, &c, name, dw.lo, dw.hi, n * k);
        snprintf(what, sizeof what, "dbias (%s)", tag);
        if (c.bias) compare(what, &c, name, db.lo, db.hi, n);
    }
    /* a gradient not wanted (NULL): its GEMM skipped and its memory untouched, the others right */
    for (int skip = 0; skip < 2 && m * k > 0 && n * k > 0; skip++) {
        linear_problem q = p;
        q.grad = (linear_view){grad.lo, gdim, gsizes, gstrides};
        q.saved_preact = (linear_view){p.preact ? pre.lo : NULL, 2, (int64_t[]){m, n}, (int64_t[]){n, 1}};
        q.dx = skip ? dx.lo : NULL, q.dweight = skip ? NULL : dw.lo, q.dbias = c.bias ? db.lo : NULL;
        const size_t es = opf_dtype_size(c.dt);
        memset(dx.lo, 0xff, (size_t)(m * k) * es), memset(dw.lo, 0xff, (size_t)(n * k) * es);
        linear_bwd_plan bwd = linear_bwd_plan_make(gemm, &q, 0, threads);
        linear_bwd_plan_claim(&bwd, &q);
        wsn = linear_bwd_workspace(&bwd);
        ws = check_ws_alloc(wsn);
        rc = linear_bwd(&bwd, &q, ws, wsn);
        check_ws_free(ws, skip ? "backward without dweight" : "backward without dx");
        if (rc == LINEAR_ERR_DECLINED) {
            bwd = linear_bwd_plan_make(gemm, &q, 0, threads);
            wsn = linear_bwd_workspace(&bwd);
            ws = check_ws_alloc(wsn);
            rc = linear_bwd(&bwd, &q, ws, wsn);
            check_ws_free(ws, "backward with a gradient not wanted, run again unclaimed");
        }
        CHECK(rc == 0, "%s backward without %s refused its workspace", name, skip ? "dweight" : "dx");
        const unsigned char *left = skip ? dw.lo : dx.lo;
        const size_t left_bytes = (size_t)(skip ? n * k : m * k) * es;
        size_t touched = 0;
        for (size_t e = 0; e < left_bytes; e++) touched += left[e] != 0xff;
        CHECK(touched == 0, "%s: %zu bytes of the unwanted %s written", name, touched, skip ? "dweight" : "dx");
        if (skip)
            compare("dx (dweight not wanted)", &c, name, dx.lo, dx.hi, m * k);
        else
            compare("dweight (dx not wanted)", &c, name, dw.lo, dw.hi, n * k);
        if (c.bias) compare("dbias (one not wanted)", &c, name, db.lo, db.hi, n);
    }
    /* one float short: refused, nothing written outside */
    linear_problem q = p;
    q.grad = (linear_view){grad.lo, gdim, gsizes, gstrides};
    q.saved_preact = (linear_view){NULL, 2, (int64_t[]){m, n}, (int64_t[]){n, 1}};
    q.dx = dx.lo, q.dweight = dw.lo, q.dbias = c.bias ? db.lo : NULL;
    const linear_bwd_plan chunked = linear_bwd_plan_make(gemm, &q, 0, threads);
    wsn = linear_bwd_workspace(&chunked) - 1;
    ws = check_ws_alloc(wsn);
    rc = linear_bwd(&chunked, &q, ws, wsn);
    check_ws_free(ws, "backward, one float short");
    CHECK(rc == LINEAR_ERR_WORKSPACE, "%s: a backward workspace one float short was not refused (%d)", name, rc);

    free(donated);
    arr_free(&x), arr_free(&w), arr_free(&b), arr_free(&grad), arr_free(&out), arr_free(&pre);
    arr_free(&dx), arr_free(&dw), arr_free(&db);
}

static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};

static void set_threads(int threads) {
    char env[8];
    snprintf(env, sizeof env, "%d", threads);
    setenv("OPFORGE_NUM_THREADS", env, 1);
}

static void test_variant(const gemm_kernels *gemm) {
    /* every activation, bias, dtype, layout and saving of preact on odd shapes */
    const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {0, 5, 3}, {33, 40, 19}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (int layout = 0; layout < X_LAYOUTS; layout++)
            for (size_t d = 0; d < 3; d++)
                for (int act = 0; act < ACT_COUNT; act++)
                    for (int bias = 0; bias < 2; bias++)
                        for (int save = 0; save < 2; save++)
                            run(gemm,
                                (cfg){shapes[s][0], shapes[s][1], shapes[s][2], layout, bias, act, dtypes[d], save, 0});
    for (size_t d = 0; d < 3; d++)
        for (int layout = 0; layout < X_LAYOUTS; layout++) {
            run(gemm, (cfg){123, 77, 301, layout, 1, ACT_GELU, dtypes[d], 1, 0});
            run(gemm, (cfg){123, 77, 301, layout, 0, ACT_SILU, dtypes[d], 0, 0});
        }
    /* row counts around the backward's chunk boundary at 1-3 threads. A wide N makes the chunk a little over
     * one MC block of rows: at one thread the full chunk packs A a block per worker and a last chunk of
     * 3/4 of it packs all of A, the larger workspace of the two */
    const char *saved = getenv("OPFORGE_NUM_THREADS");
    char saved_copy[32] = "";
    if (saved) snprintf(saved_copy, sizeof saved_copy, "%s", saved);
    const int64_t wide = 16000, chunk = linear_chunk_rows(1 << 20, wide);
    CHECK(chunk > gemm->mc && chunk < 2 * gemm->mc + 8, "chunk of %lld rows for N=%lld: the boundary test misses it",
          (long long)chunk, (long long)wide);
    const int64_t rows[] = {chunk, chunk + 1, chunk + 3 * chunk / 4, 2 * chunk - 1};
    for (int threads = 1; threads <= 3; threads++) {
        set_threads(threads);
        /* each dtype, with preact stored and recomputed, meets each row count over the thread counts */
        for (size_t i = 0; i < 4; i++) {
            int turn = (int)i + threads;
            run(gemm, (cfg){rows[i], 7, wide, X_CONTIGUOUS, 1, turn % 2 ? ACT_GELU : ACT_GELU_TANH, dtypes[turn % 3],
                            turn % 2, 0});
        }
        if (threads == 2) {
            run(gemm, (cfg){rows[1], 5, wide, X_MATRICES, 0, ACT_RELU, OPF_F32, 1, 0});
            run(gemm, (cfg){rows[2], 5, wide, X_TRANSPOSED, 1, ACT_NONE, OPF_BF16, 0, 0});
        }
    }
    /* 16-bit results over several K slices: the forward's float32 C in row chunks, the last one short */
    set_threads(2);
    for (size_t d = 1; d < 3; d++) {
        const int64_t n = ((int64_t)2 << 20) / 64, k = gemm_slice_depth(gemm, dtypes[d], dtypes[d]) + 3;
        run(gemm, (cfg){linear_chunk_rows(1 << 20, n) + 1, k, n, X_CONTIGUOUS, 1, ACT_SILU, dtypes[d], 1, 1});
    }
    if (saved)
        setenv("OPFORGE_NUM_THREADS", saved_copy, 1);
    else
        unsetenv("OPFORGE_NUM_THREADS");
    CHECK(in_place_runs > 0, "%s: no problem ran the backward in place", gemm->name);
    CHECK(direct_runs > 0, "%s: no problem ran the backward direct", gemm->name);
    in_place_runs = direct_runs = 0;
}

/* matmul, forward and backward, batched (a, b and grad strided through their batch), b transposed or
 * not, under the claiming provider: against the float64 path, each entry point run again unclaimed
 * where a claim is declined (matmul's glue does the same) */
static void run_matmul(const gemm_kernels *gemm, int64_t batch, int64_t m, int64_t k, int64_t n, opf_dtype dt,
                       int b_transposed) {
    const cfg c = {m, k, n, 0, 0, 0, dt, 0, 0}; /* compare()'s tolerance and message */
    arr a = arr_rand(batch * m * k, dt, 11, 1.0), b = arr_rand(batch * k * n, dt, 12, 1.0 / sqrt((double)k));
    arr g = arr_rand(batch * m * n, dt, 13, 1.0);
    arr out = arr_empty(batch * m * n, dt), da = arr_empty(batch * m * k, dt), db = arr_empty(batch * k * n, dt);
    int64_t asz[3] = {batch, m, k}, ast[3] = {m * k, k, 1}, bsz[3] = {batch, k, n};
    int64_t bst[3] = {k * n, b_transposed ? 1 : n, b_transposed ? k : 1}, gsz[3] = {batch, m, n},
            gst[3] = {m * n, n, 1};
    const int64_t threads = opf_num_threads();
    for (int hi = 1; hi >= 0; hi--) { /* the float64 reference into .hi first, then the claimed plans into .lo */
        const opf_dtype t = hi ? OPF_F64 : dt;
        const linear_view av = {hi ? (void *)a.hi : a.lo, 3, asz, ast}, bv = {hi ? (void *)b.hi : b.lo, 3, bsz, bst};
        const linear_view gv = {hi ? (void *)g.hi : g.lo, 3, gsz, gst};
        void *o = hi ? (void *)out.hi : out.lo, *dap = hi ? (void *)da.hi : da.lo, *dbp = hi ? (void *)db.hi : db.lo;
        for (int twice = 0; twice < 2; twice++) { /* claimed, then (if declined) unclaimed */
            matmul_fwd_plan f = matmul_fwd_plan_make(gemm, t, batch, m, n, k, threads);
            if (!twice) matmul_fwd_plan_claim(&f, &av, &bv);
            CHECK(hi || twice || f.product.claimed, "%s: a matmul forward was not claimed", gemm->name);
            float *ws = check_ws_alloc(matmul_fwd_workspace(&f));
            const int rc = matmul_fwd(&f, o, &av, &bv, ws, matmul_fwd_workspace(&f));
            check_ws_free(ws, "matmul forward");
            CHECK(rc == 0 || (rc == LINEAR_ERR_DECLINED && !twice), "%s: matmul forward returned %d", gemm->name, rc);
            declined_runs += rc != 0;
            if (rc == 0) break;
        }
        for (int twice = 0; twice < 2; twice++) {
            matmul_bwd_plan bw = matmul_bwd_plan_make(gemm, t, batch, m, n, k, threads);
            if (!twice) matmul_bwd_plan_claim(&bw, &gv, &av, &bv);
            float *ws = check_ws_alloc(matmul_bwd_workspace(&bw));
            const int rc = matmul_bwd(&bw, dap, dbp, &gv, &av, &bv, ws, matmul_bwd_workspace(&bw));
            check_ws_free(ws, "matmul backward");
            CHECK(rc == 0 || (rc == LINEAR_ERR_DECLINED && !twice), "%s: matmul backward returned %d", gemm->name, rc);
            declined_runs += rc != 0;
            if (rc == 0) break;
        }
    }
    compare("matmul out", &c, gemm->name, out.lo, out.hi, batch * m * n);
    compare("matmul da", &c, gemm->name, da.lo, da.hi, batch * m * k);
    compare("matmul db", &c, gemm->name, db.lo, db.hi, batch * k * n);
    arr_free(&a), arr_free(&b), arr_free(&g), arr_free(&out), arr_free(&da), arr_free(&db);
}

/* The plans a provider claims: one product each, no workspace but the bias's, the outputs right; and
 * claims declined after all -- every one, or the Nth of an op's calls after N - 1 wrote their results
 * (a later matrix of x, dweight after dx, a later batch of matmul) -- each op then run again unclaimed */
static void test_claims(const gemm_kernels *gemm) {
    gemm_provider_set(&claiming);
    for (decline_at = -1; decline_at <= 4; decline_at++) {
        claimed_plans = claimed_backwards = provider_runs = declined_runs = 0;
        for (size_t d = 0; d < 3; d++)
            for (int layout = 0; layout < X_LAYOUTS; layout++) {
                claimed_calls = 0;
                run(gemm, (cfg){33, 40, 19, layout, 1, ACT_NONE, dtypes[d], 0, 0});
                claimed_calls = 0;
                run(gemm, (cfg){7, 13, 5, layout, 0, ACT_NONE, dtypes[d], 0, 0});
                if (decline_at > 1) continue;
                claimed_calls = 0;
                run(gemm, (cfg){123, 77, 301, layout, 1, ACT_GELU, dtypes[d], 1, 0});
            }
        for (size_t d = 0; d < 2; d++)
            for (int bt = 0; bt < 2; bt++) {
                claimed_calls = 0;
                run_matmul(gemm, 3, 21, 35, 17, dtypes[d], bt);
            }
        /* 16-bit results over several K slices, which unclaimed keep float32 partial sums in row chunks */
        const int64_t n = ((int64_t)2 << 20) / 64, k = gemm_slice_depth(gemm, OPF_BF16, OPF_BF16) + 3;
        claimed_calls = 0;
        if (decline_at == 0)
            run(gemm, (cfg){linear_chunk_rows(1 << 20, n) + 1, k, n, X_CONTIGUOUS, 1, ACT_SILU, OPF_BF16, 1, 1});
        CHECK(claimed_plans > 0 && claimed_backwards > 0, "%s: %d forward and %d backward plans claimed", gemm->name,
              claimed_plans, claimed_backwards);
        if (decline_at)
            CHECK(declined_runs > 0, "%s: no declined claim (at %d) was run again", gemm->name, decline_at);
        else
            CHECK(provider_runs > 0 && declined_runs == 0, "%s: the claiming provider ran %d products, %d declined",
                  gemm->name, provider_runs, declined_runs);
    }
    decline_at = 0;
    gemm_provider_set(NULL);
    in_place_runs = direct_runs = 0;
}

int main(void) {
    CHECK_EACH_VARIANT(gemm_kernels_for, test_variant);
    CHECK_EACH_VARIANT(gemm_kernels_for, test_claims);
    return check_report("test_linear");
}
