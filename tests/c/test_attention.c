/*
 * Every compiled attention variant against the double-precision oracle:
 * forward (out, lse) and backward (dq, dk, dv) on odd lengths (1, 7, 129,
 * 1000), head dims 16..256, causal and not, grouped-query heads, boolean and
 * additive masks with broadcast dims, fully masked rows, transposed (B, N, H,
 * D) and strided layouts, float32 and bfloat16; few query blocks (one head,
 * N = 1 to 200, S up to 1000: the forward splits a lone query block's keys into
 * chunks; built with -D ATTENTION_FWD_MIN_TASKS=64 as test_attention_split, it
 * splits almost every shape here, causal, masked and grouped ones too); the
 * forward and backward bitwise the same on 1 to 4 threads, run after run; the
 * backward's key blocks cut into chunks (shapes with few key-block tasks), its
 * plan and its bits on 1 to 64 threads; workspaces exactly as sized, between
 * guard words; empty shapes; the float64 oracle at a scale float32 cannot hold.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the standalone thread count is OPFORGE_NUM_THREADS */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../../csrc/kernels/attention.h"
#include "check.h"

typedef struct cfg {
    int64_t b, h, hkv, n, s, d, dv;
    int causal, mask; /* mask: 0 none, 1 bool (N,S) broadcast, 2 additive (B,1,N,S), 3 bool with empty rows,
                       * 4 additive with rows at float32's lowest */
    int layout;       /* 0 contiguous, 1 (B,N,H,D) transposed, 2 element stride 2 */
    opf_dtype dt;
} cfg;

static size_t esize(opf_dtype dt) { return opf_dtype_size(dt); }

/* a (b, h, n, d) tensor in the given layout: strides and element count */
static int64_t layout(int lay, int64_t b, int64_t h, int64_t n, int64_t d, int64_t *st) {
    (void)b;
    if (lay == 1) {
        st[0] = n * h * d, st[1] = d, st[2] = h * d, st[3] = 1;
    } else if (lay == 2) {
        st[0] = h * n * d * 2, st[1] = n * d * 2, st[2] = d * 2, st[3] = 2;
        return b * h * n * d * 2;
    } else {
        st[0] = h * n * d, st[1] = n * d, st[2] = d, st[3] = 1;
    }
    return b * h * n * d;
}

static void *rand_tensor(int64_t count, opf_dtype dt, unsigned long long seed, double amp) {
    void *p = malloc((size_t)(count > 0 ? count : 1) * esize(dt));
    for (int64_t i = 0; i < count; i++) {
        opf_store_elem(p, i, dt, (float)((check_uniform(&seed) * 2.0 - 1.0) * amp));
    }
    return p;
}

/* max |got - want| over the (b, h, n, d) elements, relative to max |want| */
static double rel_err(const void *got, const void *want, const int64_t *st, int64_t b, int64_t h, int64_t n, int64_t d,
                      opf_dtype dt) {
    double err = 0.0, mag = 0.1; /* errors of values below 0.1 count as absolute */
    for (int64_t ib = 0; ib < b; ib++)
        for (int64_t ih = 0; ih < h; ih++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t e = 0; e < d; e++) {
                    int64_t o = ib * st[0] + ih * st[1] + i * st[2] + e * st[3];
                    double g = opf_load_elem(got, o, dt), w = opf_load_elem(want, o, dt);
                    if (isnan(g) != isnan(w)) return INFINITY;
                    err = fmax(err, fabs(g - w));
                    mag = fmax(mag, fabs(w));
                }
    return err / mag;
}

/* the oracle, on scratch of its own */
static void oracle_fwd(const attention_problem *p) {
    double *scratch = malloc(sizeof(double) * (size_t)attention_ref_fwd_doubles(p));
    attention_ref_fwd(p, scratch);
    free(scratch);
}

static void oracle_bwd(const attention_problem *p) {
    double *scratch = malloc(sizeof(double) * (size_t)attention_ref_bwd_doubles(p));
    attention_ref_bwd(p, scratch);
    free(scratch);
}

/* the driver under a plan made at this run's thread count, as the glue makes it, with a workspace of
 * exactly the plan's size between guard words */
static void run_fwd(const attention_kernels *k, const attention_problem *p) {
    const attention_fwd_plan plan = attention_fwd_plan_make(k, p, opf_num_threads());
    float *ws = check_ws_alloc(attention_fwd_workspace(&plan));
    attention_fwd(k, &plan, p, ws);
    check_ws_free(ws, "attention_fwd");
}

static void run_bwd(const attention_kernels *k, const attention_problem *p) {
    const attention_bwd_plan plan = attention_bwd_plan_make(p, opf_num_threads());
    float *ws = check_ws_alloc(attention_bwd_workspace(&plan));
    attention_bwd(k, &plan, p, ws);
    check_ws_free(ws, "attention_bwd");
}

static void set_threads(int n) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", n);
    setenv("OPFORGE_NUM_THREADS", buf, 1);
}

/* the (b, h, n, d) elements of got and want bit for bit (the gaps of strided layouts aside) */
static int same_bits(const void *got, const void *want, const int64_t *st, int64_t b, int64_t h, int64_t n, int64_t d,
                     opf_dtype dt) {
    for (int64_t ib = 0; ib < b; ib++)
        for (int64_t ih = 0; ih < h; ih++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t e = 0; e < d; e++) {
                    size_t o = (size_t)(ib * st[0] + ih * st[1] + i * st[2] + e * st[3]) * esize(dt);
                    if (memcmp((const char *)got + o, (const char *)want + o, esize(dt)) != 0) return 0;
                }
    return 1;
}

/* check_bwd_bits' thread counts: 1, 2 (three times) and 4, or (wide_threads, test_bwd_key_split) 1, 3,
 * 16 and 64 twice, the thread counts of users' machines, oversubscribed here */
static int wide_threads;

/* attention_bwd again on 1, 2 (three times) and 4 threads (more than the cores of a
 * small machine: workers lose their core mid-task): dq, dk, dv must equal the
 * first run's bit for bit */
static void check_bwd_bits(const attention_kernels *k, attention_problem p, const void *dq, const void *dk,
                           const void *dv, size_t nq, size_t nk, size_t nv) {
    const char *env = getenv("OPFORGE_NUM_THREADS");
    char *threads0 = env ? strdup(env) : NULL;
    void *gq = malloc(nq + 1), *gk = malloc(nk + 1), *gv = malloc(nv + 1);
    p.dq = gq, p.dk = gk, p.dv = gv;
    const int narrow[5] = {1, 2, 2, 2, 4}, wide[5] = {1, 3, 16, 64, 64}, *runs = wide_threads ? wide : narrow;
    for (int r = 0; r < 5; r++) {
        set_threads(runs[r]);
        memset(gq, 0x7f, nq), memset(gk, 0x7f, nk), memset(gv, 0x7f, nv);
        run_bwd(k, &p);
        CHECK(same_bits(gq, dq, p.dqs, p.b, p.h, p.n, p.d_qk, p.dt) &&
                  same_bits(gk, dk, p.dks, p.b, p.hkv, p.s, p.d_qk, p.dt) &&
                  same_bits(gv, dv, p.dvs, p.b, p.hkv, p.s, p.d_v, p.dt),
              "%s b=%lld h=%lld hkv=%lld n=%lld s=%lld causal=%d: backward on %d threads (check %d) differs from the "
              "first run",
              k->name, (long long)p.b, (long long)p.h, (long long)p.hkv, (long long)p.n, (long long)p.s, p.causal,
              runs[r], r + 1);
    }
    if (threads0)
        setenv("OPFORGE_NUM_THREADS", threads0, 1);
    else
        unsetenv("OPFORGE_NUM_THREADS");
    free(threads0), free(gq), free(gk), free(gv);
}

/* attention_fwd again on 1, 2, 3, 4 and 16 threads: out and lse must equal the first run's bit for bit
 * (split into key chunks or not, by the shape alone; the tasks pulled head by head, block by block, or
 * head by head but for a tail of heads, by the tasks per thread) */
static void check_fwd_bits(const attention_kernels *k, attention_problem p, const void *out, const float *lse,
                           size_t no) {
    const char *env = getenv("OPFORGE_NUM_THREADS");
    char *threads0 = env ? strdup(env) : NULL;
    const size_t nl = (size_t)(p.b * p.h * p.n) * sizeof(float);
    void *go = malloc(no + 1);
    float *gl = malloc(nl + sizeof(float));
    p.out = go, p.lse = gl;
    const int runs[5] = {1, 2, 3, 4, 16};
    for (int r = 0; r < 5; r++) {
        set_threads(runs[r]);
        memset(go, 0x7f, no), memset(gl, 0x7f, nl);
        run_fwd(k, &p);
        CHECK(same_bits(go, out, p.os, p.b, p.h, p.n, p.d_v, p.dt) && memcmp(gl, lse, nl) == 0,
              "%s b=%lld h=%lld n=%lld s=%lld causal=%d: forward on %d threads (check %d) differs from the first run",
              k->name, (long long)p.b, (long long)p.h, (long long)p.n, (long long)p.s, p.causal, runs[r], r + 1);
    }
    if (threads0)
        setenv("OPFORGE_NUM_THREADS", threads0, 1);
    else
        unsetenv("OPFORGE_NUM_THREADS");
    free(threads0), free(go), free(gl);
}

/* bfloat16 on a table whose products run on packed operands: the table without the packing (every
 * operand staged in float32 and packed per product) gives the same bits, forward and backward */
static void check_packed_bits(const attention_kernels *k, attention_problem p, const void *out, const float *lse,
                              const void *dq, const void *dk, const void *dv, size_t no, size_t nq, size_t nk,
                              size_t nv) {
    if (!k->packing || p.dt != OPF_BF16) return;
    attention_kernels staged = *k;
    staged.packing = NULL;
    const size_t nl = (size_t)(p.b * p.h * p.n);
    void *go = calloc(no + 1, 2), *gq = calloc(nq + 1, 2), *gk = calloc(nk + 1, 2), *gv = calloc(nv + 1, 2);
    float *gl = calloc(nl + 1, sizeof(float));
    p.out = go, p.lse = gl, p.dq = gq, p.dk = gk, p.dv = gv;
    run_fwd(&staged, &p);
    run_bwd(&staged, &p);
    CHECK(
        same_bits(go, out, p.os, p.b, p.h, p.n, p.d_v, p.dt) && memcmp(gl, lse, nl * sizeof(float)) == 0 &&
            same_bits(gq, dq, p.dqs, p.b, p.h, p.n, p.d_qk, p.dt) &&
            same_bits(gk, dk, p.dks, p.b, p.hkv, p.s, p.d_qk, p.dt) &&
            same_bits(gv, dv, p.dvs, p.b, p.hkv, p.s, p.d_v, p.dt),
        "%s b=%lld h=%lld hkv=%lld n=%lld s=%lld d=%lld dv=%lld causal=%d: packed products differ from the staged ones",
        k->name, (long long)p.b, (long long)p.h, (long long)p.hkv, (long long)p.n, (long long)p.s, (long long)p.d_qk,
        (long long)p.d_v, p.causal);
    free(go), free(gq), free(gk), free(gv), free(gl);
}

/* dout_expanded: dO one element broadcast (every stride 0), the gradient of out.sum() */
static void run_dout(const attention_kernels *k, cfg c, int dout_expanded) {
    attention_problem p = {.b = c.b,
                           .h = c.h,
                           .hkv = c.hkv,
                           .n = c.n,
                           .s = c.s,
                           .d_qk = c.d,
                           .d_v = c.dv,
                           .dt = c.dt,
                           .causal = c.causal,
                           .scale = 1.0 / sqrt((double)c.d)};
    int64_t nq = layout(c.layout, c.b, c.h, c.n, c.d, p.qs), nk = layout(c.layout, c.b, c.hkv, c.s, c.d, p.ks);
    int64_t nv = layout(c.layout, c.b, c.hkv, c.s, c.dv, p.vs), no = layout(c.layout, c.b, c.h, c.n, c.dv, p.os);
    memcpy(p.dos, p.os, sizeof p.os), memcpy(p.dqs, p.qs, sizeof p.qs);
    if (dout_expanded) memset(p.dos, 0, sizeof p.dos);
    memcpy(p.dks, p.ks, sizeof p.ks), memcpy(p.dvs, p.vs, sizeof p.vs);
    void *q = rand_tensor(nq, c.dt, 11 + (unsigned long long)c.n, 2.0), *kk = rand_tensor(nk, c.dt, 12, 2.0);
    void *v = rand_tensor(nv, c.dt, 13, 1.0), *dout = rand_tensor(no, c.dt, 14, 1.0);
    p.q = q, p.k = kk, p.v = v, p.dout = dout;
    void *mask = NULL;
    if (c.mask == 1 || c.mask == 3) { /* bool (N, S), broadcast over b and h */
        mask = malloc((size_t)(c.n * c.s + 1));
        unsigned long long seed = 21;
        for (int64_t i = 0; i < c.n; i++)
            for (int64_t j = 0; j < c.s; j++)
                ((uint8_t *)mask)[i * c.s + j] = (c.mask == 3 && i % 5 == 2) ? 0 : check_uniform(&seed) < 0.7;
        p.mask_kind = ATTENTION_MASK_BOOL;
        p.ms[0] = p.ms[1] = 0, p.ms[2] = c.s, p.ms[3] = 1;
    } else if (c.mask == 2 || c.mask == 4) { /* additive (B, 1, N, S) in the inputs' dtype, some -inf */
        mask = rand_tensor(c.b * c.n * c.s, c.dt, 22, 3.0);
        for (int64_t i = 0; i < c.b * c.n * c.s; i += 7) opf_store_elem(mask, i, c.dt, -INFINITY);
        if (c.mask == 4) /* or: every key of some rows at float32's lowest (torch's masks), uniform weights */
            for (int64_t i = 0; i < c.b * c.n * c.s; i++)
                opf_store_elem(mask, i, c.dt, i / c.s % 2 ? -FLT_MAX : -1.0 - (double)(i % 3));
        p.mask_kind = ATTENTION_MASK_ADD, p.mask_dt = c.dt;
        p.ms[0] = c.n * c.s, p.ms[1] = 0, p.ms[2] = c.s, p.ms[3] = 1;
    }
    p.mask = mask;
    attention_problem want = p;
    void *out = calloc((size_t)no + 1, esize(c.dt)), *wout = calloc((size_t)no + 1, esize(c.dt));
    float *lse = calloc((size_t)(c.b * c.h * c.n + 1), sizeof(float)),
          *wlse = calloc((size_t)(c.b * c.h * c.n + 1), sizeof(float));
    void *dq = calloc((size_t)nq + 1, esize(c.dt)), *dk = calloc((size_t)nk + 1, esize(c.dt)),
         *dv = calloc((size_t)nv + 1, esize(c.dt));
    void *wdq = calloc((size_t)nq + 1, esize(c.dt)), *wdk = calloc((size_t)nk + 1, esize(c.dt)),
         *wdv = calloc((size_t)nv + 1, esize(c.dt));
    p.out = out, p.lse = lse, p.dq = dq, p.dk = dk, p.dv = dv;
    want.out = wout, want.lse = wlse, want.dq = wdq, want.dk = wdk, want.dv = wdv;

    oracle_fwd(&want);
    oracle_bwd(&want);
    run_fwd(k, &p);
    run_bwd(k, &p);

    check_fwd_bits(k, p, out, lse, (size_t)no * esize(c.dt));
    check_bwd_bits(k, p, dq, dk, dv, (size_t)nq * esize(c.dt), (size_t)nk * esize(c.dt), (size_t)nv * esize(c.dt));
    check_packed_bits(k, p, out, lse, dq, dk, dv, (size_t)no, (size_t)nq, (size_t)nk, (size_t)nv);

    const double tol = c.dt == OPF_BF16 ? 1.6e-2 : 2e-5, gtol = c.dt == OPF_BF16 ? 3e-2 : 1e-4;
    double lerr = 0.0;
    for (int64_t i = 0; i < c.b * c.h * c.n; i++) {
        if (isinf(wlse[i]) || isinf(lse[i])) {
            if (wlse[i] != lse[i]) lerr = INFINITY;
        } else {
            lerr = fmax(lerr, fabs((double)lse[i] - wlse[i]));
        }
    }
    double eo = rel_err(out, wout, p.os, c.b, c.h, c.n, c.dv, c.dt);
    double eq = rel_err(dq, wdq, p.qs, c.b, c.h, c.n, c.d, c.dt);
    double ek = rel_err(dk, wdk, p.ks, c.b, c.hkv, c.s, c.d, c.dt);
    double ev = rel_err(dv, wdv, p.vs, c.b, c.hkv, c.s, c.dv, c.dt);
    if (c.mask == 4) /* the forward only: a float32 lse of -FLT_MAX + ln S is -FLT_MAX, so the backward
                      * recomputes such a row's P as 1, not 1 / S (torch's flash kernels too) */
        eq = ek = ev = 0.0;
    CHECK(eo <= tol && lerr <= 1e-4 && eq <= gtol && ek <= gtol && ev <= gtol,
          "%s b=%lld h=%lld hkv=%lld n=%lld s=%lld d=%lld dv=%lld causal=%d mask=%d layout=%d %s: "
          "out %.3g lse %.3g dq %.3g dk %.3g dv %.3g",
          k->name, (long long)c.b, (long long)c.h, (long long)c.hkv, (long long)c.n, (long long)c.s, (long long)c.d,
          (long long)c.dv, c.causal, c.mask, c.layout, c.dt == OPF_BF16 ? "bf16" : "f32", eo, lerr, eq, ek, ev);
    free(q), free(kk), free(v), free(dout), free(mask), free(out), free(wout), free(lse), free(wlse);
    free(dq), free(dk), free(dv), free(wdq), free(wdk), free(wdv);
}

static void run(const attention_kernels *k, cfg c) { run_dout(k, c, 0); }

static double as_bf16(float x) { return opf_bf16_to_f32(opf_f32_to_bf16(x)); }

static void test_mm(const attention_kernels *k) {
    /* the block matmul on every tail shape, with strided A and accumulation; the
     * bfloat16 product (where the table has one) against its operands rounded */
    const int64_t shapes[][3] = {{1, 1, 1}, {6, 16, 3},   {7, 17, 5}, {13, 9, 64},
                                 {5, 8, 2}, {64, 64, 64}, {3, 40, 7}, {70, 35, 301}};
    for (int bf = 0; bf < 2; bf++) {
        if (bf && !k->mm_bf16) continue;
        const attention_mm_fn mm = bf ? k->mm_bf16 : k->mm;
        for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
            int64_t m = shapes[t][0], n = shapes[t][1], kd = shapes[t][2];
            for (int trans = 0; trans < 2; trans++)
                for (int acc = 0; acc < 2; acc++) {
                    float *a = rand_tensor(m * kd, OPF_F32, 1, 1.0), *b = rand_tensor(kd * (n + 3), OPF_F32, 2, 1.0);
                    float *cc = rand_tensor(m * (n + 1), OPF_F32, 3, 1.0),
                          *want = malloc(sizeof(float) * (size_t)(m * (n + 1)));
                    memcpy(want, cc, sizeof(float) * (size_t)(m * (n + 1)));
                    int64_t rsa = trans ? 1 : kd, csa = trans ? m : 1;
                    mm(m, n, kd, a, rsa, csa, b, n + 3, cc, n + 1, acc);
                    double err = 0.0;
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < n + 1; j++) {
                            double s = j < n && acc ? want[i * (n + 1) + j] : 0.0;
                            for (int64_t p = 0; p < kd && j < n; p++) {
                                const float x = a[i * rsa + p * csa], y = b[p * (n + 3) + j];
                                s += bf ? as_bf16(x) * as_bf16(y) : (double)x * y;
                            }
                            if (j == n) s = want[i * (n + 1) + j]; /* the padding column is never written */
                            err = fmax(err, fabs(cc[i * (n + 1) + j] - s));
                        }
                    CHECK(err < 1e-4 * (kd > 64 ? 4 : 1), "%s mm%s m=%lld n=%lld k=%lld trans=%d acc=%d: error %g",
                          k->name, bf ? "_bf16" : "", (long long)m, (long long)n, (long long)kd, trans, acc, err);
                    free(a), free(b), free(cc), free(want);
                }
        }
    }
}

/* transpose and scale_rows: exact (a copy; one product an element), so bit for bit the scalar result, on
 * every tail of a 16 x 16 (8 x 8) block, row strides wider than the rows, elements around left alone; NaN
 * and infinite factors and values pass through as the scalar product's */
static void test_rows(const attention_kernels *k) {
    const int64_t shapes[][2] = {{1, 1}, {64, 64}, {16, 16}, {17, 33}, {5, 80}, {64, 7}, {31, 256}, {8, 9}};
    for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
        const int64_t rows = shapes[t][0], cols = shapes[t][1], lds = cols + 3, ldd = rows + 5;
        float *src = rand_tensor(rows * lds, OPF_F32, 11 + t, 2.0), *dst = rand_tensor(cols * ldd, OPF_F32, 5, 1.0);
        float *want = malloc(sizeof(float) * (size_t)(cols * ldd));
        memcpy(want, dst, sizeof(float) * (size_t)(cols * ldd));
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) want[c * ldd + r] = src[r * lds + c];
        k->transpose(dst, ldd, src, lds, rows, cols);
        CHECK(memcmp(dst, want, sizeof(float) * (size_t)(cols * ldd)) == 0, "%s transpose %lldx%lld: differs", k->name,
              (long long)rows, (long long)cols);
        float *f = rand_tensor(rows, OPF_F32, 7, 3.0), *out = rand_tensor(rows * (cols + 1), OPF_F32, 8, 1.0);
        f[0] = rows > 1 ? NAN : 1.0f, f[rows - 1] = rows > 2 ? INFINITY : f[rows - 1];
        src[lds - 1] = rows > 1 ? -INFINITY : src[lds - 1];
        float *want2 = malloc(sizeof(float) * (size_t)(rows * (cols + 1)));
        memcpy(want2, out, sizeof(float) * (size_t)(rows * (cols + 1)));
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) want2[r * (cols + 1) + c] = src[r * lds + c] * f[r];
        k->scale_rows(out, cols + 1, src, lds, rows, cols, f);
        k->scale_rows(src, lds, src, lds, rows, cols, f); /* in place */
        int same = memcmp(out, want2, sizeof(float) * (size_t)(rows * (cols + 1))) == 0;
        for (int64_t r = 0; r < rows; r++)
            same = same && memcmp(src + r * lds, want2 + r * (cols + 1), sizeof(float) * (size_t)cols) == 0;
        CHECK(same, "%s scale_rows %lldx%lld: differs", k->name, (long long)rows, (long long)cols);
        free(src), free(dst), free(want), free(f), free(out), free(want2);
    }
}

/* The packed products (where the table has them) against mm_bf16 on the same values, bit for bit: A from
 * 16-bit rows, float32 rows and float32 columns; B from 16-bit rows and 16-bit rows read as columns */
static void test_packed_mm(const attention_kernels *k) {
    const attention_bf16_packing *pk = k->packing;
    if (!pk) return;
    const int64_t shapes[][3] = {{1, 1, 1},  {6, 16, 3},    {7, 17, 5},    {13, 9, 64}, {64, 64, 64},
                                 {3, 40, 7}, {64, 33, 255}, {50, 70, 256}, {64, 64, 17}};
    for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
        const int64_t m = shapes[t][0], n = shapes[t][1], kd = shapes[t][2], rs = kd + 3, bs = n + 5;
        uint16_t *a16 = rand_tensor(m * rs, OPF_BF16, 31, 2.0), *b16 = rand_tensor(kd * bs, OPF_BF16, 32, 2.0);
        uint16_t *bt16 = malloc(sizeof(uint16_t) * (size_t)(n * (kd + 1) + 1));
        float *a32 = malloc(sizeof(float) * (size_t)(m * rs + 1)), *at32 = malloc(sizeof(float) * (size_t)(kd * m + 1));
        float *b32 = malloc(sizeof(float) * (size_t)(kd * bs + 1));
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < kd; p++) a32[i * rs + p] = at32[p * m + i] = opf_bf16_to_f32(a16[i * rs + p]);
        for (int64_t p = 0; p < kd; p++)
            for (int64_t j = 0; j < n; j++) {
                b32[p * bs + j] = opf_bf16_to_f32(b16[p * bs + j]);
                bt16[j * (kd + 1) + p] = b16[p * bs + j];
            }
        /* the driver's buffers: ATTENTION_PACK_MC rows along K or K's padded pairs along columns */
        const size_t apn = (size_t)(ATTENTION_PACK_MC * ATTENTION_PACK_KP),
                     bpn = (size_t)((n + 31) / 32 * attention_packed_pairs(kd) * 32);
        uint32_t *ap = malloc(apn * sizeof(uint32_t)), *bp = malloc(bpn * sizeof(uint32_t));
        float *want = malloc(sizeof(float) * (size_t)(m * (n + 1) + 1)),
              *got = malloc(sizeof(float) * (size_t)(m * (n + 1) + 1));
        for (int form = 0; form < 6; form++) { /* A: rows16, rows32, cols32; B: b16, bt16 */
            const int af = form % 3, bf = form / 3, acc = form % 2;
            float *c0 = rand_tensor(m * (n + 1), OPF_F32, 33, 1.0);
            memcpy(want, c0, sizeof(float) * (size_t)(m * (n + 1)));
            memcpy(got, c0, sizeof(float) * (size_t)(m * (n + 1)));
            /* what the workspace held before (NaN pairs): the packing writes every pair the product reads */
            memset(ap, 0xff, apn * sizeof(uint32_t));
            memset(bp, 0xff, bpn * sizeof(uint32_t));
            k->mm_bf16(m, n, kd, a32, rs, 1, b32, bs, want, n + 1, acc);
            if (af == 0) pk->a_rows16(ap, a16, rs, m, kd);
            if (af == 1) pk->a_rows32(ap, a32, rs, m, kd);
            if (af == 2) pk->a_cols32(ap, at32, m, m, kd);
            if (bf == 0) pk->b16(bp, b16, bs, kd, n);
            if (bf == 1) pk->bt16(bp, bt16, kd + 1, kd, n);
            pk->mm(m, n, kd, ap, af != 2, bp, got, n + 1, acc);
            CHECK(memcmp(got, want, sizeof(float) * (size_t)(m * (n + 1))) == 0,
                  "%s packed mm m=%lld n=%lld k=%lld A form %d B form %d acc=%d: not mm_bf16's bits", k->name,
                  (long long)m, (long long)n, (long long)kd, af, bf, acc);
            free(c0);
        }
        free(a16), free(b16), free(bt16), free(a32), free(at32), free(b32), free(ap), free(bp), free(want), free(got);
    }
}

static void test_variant(const attention_kernels *k) {
    test_mm(k);
    test_rows(k);
    test_packed_mm(k);
    const int64_t lens[] = {1, 7, 129};
    const int64_t dims[] = {16, 40, 64, 80, 128, 256};
    for (size_t a = 0; a < 3; a++)
        for (size_t b = 0; b < 3; b++)
            for (int causal = 0; causal < 2; causal++)
                run(k, (cfg){1, 2, 1, lens[a], lens[b], 64, 64, causal, 0, 0, OPF_F32});
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++)
        for (int causal = 0; causal < 2; causal++)
            run(k, (cfg){2, 2, 2, 77, 91, dims[d], dims[d], causal, 0, (int)d % 3, OPF_F32});
    run(k, (cfg){1, 1, 1, 1000, 1000, 64, 64, 1, 0, 1, OPF_F32}); /* long, causal, one head */
    run(k, (cfg){1, 3, 1, 1000, 200, 32, 48, 0, 0, 0, OPF_F32});  /* long, MQA, dv != d */
    run(k, (cfg){2, 6, 2, 130, 70, 40, 40, 1, 0, 1, OPF_F32});    /* GQA, transposed, causal */
    run(k, (cfg){2, 4, 2, 65, 129, 64, 64, 0, 1, 0, OPF_F32});    /* bool mask */
    run(k, (cfg){2, 4, 4, 65, 129, 64, 64, 1, 2, 2, OPF_F32});    /* additive mask + causal, strided */
    run(k, (cfg){1, 2, 2, 50, 33, 16, 16, 0, 3, 0, OPF_F32});     /* fully masked rows */
    run(k, (cfg){2, 4, 2, 129, 100, 64, 64, 1, 0, 1, OPF_BF16});  /* bfloat16 */
    run(k, (cfg){1, 2, 1, 70, 70, 80, 80, 0, 2, 2, OPF_BF16});    /* bfloat16, mask, strided */
    run(k, (cfg){3, 4, 1, 200, 300, 32, 32, 1, 0, 0, OPF_F32});   /* 3 groups: whole on 1 thread, key blocks on 2 */
    /* few query blocks (fewer than the forward's minimum of tasks): each block's
     * keys in chunks of whole key blocks, merged in chunk order; at the default
     * minimum only one head's lone query block without a causal mask splits */
    const int64_t split_n[] = {1, 7, 64, 65, 95, 96, 97, 200}, split_s[] = {1, 64, 65, 96, 97, 193, 200, 1000};
    for (size_t a = 0; a < 8; a++)
        for (size_t b = 0; b < 8; b++)
            for (int causal = 0; causal < 2; causal++)
                run(k, (cfg){1, 1, 1, split_n[a], split_s[b], 64, 64, causal, 0, 0, OPF_F32});
    run(k, (cfg){1, 1, 1, 64, 64, 64, 64, 0, 0, 0, OPF_BF16}); /* bfloat16, one block: 32 and 16 queries */
    run(k, (cfg){1, 1, 1, 64, 64, 64, 64, 1, 0, 1, OPF_BF16});
    run(k, (cfg){1, 1, 1, 20, 50, 80, 80, 1, 2, 2, OPF_BF16});    /* bfloat16, 16 and 4 queries, mask */
    run(k, (cfg){1, 2, 1, 65, 300, 40, 40, 1, 1, 0, OPF_F32});    /* MQA, bool mask + causal */
    run(k, (cfg){1, 1, 1, 7, 1000, 24, 24, 0, 2, 2, OPF_F32});    /* additive mask, strided */
    run(k, (cfg){1, 1, 1, 50, 300, 16, 16, 0, 3, 0, OPF_F32});    /* fully masked rows */
    run(k, (cfg){1, 4, 2, 64, 700, 72, 72, 1, 0, 1, OPF_F32});    /* GQA, causal, transposed */
    run(k, (cfg){1, 3, 3, 200, 129, 33, 17, 0, 0, 0, OPF_F32});   /* odd head dims */
    run(k, (cfg){2, 1, 1, 1, 999, 7, 9, 0, 0, 2, OPF_F32});       /* one query, odd dims, strided */
    run(k, (cfg){1, 1, 1, 200, 1000, 64, 64, 1, 0, 0, OPF_BF16}); /* bfloat16, causal */
    run(k, (cfg){1, 2, 1, 65, 500, 80, 80, 0, 1, 1, OPF_BF16});   /* bfloat16, bool mask, transposed */
    run(k, (cfg){2, 8, 2, 256, 256, 64, 64, 1, 0, 0, OPF_BF16});  /* bfloat16, the default GPT's heads */
    run(k, (cfg){1, 3, 3, 130, 97, 33, 17, 1, 0, 0, OPF_BF16});   /* bfloat16, odd head dims */
    run(k, (cfg){1, 2, 1, 70, 66, 256, 256, 0, 2, 1, OPF_BF16});  /* bfloat16, head dims at one packed chunk */
    run(k, (cfg){1, 2, 2, 40, 70, 264, 264, 1, 0, 0, OPF_BF16});  /* bfloat16, past it: staged products */
    /* bfloat16 with an expanded gradient (every dO stride 0): its rows copied before they are packed */
    run_dout(k, (cfg){2, 4, 2, 129, 100, 64, 64, 1, 0, 0, OPF_BF16}, 1);
    run_dout(k, (cfg){1, 2, 2, 70, 70, 80, 80, 0, 1, 1, OPF_BF16}, 1);
    /* few queries (N <= 4: the flash-decoding driver): every mask kind, both causal alignments' meeting
     * point (top-left here), GQA, strides, odd dims, keys over several decode chunks, bfloat16 */
    const int64_t few_n[] = {1, 2, 3, 4, 5}, few_s[] = {1, 5, 64, 300, 1500};
    for (size_t a = 0; a < 5; a++)
        for (size_t b = 0; b < 5; b++)
            for (int mk = 0; mk < 4; mk++)
                run(k, (cfg){2, 4, 2, few_n[a], few_s[b], 40, 24, (int)(a + b + (size_t)mk) % 2, mk,
                             (int)(a + (size_t)mk) % 3, OPF_F32});
    run(k, (cfg){1, 32, 8, 1, 2100, 128, 128, 0, 0, 0, OPF_F32}); /* decoding: GQA 4, chunks */
    run(k, (cfg){3, 6, 1, 3, 777, 7, 9, 1, 2, 2, OPF_F32});       /* MQA, causal, additive mask, strided */
    run(k, (cfg){2, 4, 4, 4, 500, 64, 64, 0, 1, 1, OPF_BF16});    /* bfloat16, bool mask, transposed */
    run(k, (cfg){1, 8, 2, 2, 999, 80, 80, 1, 2, 0, OPF_BF16});    /* bfloat16, causal, additive mask */
    run(k, (cfg){2, 2, 1, 1, 700, 16, 16, 0, 4, 0, OPF_F32});     /* rows masked by float32's lowest alone */
    /* empty: no query, no key (zeros, lse -inf), no batch, no head */
    run(k, (cfg){2, 2, 1, 0, 7, 16, 16, 0, 0, 0, OPF_F32});
    run(k, (cfg){2, 2, 1, 9, 0, 16, 16, 1, 0, 0, OPF_F32});
    run(k, (cfg){2, 2, 1, 9, 0, 16, 16, 0, 1, 2, OPF_BF16});
    run(k, (cfg){0, 2, 2, 9, 7, 16, 16, 0, 0, 0, OPF_F32});
    run(k, (cfg){2, 0, 0, 9, 7, 16, 16, 0, 0, 0, OPF_F32});
    run(k, (cfg){2, 0, 2, 9, 70, 16, 16, 1, 0, 1, OPF_F32});
}

/* The float64 oracle (the op's float64 path) keeps the scale in double: 0.3
 * and 1/sqrt(3) are not float32 numbers, and rounding them costs ~1e-8. */
static void test_oracle_scale(void) {
    const double q[3] = {0.7, -1.3, 2.1}, k[2][3] = {{1.1, 0.4, -0.9}, {-0.2, 1.7, 0.6}}, v[2] = {1.5, -2.5};
    const double scales[2] = {0.3, 1.0 / sqrt(3.0)};
    for (int t = 0; t < 2; t++) {
        double out = 0.0, dq[3] = {0};
        float lse;
        attention_problem p = {.b = 1,
                               .h = 1,
                               .hkv = 1,
                               .n = 1,
                               .s = 2,
                               .d_qk = 3,
                               .d_v = 1,
                               .dt = OPF_F64,
                               .scale = scales[t],
                               .q = q,
                               .k = k,
                               .v = v,
                               .qs = {3, 3, 3, 1},
                               .ks = {6, 6, 3, 1},
                               .vs = {2, 2, 1, 1},
                               .out = &out,
                               .os = {1, 1, 1, 1},
                               .lse = &lse};
        oracle_fwd(&p);
        double x[2], w[2], dw = 0.0;
        for (int j = 0; j < 2; j++) x[j] = scales[t] * (q[0] * k[j][0] + q[1] * k[j][1] + q[2] * k[j][2]);
        const double m = fmax(x[0], x[1]), z = exp(x[0] - m) + exp(x[1] - m);
        for (int j = 0; j < 2; j++) w[j] = exp(x[j] - m) / z;
        const double want = w[0] * v[0] + w[1] * v[1];
        /* dq for dout = 1: sum_j w_j (v_j - out) scale k_j */
        const double one = 1.0;
        p.dout = &one, memcpy(p.dos, p.os, sizeof p.os), p.dq = dq, memcpy(p.dqs, p.qs, sizeof p.qs);
        double dk[6], dv[2];
        p.dk = dk, memcpy(p.dks, p.ks, sizeof p.ks), p.dv = dv, memcpy(p.dvs, p.vs, sizeof p.vs);
        oracle_bwd(&p);
        for (int d = 0; d < 3; d++) {
            double g = 0.0;
            for (int j = 0; j < 2; j++) g += w[j] * (v[j] - want) * scales[t] * k[j][d];
            dw = fmax(dw, fabs(dq[d] - g));
        }
        CHECK(fabs(out - want) < 1e-15 && dw < 1e-15,
              "float64 oracle at scale %.17g: out %.17g want %.17g, dq error %g", scales[t], out, want, dw);
    }
}

/* A float32 problem of head dims 64 for the plans alone (no tensor) */
static attention_problem plan_problem(int64_t b, int64_t h, int64_t hkv, int64_t n, int64_t s, int causal) {
    return (attention_problem){
        .b = b, .h = h, .hkv = hkv, .n = n, .s = s, .d_qk = 64, .d_v = 64, .dt = OPF_F32, .causal = causal};
}

/* The forward's query blocks: 64 queries, cut to 32 then 16 where the blocks (times their key
 * chunks) leave threads idle and the cut adds blocks; shapes with one key block, which no build splits
 * by keys. Their bits on 1, 2 and 4 threads: check_fwd_bits. */
static void test_fwd_query_split(void) {
    const attention_kernels *k = attention_kernels_for(opf_isa_best());
    const struct {
        int64_t b, h, n, s, threads, qrows, tasks;
    } want[] = {
        {1, 1, 64, 64, 1, 64, 1}, {1, 1, 64, 64, 2, 32, 2},  {1, 1, 64, 64, 3, 16, 4},   {1, 1, 64, 64, 64, 16, 4},
        {1, 2, 64, 64, 2, 64, 2}, {1, 2, 64, 64, 16, 16, 8}, {1, 1, 200, 50, 2, 64, 4},  {1, 1, 200, 50, 8, 16, 13},
        {1, 1, 20, 40, 2, 16, 2}, {1, 1, 5, 40, 64, 64, 1},  {2, 8, 64, 64, 16, 64, 16}, {1, 1, 33, 9, 4, 16, 3},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const attention_problem p = plan_problem(want[i].b, want[i].h, want[i].h, want[i].n, want[i].s, 0);
        const attention_fwd_plan pl = attention_fwd_plan_make(k, &p, want[i].threads);
        CHECK(pl.qrows == want[i].qrows && pl.tasks == want[i].tasks && pl.chunks == 1 &&
                  pl.workers == (want[i].tasks < want[i].threads ? want[i].tasks : want[i].threads),
              "forward plan b=%lld h=%lld n=%lld s=%lld on %lld threads: %lld queries a block, %lld tasks, %lld "
              "workers; want %lld, %lld",
              (long long)p.b, (long long)p.h, (long long)p.n, (long long)p.s, (long long)want[i].threads,
              (long long)pl.qrows, (long long)pl.tasks, (long long)pl.workers, (long long)want[i].qrows,
              (long long)want[i].tasks);
    }
}

/* The backward's chunks: key blocks' (head, query block) pairs cut where a shape has fewer than 256
 * key-block tasks (the default GPT's causal heads), as evenly as a span cuts them; a whole group's task
 * runs its chunks in order; the tasks' work adds up to the blocks'. Then the values against the oracle
 * and the bits on 1, 3, 16 and 64 threads (whole groups on 1 thread where there are 2, chunk tasks on
 * the others). */
static void test_bwd_key_split(const attention_kernels *k) {
    const struct {
        int64_t b, h, hkv, n, causal, threads, span, tasks;
        int whole, cut;
    } want[] = {
        {8, 8, 2, 256, 1, 64, 2, 320, 0, 1}, /* the default GPT: 16 groups x 4 key blocks of 16, 12, 8, 4 pairs */
        {8, 8, 2, 256, 1, 2, 2, 16, 1, 1},   /* the same on 2 threads: whole groups, their chunks in order */
        {8, 8, 2, 256, 1, 16, 2, 320, 0, 1},   {4, 8, 8, 1024, 0, 64, 16, 512, 0, 0}, /* 512 key-block tasks */
        {4, 8, 8, 1024, 1, 64, 16, 512, 0, 0}, {1, 8, 8, 1024, 0, 64, 8, 256, 0, 1},  /* 16 pairs: 8 and 8 */
        {1, 1, 1, 1000, 1, 4, 2, 72, 0, 1},    {1, 2, 1, 64, 0, 2, 2, 1, 0, 0},       /* 2 pairs: not cut */
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const attention_problem p =
            plan_problem(want[i].b, want[i].h, want[i].hkv, want[i].n, want[i].n, (int)want[i].causal);
        const attention_bwd_plan pl = attention_bwd_plan_make(&p, want[i].threads);
        CHECK(pl.span == want[i].span && pl.tasks == want[i].tasks && pl.whole == want[i].whole &&
                  pl.cut == want[i].cut,
              "backward plan b=%lld h=%lld hkv=%lld n=%lld causal=%lld on %lld threads: span %lld, %lld tasks, whole "
              "%d, cut %d; want %lld, %lld, %d, %d",
              (long long)p.b, (long long)p.h, (long long)p.hkv, (long long)p.n, (long long)want[i].causal,
              (long long)want[i].threads, (long long)pl.span, (long long)pl.tasks, pl.whole, pl.cut,
              (long long)want[i].span, (long long)want[i].tasks, want[i].whole, want[i].cut);
        const attention_bwd_plan one = attention_bwd_plan_make(&p, 1), many = attention_bwd_plan_make(&p, 1000);
        int64_t whole = 0, chunks = 0, pairs = 0;
        for (int64_t t = 0; t < one.tasks; t++) whole += attention_bwd_task_cost(&one, &p, t);
        for (int64_t t = 0; t < many.tasks; t++) chunks += attention_bwd_task_cost(&many, &p, t);
        for (int64_t j0 = 0; j0 < p.s; j0 += 64) /* the query-key pairs of the blocks computed */
            for (int64_t i0 = p.causal ? j0 : 0; i0 < p.n; i0 += 64)
                pairs += (p.n - i0 < 64 ? p.n - i0 : 64) * (p.s - j0 < 64 ? p.s - j0 : 64);
        pairs *= p.b * p.h;
        CHECK(!many.whole && whole == pairs && chunks == pairs,
              "backward plan b=%lld h=%lld n=%lld: whole groups' work %lld, chunk tasks' %lld, want %lld",
              (long long)p.b, (long long)p.h, (long long)p.n, (long long)whole, (long long)chunks, (long long)pairs);
    }
    wide_threads = 1;
    run(k, (cfg){2, 8, 2, 256, 256, 64, 64, 1, 0, 0, OPF_F32});   /* the default GPT's heads, 4 groups */
    run(k, (cfg){2, 8, 2, 256, 256, 64, 64, 1, 0, 1, OPF_BF16});  /* bfloat16, transposed */
    run(k, (cfg){1, 2, 1, 300, 200, 40, 24, 0, 1, 2, OPF_F32});   /* bool mask, strided, 5 query blocks */
    run(k, (cfg){1, 1, 1, 1000, 1000, 64, 64, 1, 0, 0, OPF_F32}); /* one long head: chunks of 2 query blocks */
    wide_threads = 0;
}

int main(void) {
#ifdef OPF_AMX_EMULATE
    /* the AMX table's bfloat16 products over the C model of the tile instructions (its other
     * kernels and the model's build need AVX-512 BF16) */
    if (opf_isa_best() >= OPF_ISA_AVX512_BF16) {
        test_variant(&attention_kernels_amx);
        printf("tested %s over emulated tiles\n", attention_kernels_amx.name);
    } else {
        printf("skip %s over emulated tiles: the CPU lacks AVX512-BF16\n", attention_kernels_amx.name);
    }
    (void)test_oracle_scale, (void)test_fwd_query_split, (void)test_bwd_key_split; /* the plain build's checks */
    return check_report("test_attention (AMX emulated)");
#else
    test_oracle_scale();
    test_fwd_query_split();
    test_bwd_key_split(attention_kernels_for(opf_isa_best()));
    CHECK_EACH_VARIANT(attention_kernels_for, test_variant);
    return check_report("test_attention");
#endif
}
