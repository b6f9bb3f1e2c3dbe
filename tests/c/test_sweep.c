/*
 * Every kernel driver the torch glue calls, on empty and tiny shapes, at the thread count of
 * OPFORGE_NUM_THREADS (the standalone pthread backend; the Makefile runs this test at 1, 2, 3, 7, 16
 * and 64 threads): attention forward and backward, decoding attention, the GEMM (float32, 16-bit
 * operands, 16-bit results), linear forward and both backward strategies, matmul's product, linear +
 * cross-entropy (one logits block, and blocks of 16 floats), cross-entropy, softmax and log_softmax,
 * the norms, the gated linear units, rope, dispersion_correction, adamw, and the threaded helpers under them
 * (act_grad_rows, colsum_f32, the conversions, linear_cross_entropy_scale). Each dim 0 in turn, 1 and small odd sizes;
 * grouped-query head counts down to 0; M, N and K each 0 and 1.
 *
 * Why: a plan over threads (workers per task count, split-K, decode chunks, GEMM plans, row chunks,
 * grain sizes) that divides by a count an empty dim makes 0 is a SIGFPE, and some plans reach it only
 * with many threads: attention with no head died so on a 16-core machine alone.
 *
 * On every ISA this CPU runs, float32, bfloat16 and float16 against the float64 path of the same
 * driver on the reference kernels at one thread (attention, decoding and the GEMM: their double
 * oracles); every output, input and workspace between guard words (check_ws_alloc), workspaces sized
 * exactly as their size functions say, outputs NaN-filled (an element a plan skips shows); exact
 * zeros (and the same infinities) where an empty dim leaves nothing to sum; and the same bits at this
 * thread count and at one.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the standalone thread count is OPFORGE_NUM_THREADS */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../../csrc/kernels/adamw.h"
#include "../../csrc/kernels/attention.h"
#include "../../csrc/kernels/attention_decode.h"
#include "../../csrc/kernels/cross_entropy.h"
#include "../../csrc/kernels/dispersion_correction.h"
#include "../../csrc/kernels/gemm.h"
#include "../../csrc/kernels/glu.h"
#include "../../csrc/kernels/linear.h"
#include "../../csrc/kernels/linear_cross_entropy.h"
#include "../../csrc/kernels/norm.h"
#include "../../csrc/kernels/rope.h"
#include "../../csrc/kernels/softmax.h"
#include "check.h"

static int threads;   /* this run's: OPFORGE_NUM_THREADS, or the online CPUs */
static char ctx[400]; /* the case being run, for messages */
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
enum { F32 = 1 << OPF_F32, BF16 = 1 << OPF_BF16, F16 = 1 << OPF_F16, HALVES = BF16 | F16, ALL = F32 | HALVES };

static void set_threads(int n) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", n);
    setenv("OPFORGE_NUM_THREADS", buf, 1);
}

/* against float64 on the same (grid, so exactly representable) inputs: float32 sums of a few products;
 * 16-bit results round once (bfloat16 attention also rounds P and dS) */
static double tol_of(opf_dtype dt) { return dt == OPF_F32 ? 1e-4 : dt == OPF_BF16 ? 3e-2 : 1e-2; }

/* ---- guarded arrays -------------------------------------------------------------------------------- */

/* n elements of dt between guard words, every byte 0xff (NaN in each float type) */
static void *arr_new(int64_t n, size_t elem) {
    const int64_t bytes = (n > 0 ? n : 0) * (int64_t)elem;
    float *p = check_ws_alloc((bytes + 3) / 4);
    memset(p, 0xff, (size_t)bytes);
    return p;
}

static void arr_free(void *p, const char *what) {
    char buf[sizeof ctx + 64];
    snprintf(buf, sizeof buf, "%s: %s", ctx, what);
    check_ws_free(p, buf);
}

/* n values k / 8 in [-1, 1] times scale (plus shift): exact in every float type at scale 1, 2, 3 */
static void *arr_grid(int64_t n, opf_dtype dt, unsigned long long seed, double scale, double shift) {
    void *p = arr_new(n, opf_dtype_size(dt));
    seed = seed * 2654435761ull + 1;
    for (int64_t i = 0; i < n; i++)
        opf_store_elem(p, i, dt, shift + scale * (floor(check_uniform(&seed) * 17.0) - 8.0) / 8.0);
    return p;
}

static float *ws_new(int64_t floats) { return check_ws_alloc(floats); }

/* the thread count a driver's plan is made for, read once per call as the glue reads it */
static int64_t threads_now(void) { return opf_num_threads(); }
static void ws_free(float *ws, const char *what) { arr_free(ws, what); }

/* ---- a case's results --------------------------------------------------------------------------------- */

enum { MAX_OUTS = 16 };
typedef struct outs {
    int count;
    void *p[MAX_OUTS];
    int64_t n[MAX_OUTS];
    opf_dtype dt[MAX_OUTS];
    const char *name[MAX_OUTS];
} outs;

static void *out_new(outs *o, const char *name, int64_t n, opf_dtype dt) {
    if (o->count == MAX_OUTS) abort();
    const int i = o->count++;
    o->p[i] = arr_new(n, opf_dtype_size(dt)), o->n[i] = n, o->dt[i] = dt, o->name[i] = name;
    return o->p[i];
}

static void outs_free(outs *o) {
    for (int i = 0; i < o->count; i++) arr_free(o->p[i], o->name[i]);
    o->count = 0;
}

static double elem(const outs *o, int i, int64_t j) { return opf_load_elem(o->p[i], j, o->dt[i]); }

/* got against the oracle: within tol * max(1, max |want|); NaN where want is NaN, the same infinity;
 * exact zeros where an empty dim leaves nothing to sum (exact) and the oracle is all zeros */
static void outs_close(const outs *got, const outs *want, double tol, int exact) {
    CHECK(got->count == want->count, "%s: %d results, the oracle %d", ctx, got->count, want->count);
    for (int i = 0; i < got->count && i < want->count; i++) {
        const int64_t n = got->n[i];
        CHECK(n == want->n[i], "%s %s: %lld elements, the oracle %lld", ctx, got->name[i], (long long)n,
              (long long)want->n[i]);
        double mag = 1.0;
        int zeros = exact;
        for (int64_t j = 0; j < n; j++) {
            const double w = elem(want, i, j);
            if (isfinite(w)) mag = fmax(mag, fabs(w));
            zeros &= w == 0.0;
        }
        int64_t bad = 0, first = -1;
        for (int64_t j = 0; j < n; j++) {
            const double g = elem(got, i, j), w = elem(want, i, j);
            const int ok = isnan(w) ? isnan(g) : isinf(w) ? g == w : zeros ? g == 0.0 : fabs(g - w) <= tol * mag;
            if (!ok && bad++ == 0) first = j;
        }
        CHECK(bad == 0, "%s %s: %lld of %lld elements off (%s), first at %lld: got %.9g, want %.9g", ctx, got->name[i],
              (long long)bad, (long long)n, zeros ? "want exact zeros" : "beyond tolerance", (long long)first,
              first >= 0 ? elem(got, i, first) : 0.0, first >= 0 ? elem(want, i, first) : 0.0);
    }
}

static void outs_same_bits(const outs *a, const outs *b) {
    for (int i = 0; i < a->count; i++) {
        const size_t bytes = (size_t)a->n[i] * opf_dtype_size(a->dt[i]);
        CHECK(memcmp(a->p[i], b->p[i], bytes) == 0, "%s %s: differs bit for bit between %d threads and 1", ctx,
              a->name[i], threads);
    }
}

/* Runs the case (cfg) on the driver of isa for dt, its outputs into o. dt = OPF_F64: the oracle. */
typedef void (*go_fn)(const void *cfg, opf_isa isa, opf_dtype dt, outs *o);

static int cases_run;

/* The oracle at one thread, then each dtype of dts at this run's thread count (against the oracle) and
 * at one thread (the same bits). */
static void sweep(const char *desc, const void *cfg, go_fn go, opf_isa isa, unsigned dts, int exact) {
    outs want = {0};
    snprintf(ctx, sizeof ctx, "%s oracle", desc);
    set_threads(1);
    go(cfg, OPF_ISA_REF, OPF_F64, &want);
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        if (!(dts & (1u << dt))) continue;
        snprintf(ctx, sizeof ctx, "%s isa=%s %s threads=%d", desc, opf_isa_name(isa), DT_NAME[dt], threads);
        outs got = {0};
        set_threads(threads);
        go(cfg, isa, (opf_dtype)dt, &got);
        outs_close(&got, &want, tol_of((opf_dtype)dt), exact);
        if (threads > 1) {
            outs again = {0};
            set_threads(1);
            go(cfg, isa, (opf_dtype)dt, &again);
            outs_same_bits(&got, &again);
            outs_free(&again);
        }
        outs_free(&got);
        cases_run++;
    }
    snprintf(ctx, sizeof ctx, "%s oracle", desc);
    outs_free(&want);
    set_threads(threads);
}

/* strides of a contiguous (b, h, n, d) array, or (transposed) of its (b, n, h, d) layout */
static void strides4(int transposed, int64_t h, int64_t n, int64_t d, int64_t *st) {
    if (transposed)
        st[0] = n * h * d, st[1] = d, st[2] = h * d, st[3] = 1;
    else
        st[0] = h * n * d, st[1] = n * d, st[2] = d, st[3] = 1;
}

/* ---- attention ------------------------------------------------------------------------------------------ */

typedef struct attention_cfg {
    int64_t b, h, hkv, n, s, d, dv;
    int causal, mask, transposed; /* mask: bool (N, S) broadcast, key 0 always kept (no row fully masked) */
} attention_cfg;

static void go_attn(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const attention_cfg *c = cv;
    attention_problem p = {.b = c->b,
                           .h = c->h,
                           .hkv = c->hkv,
                           .n = c->n,
                           .s = c->s,
                           .d_qk = c->d,
                           .d_v = c->dv,
                           .dt = dt,
                           .causal = c->causal,
                           .scale = c->d > 0 ? 1.0 / sqrt((double)c->d) : 0.3};
    strides4(c->transposed, c->h, c->n, c->d, p.qs), strides4(c->transposed, c->hkv, c->s, c->d, p.ks);
    strides4(c->transposed, c->hkv, c->s, c->dv, p.vs), strides4(0, c->h, c->n, c->dv, p.os);
    memcpy(p.dos, p.os, sizeof p.os), memcpy(p.dqs, p.qs, sizeof p.qs);
    memcpy(p.dks, p.ks, sizeof p.ks), memcpy(p.dvs, p.vs, sizeof p.vs);
    const int64_t nq = c->b * c->h * c->n * c->d, nk = c->b * c->hkv * c->s * c->d;
    const int64_t nv = c->b * c->hkv * c->s * c->dv, no = c->b * c->h * c->n * c->dv;
    void *q = arr_grid(nq, dt, 1, 1.0, 0.0), *k = arr_grid(nk, dt, 2, 1.0, 0.0), *v = arr_grid(nv, dt, 3, 1.0, 0.0);
    void *dout = arr_grid(no, dt, 4, 1.0, 0.0);
    uint8_t *mask = arr_new(c->n * c->s, 1);
    if (c->mask) {
        unsigned long long seed = 5;
        for (int64_t i = 0; i < c->n * c->s; i++) mask[i] = i % c->s == 0 || check_uniform(&seed) < 0.6;
        p.mask = mask, p.mask_kind = ATTENTION_MASK_BOOL;
        p.ms[0] = p.ms[1] = 0, p.ms[2] = c->s, p.ms[3] = 1;
    }
    p.q = q, p.k = k, p.v = v, p.dout = dout;
    p.out = out_new(o, "out", no, dt);
    p.lse = out_new(o, "lse", c->b * c->h * c->n, OPF_F32);
    p.dq = out_new(o, "dq", nq, dt), p.dk = out_new(o, "dk", nk, dt), p.dv = out_new(o, "dv", nv, dt);
    { /* float64: the drivers' oracle path */
        const attention_kernels *kern = attention_kernels_for(isa);
        const attention_fwd_plan fwd = attention_fwd_plan_make(kern, &p, threads_now());
        float *ws = ws_new(attention_fwd_workspace(&fwd));
        attention_fwd(kern, &fwd, &p, ws);
        ws_free(ws, "attention_fwd workspace");
        const attention_bwd_plan bwd = attention_bwd_plan_make(&p, threads_now());
        ws = ws_new(attention_bwd_workspace(&bwd));
        attention_bwd(kern, &bwd, &p, ws);
        ws_free(ws, "attention_bwd workspace");
    }
    if (c->s == 0) { /* no key: zeros, lse -inf, zero gradients, whatever the oracle says */
        for (int64_t i = 0; i < no; i++)
            CHECK(opf_load_elem(p.out, i, dt) == 0.0, "%s: out[%lld] is not 0 without a key", ctx, (long long)i);
        for (int64_t i = 0; i < c->b * c->h * c->n; i++)
            CHECK(p.lse[i] == -INFINITY, "%s: lse[%lld] = %g without a key", ctx, (long long)i, p.lse[i]);
        for (int64_t i = 0; i < nq; i++)
            CHECK(opf_load_elem(p.dq, i, dt) == 0.0, "%s: dq[%lld] is not 0 without a key", ctx, (long long)i);
    }
    arr_free(q, "q"), arr_free(k, "k"), arr_free(v, "v"), arr_free(dout, "dout"), arr_free(mask, "mask");
}

static void sweep_attention(opf_isa isa) {
    /* (B, H, Hkv, N, S, D, Dv): each dim 0, grouped heads down to 0; N <= 4 runs the decoding driver, a lone
     * query block over >= 2 key blocks splits its keys; 3 groups are whole groups on 1 thread only; the
     * last, wide, has tasks for every thread */
    static const int64_t shapes[][7] = {
        {0, 2, 2, 5, 7, 8, 8},   {2, 0, 0, 5, 7, 8, 8},    {2, 0, 2, 5, 7, 8, 8},      {2, 0, 0, 1, 7, 8, 8},
        {2, 0, 2, 2, 7, 8, 8},   {2, 2, 2, 0, 7, 8, 8},    {2, 4, 2, 5, 0, 8, 8},      {2, 2, 1, 1, 0, 8, 8},
        {2, 4, 2, 0, 0, 8, 8},   {1, 2, 2, 5, 7, 0, 8},    {1, 2, 2, 3, 7, 0, 3},      {1, 2, 2, 5, 7, 8, 0},
        {1, 2, 1, 2, 7, 8, 0},   {1, 1, 1, 1, 1, 1, 1},    {1, 3, 1, 2, 3, 5, 3},      {2, 4, 2, 5, 17, 7, 5},
        {1, 1, 1, 3, 70, 8, 8},  {1, 1, 1, 7, 130, 8, 8},  {1, 6, 3, 4, 9, 4, 4},      {3, 1, 1, 17, 5, 3, 2},
        {3, 4, 1, 65, 66, 4, 4}, {1, 1, 1, 64, 200, 4, 4}, {2, 4, 2, 130, 130, 16, 16}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int variant = 0; variant < 3; variant++) {
            const int64_t *s = shapes[i];
            attention_cfg c = {s[0], s[1], s[2], s[3], s[4], s[5], s[6], variant == 1, variant == 2, (int)(i % 2)};
            char desc[160];
            snprintf(desc, sizeof desc,
                     "attention B=%lld H=%lld Hkv=%lld N=%lld S=%lld D=%lld Dv=%lld causal=%d "
                     "mask=%d transposed=%d",
                     (long long)c.b, (long long)c.h, (long long)c.hkv, (long long)c.n, (long long)c.s, (long long)c.d,
                     (long long)c.dv, c.causal, c.mask, c.transposed);
            const int exact = c.b * c.h * c.hkv * c.n * c.s * c.d * c.dv == 0;
            sweep(desc, &c, go_attn, isa, ALL, exact);
        }
}

/* ---- decoding attention ------------------------------------------------------------------------------ */

typedef struct attention_decode_cfg {
    int64_t b, h, hkv, n, s, d, dv;
    int64_t lens[4];
    int causal, lens_i64, lse, cache_view; /* cache_view: k a slice of a (B, S + 3, Hkv, D) buffer */
} attention_decode_cfg;

static void go_decode(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const attention_decode_cfg *c = cv;
    attention_decode_problem p = {.b = c->b,
                                  .h = c->h,
                                  .hkv = c->hkv,
                                  .n = c->n,
                                  .s_max = c->s,
                                  .d_qk = c->d,
                                  .d_v = c->dv,
                                  .dt = dt,
                                  .causal =
                                      c->causal ? ATTENTION_DECODE_CAUSAL_BOTTOM_RIGHT : ATTENTION_DECODE_CAUSAL_NONE,
                                  .scale = c->d > 0 ? 1.0 / sqrt((double)c->d) : 0.3,
                                  .lens_i64 = c->lens_i64,
                                  .lens_stride = 1};
    const int64_t s_buf = c->cache_view ? c->s + 3 : c->s;
    strides4(0, c->h, c->n, c->d, p.qs), strides4(c->cache_view, c->hkv, s_buf, c->d, p.ks);
    strides4(0, c->hkv, c->s, c->dv, p.vs), strides4(0, c->h, c->n, c->dv, p.os);
    const int64_t nq = c->b * c->h * c->n * c->d, nk = c->b * c->hkv * s_buf * c->d;
    const int64_t nv = c->b * c->hkv * c->s * c->dv, no = c->b * c->h * c->n * c->dv;
    void *q = arr_grid(nq, dt, 1, 2.0, 0.0), *k = arr_grid(nk, dt, 2, 2.0, 0.0), *v = arr_grid(nv, dt, 3, 1.0, 0.0);
    void *lens = arr_new(c->b, 8);
    for (int64_t b = 0; b < c->b; b++) {
        if (c->lens_i64)
            ((int64_t *)lens)[b] = c->lens[b];
        else
            ((int32_t *)lens)[b] = (int32_t)c->lens[b];
    }
    p.q = q, p.k = k, p.v = v, p.lens = lens;
    p.out = out_new(o, "out", no, dt);
    if (c->lse) p.lse = out_new(o, "lse", c->b * c->h * c->n, OPF_F32);
    { /* float64: the driver's oracle path */
        const attention_decode_plan plan = attention_decode_plan_make(&p, threads_now());
        float *ws = ws_new(attention_decode_workspace(&plan));
        attention_decode_fwd(attention_decode_kernels_for(isa), &plan, &p, ws);
        ws_free(ws, "attention_decode_fwd workspace");
    }
    arr_free(q, "q"), arr_free(k, "k_cache"), arr_free(v, "v_cache"), arr_free(lens, "seq_lens");
}

static void sweep_decode(opf_isa isa) {
    /* (B, H, Hkv, N, S_max, D, Dv, seq_lens) */
    static const struct {
        int64_t b, h, hkv, n, s, d, dv, lens[4];
    } cases[] = {{0, 4, 2, 1, 9, 8, 8, {0}},           {2, 0, 0, 1, 9, 8, 8, {9, 3}},
                 {2, 0, 2, 1, 9, 8, 8, {9, 3}},        {2, 4, 2, 1, 0, 8, 8, {0, 0}},
                 {2, 4, 2, 0, 9, 8, 8, {9, 3}},        {1, 2, 2, 1, 5, 0, 4, {5}},
                 {1, 2, 2, 1, 5, 4, 0, {5}},           {1, 1, 1, 1, 1, 1, 1, {1}},
                 {3, 4, 2, 1, 11, 8, 6, {11, 0, 5}},   {2, 6, 2, 3, 70, 5, 7, {70, 3}},
                 {2, 3, 3, 16, 17, 8, 8, {17, 16}},    {1, 2, 1, 2, 130, 8, 8, {130}},
                 {2, 4, 1, 5, 7, 3, 3, {2, 7}},        {4, 8, 2, 1, 300, 4, 4, {300, 0, 1, 299}},
                 {2, 8, 2, 2, 700, 16, 16, {700, 650}}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (int causal = 0; causal < 2; causal++) {
            attention_decode_cfg c = {cases[i].b,
                                      cases[i].h,
                                      cases[i].hkv,
                                      cases[i].n,
                                      cases[i].s,
                                      cases[i].d,
                                      cases[i].dv,
                                      {0},
                                      causal,
                                      (int)(i % 2),
                                      (int)((i + (size_t)causal) % 2),
                                      (int)(i % 3 == 0)};
            memcpy(c.lens, cases[i].lens, sizeof c.lens);
            char desc[160];
            snprintf(desc, sizeof desc,
                     "decode B=%lld H=%lld Hkv=%lld N=%lld S_max=%lld D=%lld Dv=%lld causal=%d "
                     "lse=%d cache_view=%d",
                     (long long)c.b, (long long)c.h, (long long)c.hkv, (long long)c.n, (long long)c.s, (long long)c.d,
                     (long long)c.dv, c.causal, c.lse, c.cache_view);
            sweep(desc, &c, go_decode, isa, ALL, c.b * c.h * c.hkv * c.n * c.s * c.d * c.dv == 0);
        }
}

/* ---- GEMM ------------------------------------------------------------------------------------------------ */

/* mode 0: float32 operands, C = gelu(A B + 0.5 C + bias[j]) and its pre-activation; 1: operands of dt,
 * B transposed, C = silu(A B + bias[i]); 2: operands of dt with 16-bit results (out16, pre16) of dt,
 * relu(A B + bias[j]), no float32 C (K fits one slice) */
typedef struct gemm_cfg {
    int64_t m, n, k;
    int mode;
} gemm_cfg;

static void go_gemm(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const gemm_cfg *c = cv;
    const int64_t m = c->m, n = c->n, k = c->k;
    const opf_dtype in_dt = dt == OPF_F64 ? OPF_F64 : c->mode == 0 ? OPF_F32 : dt;
    void *a = arr_grid(m * k, in_dt, 1, 1.0, 0.0), *b = arr_grid(k * n, in_dt, 2, 1.0, 0.0);
    const int64_t nb = c->mode == 1 ? m : n;
    void *bias = arr_grid(nb, dt == OPF_F64 ? OPF_F64 : OPF_F32, 3, 1.0, 0.0);
    const int64_t rsb = c->mode == 1 ? 1 : n, csb = c->mode == 1 ? k : 1;
    const act_kind act = c->mode == 0 ? ACT_GELU : c->mode == 1 ? ACT_SILU : ACT_RELU;
    const gemm_bias_kind bk = c->mode == 1 ? GEMM_BIAS_COL : GEMM_BIAS_ROW;
    const double beta = c->mode == 0 ? 0.5 : 0.0;
    void *cc = NULL;
    if (dt == OPF_F64 || c->mode < 2) {
        cc = out_new(o, "c", m * n, dt == OPF_F64 ? OPF_F64 : OPF_F32);
        for (int64_t i = 0; i < m * n; i++) opf_store_elem(cc, i, o->dt[0], 0.25 * (double)(i % 5) - 0.5);
    }
    void *pre = c->mode == 1 ? NULL
                             : out_new(o, "preact", m * n,
                                       dt == OPF_F64  ? OPF_F64
                                       : c->mode == 2 ? dt
                                                      : OPF_F32);
    if (dt == OPF_F64) {
        gemm_ref_f64(m, n, k, a, k, 1, b, rsb, csb, cc, n, beta, bias, 1, bk, act, pre, n);
    } else {
        const gemm_kernels *kern = gemm_kernels_for(isa);
        gemm_epilogue ep = {.beta = (float)beta, .bias = bias, .bias_kind = bk, .act = act};
        if (c->mode == 0) ep.preact = pre, ep.rsp = n;
        void *out16 = NULL;
        if (c->mode == 2) {
            out16 = out_new(o, "out16", m * n, dt);
            ep.out16 = out16, ep.pre16 = pre, ep.rsp = n, ep.out_dt = dt;
            CHECK(k <= gemm_slice_depth(kern, dt, dt), "%s: K = %lld is past one slice", ctx, (long long)k);
        }
        const opf_dtype ab_dt = c->mode == 0 ? OPF_F32 : in_dt;
        const gemm_plan plan = gemm_plan_make(kern, m, n, k, ab_dt, ab_dt, threads_now());
        const int64_t wsn = gemm_workspace(&plan);
        float *ws = ws_new(wsn);
        const int rc = gemm_run(&plan, a, k, 1, b, rsb, csb, cc, n, &ep, ws, wsn);
        ws_free(ws, "gemm workspace");
        CHECK(rc == 0, "%s: the GEMM refused its workspace of %lld floats", ctx, (long long)wsn);
        if (c->mode == 2) { /* results in out16 then pre16, as the oracle's c then preact */
            void *t = o->p[0];
            o->p[0] = o->p[1], o->p[1] = t, o->name[0] = "out16", o->name[1] = "preact16";
        }
    }
    arr_free(a, "a"), arr_free(b, "b"), arr_free(bias, "bias");
}

/* (M, K, N); the last four split over threads: {37, 256, 70} as a few deep slivers (a packing task each),
 * {37, 701, 30} as one sliver whose packing is cut into K runs at 2 threads and more (an odd K: the last
 * run holds the half pair) */
static const int64_t MKN[][3] = {{0, 5, 3},     {5, 0, 3},     {5, 3, 0},     {1, 5, 3},    {5, 1, 3},  {5, 3, 1},
                                 {1, 1, 1},     {0, 0, 0},     {7, 17, 5},    {2, 3, 2},    {17, 7, 3}, {13, 2, 33},
                                 {70, 64, 130}, {37, 64, 600}, {37, 256, 70}, {37, 701, 30}};

static void sweep_gemm(opf_isa isa) {
    for (size_t i = 0; i < sizeof MKN / sizeof *MKN; i++)
        for (int mode = 0; mode < 3; mode++) {
            if (mode == 2 && MKN[i][1] > gemm_kernels_ref.kc) continue; /* 16-bit results: one slice on every table */
            gemm_cfg c = {MKN[i][0], MKN[i][2], MKN[i][1], mode};
            char desc[120];
            snprintf(desc, sizeof desc, "gemm M=%lld N=%lld K=%lld mode=%d", (long long)c.m, (long long)c.n,
                     (long long)c.k, mode);
            sweep(desc, &c, go_gemm, isa, mode == 0 ? F32 : mode == 1 ? ALL : HALVES, 0);
        }
}

/* ---- linear and matmul's product --------------------------------------------------------------------------- */

typedef struct linear_cfg {
    int64_t lead[2], k, n;       /* x (lead[0], lead[1], K) */
    int act, bias, save, donate; /* save: the forward stores preact; donate: the backward may work in it */
} linear_cfg;

static void go_linear(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const linear_cfg *c = cv;
    const int64_t m = c->lead[0] * c->lead[1], k = c->k, n = c->n;
    const gemm_kernels *gemm = gemm_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    int64_t xsizes[3] = {c->lead[0], c->lead[1], k}, xstrides[3] = {c->lead[1] * k, k, 1};
    int64_t gsizes[2] = {m, n}, gstrides[2] = {n, 1};
    void *x = arr_grid(m * k, dt, 1, 1.0, 0.0), *w = arr_grid(n * k, dt, 2, 1.0, 0.0);
    void *b = arr_grid(n, dt, 3, 1.0, 0.0), *g = arr_grid(m * n, dt, 4, 1.0, 0.0);
    linear_problem p = {.n = n,
                        .k = k,
                        .dt = dt,
                        .act = c->act,
                        .x = {x, 3, xsizes, xstrides},
                        .weight = w,
                        .weight_strides = {k, 1},
                        .bias = c->bias ? b : NULL,
                        .bias_stride = 1};
    p.out = out_new(o, "out", m * n, dt);
    const int stored = c->act && c->save; /* else the backward recomputes it */
    p.preact = stored ? out_new(o, "preact", m * n, dt) : NULL;
    const linear_fwd_plan fwd = linear_fwd_plan_make(gemm, &p, threads_now());
    int64_t wsn = linear_fwd_workspace(&fwd);
    float *ws = ws_new(wsn);
    CHECK(linear_fwd(&fwd, &p, ws, wsn) == 0, "%s: linear_fwd refused its workspace of %lld floats", ctx,
          (long long)wsn);
    ws_free(ws, "linear_fwd workspace");
    void *donated = arr_new(m * n, opf_dtype_size(dt));
    if (stored) memcpy(donated, p.preact, (size_t)(m * n) * opf_dtype_size(dt));
    p.grad = (linear_view){g, 2, gsizes, gstrides};
    p.saved_preact = (linear_view){stored ? donated : NULL, 2, gsizes, gstrides};
    p.dx = out_new(o, "dx", m * k, dt), p.dweight = out_new(o, "dweight", n * k, dt);
    p.dbias = c->bias ? out_new(o, "dbias", n, dt) : NULL;
    const linear_bwd_plan bwd = linear_bwd_plan_make(gemm, &p, c->donate && dt != OPF_F64, threads_now());
    wsn = linear_bwd_workspace(&bwd);
    ws = ws_new(wsn);
    CHECK(linear_bwd(&bwd, &p, ws, wsn) == 0, "%s: linear_bwd (strategy %d) refused its workspace of %lld floats", ctx,
          (int)bwd.strategy, (long long)wsn);
    ws_free(ws, "linear_bwd workspace");
    arr_free(donated, "donated preact");
    arr_free(x, "x"), arr_free(w, "weight"), arr_free(b, "bias"), arr_free(g, "grad");
}

static void sweep_linear(opf_isa isa) {
    static const int variants[][4] = {/* act, bias, save, donate */
                                      {ACT_GELU, 1, 1, 1},
                                      {ACT_SILU, 0, 1, 0},
                                      {ACT_GELU_TANH, 1, 0, 0},
                                      {ACT_NONE, 1, 0, 1},
                                      {ACT_RELU, 0, 1, 1}};
    int64_t shapes[sizeof MKN / sizeof *MKN + 3][4];
    size_t ns = 0;
    for (size_t i = 0; i < sizeof MKN / sizeof *MKN; i++, ns++)
        shapes[ns][0] = MKN[i][0], shapes[ns][1] = 1, shapes[ns][2] = MKN[i][1], shapes[ns][3] = MKN[i][2];
    const int64_t lead2[3][4] = {{2, 0, 5, 3}, {2, 3, 17, 7}, {0, 3, 4, 2}};
    for (size_t i = 0; i < 3; i++, ns++) memcpy(shapes[ns], lead2[i], sizeof lead2[i]);
    for (size_t i = 0; i < ns; i++)
        for (size_t v = 0; v < sizeof variants / sizeof *variants; v++) {
            linear_cfg c = {{shapes[i][0], shapes[i][1]},
                            shapes[i][2],
                            shapes[i][3],
                            variants[v][0],
                            variants[v][1],
                            variants[v][2],
                            variants[v][3]};
            char desc[160];
            snprintf(desc, sizeof desc, "linear x=(%lld, %lld, %lld) N=%lld act=%d bias=%d save=%d donate=%d",
                     (long long)c.lead[0], (long long)c.lead[1], (long long)c.k, (long long)c.n, c.act, c.bias, c.save,
                     c.donate);
            sweep(desc, &c, go_linear, isa, ALL, c.lead[0] * c.lead[1] * c.k * c.n == 0);
        }
}

typedef struct matmul_cfg {
    int64_t m, n, k;
} matmul_cfg;

/* matmul forward and backward, B transposed, batched (2 matrices; a's second one sliced from a padded
 * buffer) */
static void go_matmul(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const matmul_cfg *c = cv;
    const int64_t batch = 2, m = c->m, n = c->n, k = c->k, a_stride = (m + 1) * k;
    void *a = arr_grid(batch * a_stride, dt, 1, 1.0, 0.0), *b = arr_grid(batch * k * n, dt, 2, 1.0, 0.0);
    void *g = arr_grid(batch * m * n, dt, 3, 1.0, 0.0);
    const int64_t a_sizes[3] = {batch, m, k}, a_strides[3] = {a_stride, k, 1};
    const int64_t b_sizes[3] = {batch, k, n}, b_strides[3] = {k * n, 1, k};
    const int64_t g_sizes[3] = {batch, m, n}, g_strides[3] = {m * n, n, 1};
    const linear_view av = {a, 3, a_sizes, a_strides}, bv = {b, 3, b_sizes, b_strides}, gv = {g, 3, g_sizes, g_strides};
    const gemm_kernels *gemm = gemm_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    void *out = out_new(o, "out", batch * m * n, dt);
    const matmul_fwd_plan fwd = matmul_fwd_plan_make(gemm, dt, batch, m, n, k, threads_now());
    float *ws = ws_new(matmul_fwd_workspace(&fwd));
    CHECK(matmul_fwd(&fwd, out, &av, &bv, ws, matmul_fwd_workspace(&fwd)) == 0,
          "%s: matmul_fwd refused its plan's workspace", ctx);
    ws_free(ws, "matmul_fwd workspace");
    void *da = out_new(o, "da", batch * m * k, dt), *db = out_new(o, "db", batch * k * n, dt);
    const matmul_bwd_plan bwd = matmul_bwd_plan_make(gemm, dt, batch, m, n, k, threads_now());
    ws = ws_new(matmul_bwd_workspace(&bwd));
    CHECK(matmul_bwd(&bwd, da, db, &gv, &av, &bv, ws, matmul_bwd_workspace(&bwd)) == 0,
          "%s: matmul_bwd refused its plan's workspace", ctx);
    /* one of the two not wanted (NULL): the other the same bits */
    const size_t da_bytes = (size_t)(batch * m * k) * opf_dtype_size(dt),
                 db_bytes = (size_t)(batch * k * n) * opf_dtype_size(dt);
    void *one = malloc(da_bytes + db_bytes + 1);
    CHECK(matmul_bwd(&bwd, one, NULL, &gv, &av, &bv, ws, matmul_bwd_workspace(&bwd)) == 0 &&
              memcmp(one, da, da_bytes) == 0,
          "%s: matmul_bwd's da without db differs", ctx);
    CHECK(matmul_bwd(&bwd, NULL, one, &gv, &av, &bv, ws, matmul_bwd_workspace(&bwd)) == 0 &&
              memcmp(one, db, db_bytes) == 0,
          "%s: matmul_bwd's db without da differs", ctx);
    free(one);
    ws_free(ws, "matmul_bwd workspace");
    arr_free(a, "a"), arr_free(b, "b"), arr_free(g, "grad");
}

static void sweep_matmul(opf_isa isa) {
    for (size_t i = 0; i < sizeof MKN / sizeof *MKN; i++) {
        matmul_cfg c = {MKN[i][0], MKN[i][2], MKN[i][1]};
        char desc[120];
        snprintf(desc, sizeof desc, "matmul M=%lld N=%lld K=%lld", (long long)c.m, (long long)c.n, (long long)c.k);
        sweep(desc, &c, go_matmul, isa, ALL, c.m * c.n * c.k == 0);
    }
}

/* ---- linear + cross-entropy ----------------------------------------------------------------------------- */

typedef struct linear_cross_entropy_cfg {
    int64_t t, h, v;
    int reduction, bias, extras; /* extras: label smoothing 0.1, softcap 2, every third target ignored */
    int64_t block_floats;        /* 0: one block (the default); 16: blocks of a few tokens and vocab rows */
} linear_cross_entropy_cfg;

/* linear_cross_entropy_run under a plan at this call's thread count, on a guarded workspace of its size */
static void lce_run(const linear_cross_entropy_kernels *kern, const gemm_kernels *gemm,
                    const linear_cross_entropy_problem *p, const char *what) {
    const linear_cross_entropy_plan plan = linear_cross_entropy_plan_make(gemm, p, threads_now());
    const int64_t floats = linear_cross_entropy_workspace(&plan);
    float *ws = ws_new(floats);
    CHECK(linear_cross_entropy_run(kern, &plan, p, ws, floats) == 0,
          "%s: linear_cross_entropy_run (%s) refused %lld floats", ctx, what, (long long)floats);
    ws_free(ws, "lce workspace");
}

static void go_lce(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const linear_cross_entropy_cfg *c = cv;
    const int64_t t = c->t, h = c->h, v = c->v;
    const opf_isa kisa = dt == OPF_F64 ? OPF_ISA_REF : isa;
    const opf_dtype ldt = linear_cross_entropy_loss_dtype(dt); /* of the loss, its gradient, the forward's gradients */
    const gemm_kernels *gemm = gemm_kernels_for(kisa);
    const linear_cross_entropy_kernels *kern = linear_cross_entropy_kernels_for(kisa);
    void *hid = arr_grid(t * h, dt, 1, 1.0, 0.0), *w = arr_grid(v * h, dt, 2, 1.0, 0.0);
    void *bias = arr_grid(v, dt, 3, 1.0, 0.0), *gtok = arr_grid(t, ldt, 4, 1.0, 0.0);
    void *gsc = arr_new(1, opf_dtype_size(ldt));
    opf_store_elem(gsc, 0, ldt, 1.75);
    int64_t *target = arr_new(t, sizeof(int64_t));
    unsigned long long seed = 7;
    for (int64_t i = 0; i < t; i++)
        target[i] = v == 0 || (c->extras && i % 3 == 1) ? -100 : (int64_t)(check_uniform(&seed) * (double)v);
    linear_cross_entropy_problem p = {.t = t,
                                      .h = h,
                                      .v = v,
                                      .dt = dt,
                                      .loss_dt = ldt,
                                      .grads_dt = ldt,
                                      .hidden = hid,
                                      .hidden_strides = {h, 1},
                                      .weight = w,
                                      .weight_strides = {h, 1},
                                      .target = target,
                                      .target_stride = 1,
                                      .bias = c->bias ? bias : NULL,
                                      .bias_stride = 1,
                                      .ignore_index = -100,
                                      .label_smoothing = c->extras ? 0.1 : 0.0,
                                      .softcap = c->extras ? 2.0 : 0.0,
                                      .reduction = c->reduction,
                                      .block_floats = c->block_floats};
    CHECK(linear_cross_entropy_bad_target(&p) == -1, "%s: valid targets refused", ctx);
    const int fused = c->reduction != LINEAR_CROSS_ENTROPY_NONE;
    p.loss = out_new(o, "loss", fused ? 1 : t, ldt);
    p.lse = out_new(o, "lse", t, OPF_F32);
    void *dh = NULL;
    if (fused) {
        p.dhidden = dh = out_new(o, "dhidden (forward)", t * h, ldt);
        p.dweight = out_new(o, "dweight (forward)", v * h, ldt);
        p.dbias = c->bias ? out_new(o, "dbias (forward)", v, ldt) : NULL;
    }
    lce_run(kern, gemm, &p, "forward");
    if (fused) /* the backward of a forward that made the gradients */
        linear_cross_entropy_scale(gemm->cvt, dt, out_new(o, "dhidden (scaled)", t * h, dt), ldt, dh, t * h, gsc);
    /* the backward from lse: a scalar gradient (mean, sum), the per-token one (none) */
    linear_cross_entropy_problem b = p;
    b.lse_given = 1, b.loss = NULL, b.grads_dt = dt;
    b.grad = fused ? gsc : gtok, b.grad_stride = 1;
    b.dhidden = out_new(o, "dhidden", t * h, dt), b.dweight = out_new(o, "dweight", v * h, dt);
    b.dbias = c->bias ? out_new(o, "dbias", v, dt) : NULL;
    lce_run(kern, gemm, &b, "backward");
    if (fused && dt == OPF_F64) { /* the oracle of the kept du's results: the same values as above */
        memcpy(out_new(o, "loss (du kept)", 1, ldt), p.loss, opf_dtype_size(ldt));
        memcpy(out_new(o, "lse (du kept)", t, OPF_F32), p.lse, (size_t)t * sizeof(float));
        memcpy(out_new(o, "dhidden (du kept)", t * h, dt), b.dhidden, (size_t)(t * h) * opf_dtype_size(dt));
        memcpy(out_new(o, "dweight (du kept)", v * h, dt), b.dweight, (size_t)(v * h) * opf_dtype_size(dt));
        if (c->bias) memcpy(out_new(o, "dbias (du kept)", v, dt), b.dbias, (size_t)v * opf_dtype_size(dt));
    } else if (
        fused) { /* du kept (float32; bfloat16 operands: bfloat16): the forward makes it, the backward reads it */
        linear_cross_entropy_problem k = p;
        k.dhidden = k.dweight = k.dbias = NULL;
        k.loss = out_new(o, "loss (du kept)", 1, ldt), k.lse = out_new(o, "lse (du kept)", t, OPF_F32);
        k.dlogits = arr_new(t * v, dt == OPF_BF16 ? 2 : 4); /* not a result: the oracle has none */
        lce_run(kern, gemm, &k, "forward, du kept");
        linear_cross_entropy_problem kb = b;
        kb.dlogits = k.dlogits, kb.lse = k.lse;
        kb.dhidden = out_new(o, "dhidden (du kept)", t * h, dt),
        kb.dweight = out_new(o, "dweight (du kept)", v * h, dt);
        kb.dbias = c->bias ? out_new(o, "dbias (du kept)", v, dt) : NULL;
        lce_run(kern, gemm, &kb, "backward, du kept");
        arr_free(k.dlogits, "dlogits");
    }
    arr_free(hid, "hidden"), arr_free(w, "weight"), arr_free(bias, "bias"), arr_free(gtok, "grad (per token)");
    arr_free(gsc, "grad"), arr_free(target, "target");
}

static void sweep_lce(opf_isa isa) {
    /* (T, H, V); blocks of 16 logits on the small ones only (a GEMM per block: the wide one would start
     * thousands of threads) */
    static const int64_t shapes[][3] = {{0, 4, 5}, {3, 0, 5}, {3, 4, 0},  {1, 4, 5},  {3, 1, 5},  {3, 4, 1},
                                        {1, 1, 1}, {0, 0, 0}, {7, 9, 11}, {17, 3, 5}, {5, 2, 33}, {64, 32, 300}};
    static const int variants[][3] = {{LINEAR_CROSS_ENTROPY_MEAN, 0, 0},
                                      {LINEAR_CROSS_ENTROPY_SUM, 1, 1},
                                      {LINEAR_CROSS_ENTROPY_NONE, 1, 0},
                                      {LINEAR_CROSS_ENTROPY_MEAN, 1, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (size_t vi = 0; vi < sizeof variants / sizeof *variants; vi++)
            for (int blocks = 0; blocks < (shapes[i][0] * shapes[i][2] <= 200 ? 2 : 1); blocks++) {
                linear_cross_entropy_cfg c = {shapes[i][0],    shapes[i][1],    shapes[i][2],   variants[vi][0],
                                              variants[vi][1], variants[vi][2], blocks ? 16 : 0};
                char desc[160];
                snprintf(desc, sizeof desc,
                         "linear_cross_entropy T=%lld H=%lld V=%lld reduction=%d bias=%d "
                         "extras=%d block_floats=%lld",
                         (long long)c.t, (long long)c.h, (long long)c.v, c.reduction, c.bias, c.extras,
                         (long long)c.block_floats);
                sweep(desc, &c, go_lce, isa, ALL, c.t * c.h * c.v == 0);
            }
}

/* ---- cross-entropy --------------------------------------------------------------------------------------- */

typedef struct cross_entropy_cfg {
    int lead_ndim;
    int64_t lead[2], c;
    int weight, reduction, extras; /* extras: label smoothing 0.2, softcap 3 */
    int ignored;                   /* 1: some targets ignored; 2: all */
} cross_entropy_cfg;

static void go_ce(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const cross_entropy_cfg *c = cv;
    const int64_t rows = c->lead_ndim == 2 ? c->lead[0] * c->lead[1] : c->lead[0], C = c->c;
    void *x = arr_grid(rows * C, dt, 1, 3.0, 0.0), *w = arr_grid(C, dt, 2, 0.5, 1.0);
    void *gl = arr_grid(rows, dt, 3, 1.0, 0.0), *g = arr_new(1, opf_dtype_size(dt));
    opf_store_elem(g, 0, dt, 0.75);
    int64_t *target = arr_new(rows, sizeof(int64_t));
    unsigned long long seed = 9;
    for (int64_t i = 0; i < rows; i++)
        target[i] = C == 0 || c->ignored == 2 || (c->ignored && i % 3 == 1)
                        ? -100
                        : (int64_t)(check_uniform(&seed) * (double)C);
    int64_t xst[3], tst[2];
    if (c->lead_ndim == 2)
        xst[0] = c->lead[1] * C, xst[1] = C, xst[2] = 1, tst[0] = c->lead[1], tst[1] = 1;
    else
        xst[0] = C, xst[1] = 1, tst[0] = 1;
    cross_entropy_problem p = {.dt = dt,
                               .rows = rows,
                               .classes = C,
                               .lead_ndim = c->lead_ndim,
                               .lead_sizes = c->lead,
                               .logits = x,
                               .logits_strides = xst,
                               .target = target,
                               .target_strides = tst,
                               .weight = c->weight ? w : NULL,
                               .weight_stride = 1,
                               .ignore_index = -100,
                               .label_smoothing = c->extras ? 0.2 : 0.0,
                               .softcap = c->extras ? 3.0 : 0.0,
                               .reduction = c->reduction,
                               .grad_losses = gl,
                               .grad_losses_strides = tst,
                               .grad_loss = g};
    int64_t bad_value = 0;
    CHECK(cross_entropy_check_target(&p, &bad_value) == -1, "%s: valid targets refused", ctx);
    const cross_entropy_kernels *kern = cross_entropy_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    p.losses = out_new(o, "losses", rows, dt), p.loss = out_new(o, "loss", 1, dt);
    p.lse = out_new(o, "lse", rows, OPF_F64);
    float *ws = ws_new(cross_entropy_fwd_workspace(&p));
    cross_entropy_fwd(kern, &p, ws);
    ws_free(ws, "cross_entropy_fwd workspace");
    p.lse_saved = p.lse, p.lse_dt = OPF_F64;
    p.dlogits = out_new(o, "dlogits", rows * C, dt);
    cross_entropy_bwd(kern, &p);
    arr_free(x, "logits"), arr_free(w, "weight"), arr_free(gl, "grad_losses"), arr_free(g, "grad_loss");
    arr_free(target, "target");
}

static void sweep_ce(opf_isa isa) {
    /* (lead dims, C, ignored): C = 0 only with every target ignored; 33 rows are three reduction blocks; the
     * last splits over threads */
    static const int64_t shapes[][5] = {{1, 0, 0, 5, 0},    {1, 3, 0, 0, 2}, {1, 0, 0, 0, 0}, {1, 1, 0, 1, 0},
                                        {1, 1, 0, 5, 0},    {1, 7, 0, 1, 1}, {1, 3, 0, 2, 1}, {1, 7, 0, 17, 1},
                                        {2, 2, 0, 4, 0},    {2, 2, 3, 5, 1}, {1, 5, 0, 3, 2}, {1, 33, 0, 3, 1},
                                        {1, 300, 0, 257, 1}};
    static const int variants[][3] = {{CROSS_ENTROPY_REDUCTION_MEAN, 0, 0},
                                      {CROSS_ENTROPY_REDUCTION_SUM, 1, 1},
                                      {CROSS_ENTROPY_REDUCTION_NONE, 1, 0},
                                      {CROSS_ENTROPY_REDUCTION_MEAN, 1, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (size_t v = 0; v < sizeof variants / sizeof *variants; v++) {
            const int64_t *s = shapes[i];
            cross_entropy_cfg c = {(int)s[0],      {s[1], s[2]},   s[3],     variants[v][1],
                                   variants[v][0], variants[v][2], (int)s[4]};
            char desc[160];
            snprintf(desc, sizeof desc,
                     "cross_entropy lead=%s(%lld, %lld) C=%lld weight=%d reduction=%d extras=%d "
                     "ignored=%d",
                     c.lead_ndim == 2 ? "" : "1-d ", (long long)c.lead[0],
                     (long long)(c.lead_ndim == 2 ? c.lead[1] : 1), (long long)c.c, c.weight, c.reduction, c.extras,
                     c.ignored);
            const int64_t rows = c.lead_ndim == 2 ? c.lead[0] * c.lead[1] : c.lead[0];
            sweep(desc, &c, go_ce, isa, ALL, rows * c.c == 0);
        }
}

/* ---- softmax ---------------------------------------------------------------------------------------------- */

typedef struct softmax_cfg {
    int ndim, dim;
    int64_t sizes[3];
    int layout; /* 0 contiguous; 1 the last two dims transposed; 2 every stride doubled (no unit stride) */
    int log;
} softmax_cfg;

static void go_softmax(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const softmax_cfg *c = cv;
    int64_t numel = 1, st[3] = {0}, cst[3] = {0}, span;
    for (int d = 0; d < c->ndim; d++) numel *= c->sizes[d];
    for (int d = c->ndim - 1, step = 1; d >= 0; step *= (int)c->sizes[d], d--) cst[d] = step;
    memcpy(st, cst, sizeof st);
    if (c->layout == 1 && c->ndim >= 2) {
        const int a = c->ndim - 2, b = c->ndim - 1;
        st[b] = c->sizes[a], st[a] = 1;
    } else if (c->layout == 2) {
        for (int d = 0; d < c->ndim; d++) st[d] = 2 * cst[d];
    }
    span = c->layout == 2 ? 2 * numel : numel;
    void *x = arr_grid(span, dt, 1, 3.0, 0.0), *dy = arr_grid(numel, dt, 2, 1.0, 0.0);
    softmax_problem p = {.dt = dt, .log = c->log, .ndim = c->ndim, .dim = c->dim, .sizes = c->sizes};
    const softmax_kernels *kern = softmax_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    p.out = out_new(o, "y", numel, dt), p.in = x, p.strides[0] = cst, p.strides[1] = st;
    softmax_fwd(kern, &p);
    p.y = p.out, p.in = dy, p.strides[1] = cst, p.strides[2] = cst;
    p.out = out_new(o, "dx", numel, dt);
    softmax_bwd(kern, &p);
    arr_free(x, "x"), arr_free(dy, "dy");
}

static void sweep_softmax(opf_isa isa) {
    static const struct {
        int ndim, dim;
        int64_t sizes[3];
    } shapes[] = {{1, 0, {0}},      {1, 0, {1}},        {1, 0, {17}},       {2, 1, {5, 0}},
                  {2, 0, {5, 0}},   {2, 1, {0, 5}},     {2, 0, {0, 5}},     {2, 1, {3, 7}},
                  {2, 0, {3, 7}},   {3, 1, {2, 3, 5}},  {3, 2, {2, 0, 3}},  {3, 0, {1, 1, 1}},
                  {2, 0, {7, 130}}, {3, 1, {2, 70, 3}}, {2, 1, {130, 600}}, {2, 0, {600, 130}}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int layout = 0; layout < 3; layout++)
            for (int log = 0; log < 2; log++) {
                softmax_cfg c = {shapes[i].ndim, shapes[i].dim, {0}, layout, log};
                memcpy(c.sizes, shapes[i].sizes, sizeof c.sizes);
                char desc[160];
                snprintf(desc, sizeof desc, "%s sizes=(%lld, %lld, %lld)[:%d] dim=%d layout=%d",
                         log ? "log_softmax" : "softmax", (long long)c.sizes[0], (long long)c.sizes[1],
                         (long long)c.sizes[2], c.ndim, c.dim, layout);
                int64_t numel = 1;
                for (int d = 0; d < c.ndim; d++) numel *= c.sizes[d];
                sweep(desc, &c, go_softmax, isa, ALL, numel == 0);
            }
}

/* ---- norms ------------------------------------------------------------------------------------------------- */

typedef struct norm_cfg {
    int nlead;
    int64_t lead[2], hidden;
    int weight, bias, offset, residual, padded; /* padded: x's rows 3 elements apart more than dense */
} norm_cfg;

static void go_norm(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const norm_cfg *c = cv;
    norm_shape sh = {.hidden = c->hidden, .nlead = c->nlead, .dt = dt, .eps = 1e-5, .offset = c->offset};
    sh.rows = 1;
    for (int d = 0; d < c->nlead; d++) sh.lead[d] = c->lead[d], sh.rows *= c->lead[d];
    const int64_t rows = sh.rows, h = c->hidden, rs = c->padded ? h + 3 : h;
    norm_mat x = {.cs = 1}, res = {.cs = 1}, g = {.cs = 1}, gs = {.cs = 1}, w = {.cs = 1}, b = {.cs = 1};
    for (int d = c->nlead - 1, step = 1; d >= 0; step *= (int)c->lead[d], d--) {
        x.rs[d] = res.rs[d] = rs * step;
        g.rs[d] = gs.rs[d] = h * step;
    }
    void *xb = arr_grid(rows * rs, dt, 1, 2.0, 0.0), *rb = arr_grid(rows * rs, dt, 2, 1.0, 0.0);
    void *gb = arr_grid(rows * h, dt, 3, 1.0, 0.0), *gsb = arr_grid(rows * h, dt, 4, 1.0, 0.0);
    void *wb = arr_grid(h, dt, 5, 1.0, 0.0), *bb = arr_grid(h, dt, 6, 1.0, 0.0);
    x.data = xb, res.data = rb, g.data = gb, gs.data = gsb, w.data = c->weight ? wb : NULL,
    b.data = c->bias ? bb : NULL;
    const norm_kernels *kern = norm_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    /* rms_norm, or add_rms_norm with its sum, and the backward from the saved rstd */
    void *y = out_new(o, "rms y", rows * h, dt), *s = c->residual ? out_new(o, "rms s", rows * h, dt) : NULL;
    float *rstd = out_new(o, "rms rstd", rows, OPF_F32);
    norm_rms_fwd(kern, &sh, y, s, rstd, &x, c->residual ? &res : NULL, &w);
    norm_mat sm = {.data = s, .cs = 1}; /* the backward of add_rms_norm reads the sum */
    for (int d = 0; d < c->nlead; d++) sm.rs[d] = g.rs[d];
    void *dx = out_new(o, "rms dx", rows * h, dt), *dres = c->residual ? out_new(o, "rms dres", rows * h, dt) : NULL;
    void *dw = c->weight ? out_new(o, "rms dweight", h, dt) : NULL;
    float *ws = ws_new(norm_bwd_workspace(&sh, c->weight, 0));
    norm_mat nogs = {.data = NULL};
    norm_rms_bwd(kern, &sh, dx, dres, dw, &g, c->residual ? &gs : &nogs, c->residual ? &sm : &x, rstd, &w, ws);
    ws_free(ws, "rms backward workspace");
    /* layer_norm */
    y = out_new(o, "ln y", rows * h, dt);
    float *mean = out_new(o, "ln mean", rows, OPF_F32);
    rstd = out_new(o, "ln rstd", rows, OPF_F32);
    norm_ln_fwd(kern, &sh, y, mean, rstd, &x, &w, &b);
    dx = out_new(o, "ln dx", rows * h, dt);
    dw = c->weight ? out_new(o, "ln dweight", h, dt) : NULL;
    void *db = c->bias ? out_new(o, "ln dbias", h, dt) : NULL;
    ws = ws_new(norm_bwd_workspace(&sh, c->weight, c->bias));
    norm_ln_bwd(kern, &sh, dx, dw, db, &g, &x, mean, rstd, &w, ws);
    ws_free(ws, "ln backward workspace");
    if (rows == 0) /* no row: zero weight and bias gradients */
        for (int64_t i = 0; i < h; i++)
            CHECK((!dw || opf_load_elem(dw, i, dt) == 0.0) && (!db || opf_load_elem(db, i, dt) == 0.0),
                  "%s: weight / bias gradient %lld not 0 without a row", ctx, (long long)i);
    arr_free(xb, "x"), arr_free(rb, "residual"), arr_free(gb, "grad"), arr_free(gsb, "grad_sum");
    arr_free(wb, "weight"), arr_free(bb, "bias");
}

static void sweep_norm(opf_isa isa) {
    /* (nlead, lead, hidden); 40 rows are two backward blocks; the last splits over threads */
    static const int64_t shapes[][4] = {{1, 0, 0, 5},  {1, 5, 0, 0}, {1, 0, 0, 0},    {1, 1, 0, 1},  {1, 1, 0, 7},
                                        {1, 3, 0, 1},  {2, 2, 3, 7}, {2, 3, 0, 5},    {1, 17, 0, 3}, {2, 0, 3, 4},
                                        {1, 40, 0, 3}, {2, 5, 9, 2}, {1, 130, 0, 257}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int v = 0; v < 4; v++) {
            const int64_t *s = shapes[i];
            norm_cfg c = {(int)s[0], {s[1], s[2]}, s[3], v != 1, v % 2 == 0, v == 2, v >= 2, v == 3};
            char desc[160];
            snprintf(desc, sizeof desc,
                     "norm lead=(%lld, %lld)[:%d] hidden=%lld weight=%d bias=%d offset=%d "
                     "residual=%d padded=%d",
                     (long long)c.lead[0], (long long)c.lead[1], c.nlead, (long long)c.hidden, c.weight, c.bias,
                     c.offset, c.residual, c.padded);
            int64_t rows = c.lead[0] * (c.nlead == 2 ? c.lead[1] : 1);
            sweep(desc, &c, go_norm, isa, ALL, rows * c.hidden == 0);
        }
}

/* ---- glu, dispersion_correction: elementwise over opf_nd ---------------------------------------------------- */

typedef struct elementwise_cfg {
    int ndim;
    int64_t sizes[3];
    int transposed; /* inputs with their first two dims swapped in memory */
    int act;
} elementwise_cfg;

/* contiguous strides of the sizes, and (transposed) of the first two dims swapped in memory */
static int64_t elementwise_strides(const elementwise_cfg *c, int64_t *cst, int64_t *st) {
    int64_t numel = 1;
    for (int d = c->ndim - 1; d >= 0; numel *= c->sizes[d], d--) cst[d] = numel;
    memcpy(st, cst, sizeof(int64_t) * 3);
    if (c->transposed && c->ndim >= 2) st[0] = cst[1], st[1] = c->sizes[0] * cst[1];
    return numel;
}

static void go_glu(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const elementwise_cfg *c = cv;
    int64_t cst[3], st[3];
    const int64_t n = elementwise_strides(c, cst, st);
    void *gate = arr_grid(n, dt, 1, 3.0, 0.0), *up = arr_grid(n, dt, 2, 1.0, 0.0), *g = arr_grid(n, dt, 3, 1.0, 0.0);
    const glu_kernels *kern = glu_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    opf_nd nd;
    opf_nd_init(&nd, c->ndim, c->sizes, 3, (const int64_t *const[]){cst, st, st});
    void *out = out_new(o, "out", n, dt);
    glu_fwd(kern, dt, &nd, out, gate, up, (act_kind)c->act);
    opf_nd_init(&nd, c->ndim, c->sizes, 4, (const int64_t *const[]){cst, cst, st, st});
    void *dgate = out_new(o, "dgate", n, dt), *dup = out_new(o, "dup", n, dt);
    glu_bwd(kern, dt, &nd, dgate, dup, g, gate, up, (act_kind)c->act);
    arr_free(gate, "gate"), arr_free(up, "up"), arr_free(g, "grad");
}

static void go_dc(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const elementwise_cfg *c = cv;
    int64_t cst[3], st[3];
    const int64_t n = elementwise_strides(c, cst, st);
    void *x = arr_grid(n, dt, 1, 0.5, 1.0), *g = arr_grid(n, dt, 2, 1.0, 0.0); /* x in [0.5, 1.5]: no sqrt of < 0 */
    const dispersion_correction_kernels *kern = dispersion_correction_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    opf_nd nd;
    opf_nd_init(&nd, c->ndim, c->sizes, 2, (const int64_t *const[]){cst, st});
    void *y = out_new(o, "y", n, dt);
    dispersion_correction_fwd(kern, dt, &nd, y, x, 0.7);
    opf_nd_init(&nd, c->ndim, c->sizes, 3, (const int64_t *const[]){cst, cst, st});
    void *dx = out_new(o, "dx", n, dt);
    dispersion_correction_bwd(kern, dt, &nd, dx, g, x, 0.7);
    arr_free(x, "x"), arr_free(g, "grad");
}

static void sweep_elementwise(opf_isa isa) {
    static const struct {
        int ndim;
        int64_t sizes[3];
    } shapes[] = {{0, {0}},    {1, {0}},      {1, {1}},       {1, {7}},       {1, {17}},
                  {2, {0, 5}}, {2, {5, 0}},   {3, {3, 0, 2}}, {3, {2, 3, 5}}, {3, {1, 1, 1}},
                  {2, {5, 3}}, {2, {33, 70}}, {2, {300, 257}}};
    static const int acts[] = {ACT_SILU, ACT_GELU, ACT_GELU_TANH};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int transposed = 0; transposed < 2; transposed++) {
            elementwise_cfg c = {shapes[i].ndim, {0}, transposed, acts[(i + (size_t)transposed) % 3]};
            memcpy(c.sizes, shapes[i].sizes, sizeof c.sizes);
            int64_t numel = 1;
            for (int d = 0; d < c.ndim; d++) numel *= c.sizes[d];
            char desc[160];
            snprintf(desc, sizeof desc, "glu sizes=(%lld, %lld, %lld)[:%d] transposed=%d act=%d", (long long)c.sizes[0],
                     (long long)c.sizes[1], (long long)c.sizes[2], c.ndim, transposed, c.act);
            sweep(desc, &c, go_glu, isa, ALL, numel == 0);
            snprintf(desc, sizeof desc, "dispersion_correction sizes=(%lld, %lld, %lld)[:%d] transposed=%d",
                     (long long)c.sizes[0], (long long)c.sizes[1], (long long)c.sizes[2], c.ndim, transposed);
            sweep(desc, &c, go_dc, isa, ALL, numel == 0);
        }
}

/* ---- rope ------------------------------------------------------------------------------------------------- */

typedef struct rope_cfg {
    int64_t b, hq, hk, n, d, r;
    int table, interleaved; /* table: cos / sin a table of 5 rows picked by positions (B, N); else (N, R) */
} rope_cfg;

static void go_rope(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const rope_cfg *c = cv;
    const int64_t nq = c->b * c->hq * c->n * c->d, nk = c->b * c->hk * c->n * c->d, rows = c->table ? 5 : c->n;
    void *q = arr_grid(nq, dt, 1, 1.0, 0.0), *k = arr_grid(nk, dt, 2, 1.0, 0.0);
    void *cs = arr_grid(rows * c->r, dt, 3, 1.0, 0.0), *sn = arr_grid(rows * c->r, dt, 4, 1.0, 0.0);
    int64_t *pos = arr_new(c->b * c->n, sizeof(int64_t));
    for (int64_t i = 0; i < c->b * c->n; i++) pos[i] = (i * 3 + 1) % 5;
    rope_problem p = {.dt = dt,
                      .b = c->b,
                      .hq = c->hq,
                      .hk = c->hk,
                      .n = c->n,
                      .d = c->d,
                      .r = c->r,
                      .interleaved = c->interleaved,
                      .q = q,
                      .k = k,
                      .cos = cs,
                      .sin = sn,
                      .pos = c->table ? pos : NULL,
                      .cb = 0,
                      .cn = c->r,
                      .cr = 1,
                      .sb = 0,
                      .sn = c->r,
                      .sr = 1,
                      .pb = c->n,
                      .pn = 1};
    int64_t bad = 0;
    if (c->table)
        CHECK(rope_check_positions(pos, c->b, c->n, c->n, 1, rows, &bad) == -1, "%s: positions in range refused", ctx);
    strides4(0, c->hq, c->n, c->d, p.qs), strides4(1, c->hk, c->n, c->d, p.ks); /* k in (B, N, H, D) memory */
    strides4(0, c->hq, c->n, c->d, p.oqs), strides4(0, c->hk, c->n, c->d, p.oks);
    const rope_kernels *kern = rope_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa);
    for (int inverse = 0; inverse < 2; inverse++) { /* the forward, then the backward's transposed rotation */
        p.inverse = inverse;
        p.oq = out_new(o, inverse ? "dq" : "q_out", nq, dt), p.ok = out_new(o, inverse ? "dk" : "k_out", nk, dt);
        rope_run(kern, &p);
    }
    arr_free(q, "q"), arr_free(k, "k"), arr_free(cs, "cos"), arr_free(sn, "sin"), arr_free(pos, "position_ids");
}

static void sweep_rope(opf_isa isa) {
    static const int64_t shapes[][7] = {{0, 2, 1, 3, 4, 4, 0}, {1, 0, 0, 3, 4, 4, 0},   {1, 2, 0, 3, 4, 4, 1},
                                        {1, 0, 2, 3, 4, 4, 1}, {1, 2, 1, 0, 4, 4, 1},   {1, 2, 1, 0, 4, 4, 0},
                                        {1, 2, 1, 3, 0, 0, 0}, {1, 2, 1, 3, 5, 0, 1},   {1, 1, 1, 1, 2, 2, 0},
                                        {2, 3, 1, 5, 7, 4, 1}, {2, 4, 2, 7, 10, 6, 0},  {3, 2, 2, 17, 6, 6, 1},
                                        {2, 1, 3, 3, 9, 8, 0}, {1, 4, 4, 130, 4, 2, 1}, {2, 8, 2, 300, 64, 64, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int inter = 0; inter < 2; inter++) {
            const int64_t *s = shapes[i];
            rope_cfg c = {s[0], s[1], s[2], s[3], s[4], s[5], (int)s[6], inter};
            char desc[160];
            snprintf(desc, sizeof desc, "rope B=%lld Hq=%lld Hk=%lld N=%lld D=%lld R=%lld table=%d interleaved=%d",
                     (long long)c.b, (long long)c.hq, (long long)c.hk, (long long)c.n, (long long)c.d, (long long)c.r,
                     c.table, inter);
            sweep(desc, &c, go_rope, isa, ALL, c.b * (c.hq + c.hk) * c.n * c.d == 0);
        }
}

/* ---- adamw: a list of tensors laid end to end, split over threads ------------------------------------------- */

typedef struct adamw_cfg {
    int count;
    int64_t numel[5];
} adamw_cfg;

/* The tensors are slices of one array per operand; float32 and bfloat16 parameters (moments float32); the
 * oracle (OPF_F64) is the reference kernel on float32 parameters at one thread, as adamw takes no float64 */
static void go_adamw(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const adamw_cfg *c = cv;
    const opf_dtype pdt = dt == OPF_F64 ? OPF_F32 : dt;
    int64_t total = 0;
    for (int i = 0; i < c->count; i++) total += c->numel[i];
    void *p = out_new(o, "param", total, pdt), *g = arr_grid(total, pdt, 2, 1.0, 0.0);
    float *m = out_new(o, "exp_avg", total, OPF_F32), *v = out_new(o, "exp_avg_sq", total, OPF_F32);
    void *p0 = arr_grid(total, pdt, 1, 1.0, 0.0), *m0 = arr_grid(total, OPF_F32, 3, 0.25, 0.0);
    void *v0 = arr_grid(total, OPF_F32, 4, 0.125, 0.125); /* >= 0, as a second moment is */
    memcpy(p, p0, (size_t)total * opf_dtype_size(pdt));
    memcpy(m, m0, (size_t)total * sizeof(float));
    memcpy(v, v0, (size_t)total * sizeof(float));
    float steps[5];
    adamw_tensor ts[5];
    for (int i = 0, at = 0; i < c->count; at += (int)c->numel[i], i++) {
        steps[i] = (float)i;
        ts[i] = (adamw_tensor){.param = (char *)p + at * opf_dtype_size(pdt),
                               .exp_avg = m + at,
                               .exp_avg_sq = v + at,
                               .grad = (char *)g + at * opf_dtype_size(pdt),
                               .step = &steps[i],
                               .numel = c->numel[i],
                               .dt = pdt,
                               .step_dt = OPF_F32};
    }
    const adamw_hparams h = {.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
    adamw_step(adamw_kernels_for(dt == OPF_F64 ? OPF_ISA_REF : isa), ts, c->count, &h);
    arr_free(g, "grad"), arr_free(p0, "param0"), arr_free(m0, "exp_avg0"), arr_free(v0, "exp_avg_sq0");
}

static void sweep_adamw(opf_isa isa) {
    /* 70001 elements: more than two tasks of ADAMW_GRAIN, so that a task starts inside a tensor */
    static const adamw_cfg lists[] = {
        {0, {0}}, {1, {0}}, {2, {0, 0}}, {1, {1}}, {3, {7, 0, 17}}, {2, {70001, 33}}, {5, {1, 0, 40000, 3, 40001}}};
    for (size_t i = 0; i < sizeof lists / sizeof *lists; i++) {
        char desc[120];
        int64_t total = 0;
        for (int t = 0; t < lists[i].count; t++) total += lists[i].numel[t];
        snprintf(desc, sizeof desc, "adamw %d tensors of %lld elements", lists[i].count, (long long)total);
        sweep(desc, &lists[i], go_adamw, isa, F32 | BF16, 0);
    }
}

/* ---- threaded helpers: g' = g act'(pre) with column sums, column sums, conversions ------------------------------ */

typedef struct helpers_cfg {
    int64_t m, n;
} helpers_cfg;

/* g' = g gelu'(pre) with its column sums (act_grad_rows), column sums onto 0.5 (colsum_f32), and g to float32
 * and back (convert_load_f32, convert_store_f32); the oracle in double, as these take no float64 */
static void go_helpers(const void *cv, opf_isa isa, opf_dtype dt, outs *o) {
    const int64_t m = ((const helpers_cfg *)cv)->m, n = ((const helpers_cfg *)cv)->n;
    const opf_dtype acc = dt == OPF_F64 ? OPF_F64 : OPF_F32;
    void *g = arr_grid(m * n, dt, 1, 1.0, 0.0), *pre = arr_grid(m * n, dt, 2, 3.0, 0.0);
    void *out = out_new(o, "g'", m * n, dt), *db = out_new(o, "dbias", n, acc), *cs = out_new(o, "colsum", n, acc);
    void *f = out_new(o, "float32", m * n, acc), *back = out_new(o, "converted back", m * n, dt);
    for (int64_t j = 0; j < n; j++) opf_store_elem(cs, j, acc, 0.5);
    if (dt == OPF_F64) {
        for (int64_t j = 0; j < n; j++) {
            double sum = 0.0, gsum = 0.5;
            for (int64_t r = 0; r < m; r++) {
                const double x = ((double *)g)[r * n + j], y = x * act_grad_f64(ACT_GELU, ((double *)pre)[r * n + j]);
                ((double *)out)[r * n + j] = y, sum += y, gsum += x;
            }
            ((double *)db)[j] = sum, ((double *)cs)[j] = gsum;
        }
        memcpy(f, g, (size_t)(m * n) * sizeof(double)), memcpy(back, g, (size_t)(m * n) * sizeof(double));
    } else {
        const convert_kernels *cvt = convert_kernels_for(isa);
        act_grad_rows(act_kernels_for(isa), cvt, dt, out, n, g, n, pre, n, m, n, ACT_GELU, db, threads_now());
        colsum_f32(cvt, cs, g, dt, n, m, n, 1);
        convert_load_f32(cvt, f, g, dt, m * n, 1);
        convert_store_f32(cvt, back, dt, f, m * n);
    }
    arr_free(g, "g"), arr_free(pre, "pre");
}

static void sweep_helpers(opf_isa isa) {
    /* 600 columns: act_grad_rows sums them by column on up to 2 threads, by row chunk on more */
    static const helpers_cfg shapes[] = {{0, 0}, {0, 5}, {5, 0}, {1, 1}, {3, 7}, {17, 3}, {2, 70}, {3, 600}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        char desc[80];
        snprintf(desc, sizeof desc, "helpers m=%lld n=%lld", (long long)shapes[i].m, (long long)shapes[i].n);
        sweep(desc, &shapes[i], go_helpers, isa, ALL, shapes[i].m * shapes[i].n == 0);
    }
}

int main(void) {
    threads = opf_num_threads();
    set_threads(threads);
    printf("test_sweep: %d threads (OPFORGE_NUM_THREADS)\n", threads);
    for (int isa = 0; isa < OPF_ISA_COUNT; isa++) {
        if (!check_use_isa(isa)) continue;
        const int before = cases_run;
        sweep_attention((opf_isa)isa);
        sweep_decode((opf_isa)isa);
        sweep_gemm((opf_isa)isa);
        sweep_matmul((opf_isa)isa);
        sweep_linear((opf_isa)isa);
        sweep_lce((opf_isa)isa);
        sweep_ce((opf_isa)isa);
        sweep_softmax((opf_isa)isa);
        sweep_norm((opf_isa)isa);
        sweep_elementwise((opf_isa)isa);
        sweep_rope((opf_isa)isa);
        sweep_helpers((opf_isa)isa);
        sweep_adamw((opf_isa)isa);
        printf("swept %s: %d cases\n", opf_isa_name((opf_isa)isa), cases_run - before);
    }
    CHECK(cases_run > 0, "no case ran");
    return check_report("test_sweep");
}
