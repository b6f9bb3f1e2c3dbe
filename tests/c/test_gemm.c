/*
 * Every compiled GEMM variant against the double-accumulating oracle, on
 * shapes that are not multiples of the register or cache blocks, with
 * transposed and strided operands and every epilogue (alpha, beta, bias per row and
 * per column, each activation, the pre-activation store); the activations
 * and their derivatives at infinities, huge values and NaN as the scalar
 * ones; the log naming the table whose kernel ran for each operand type.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the thread count per test */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/gemm.h"
#include "check.h"

static const char *const ACT[] = {"none", "relu", "gelu", "gelu_tanh", "silu"};

typedef struct shape {
    int64_t m, n, k;
} shape;

/* a product's plan at this run's thread count, as the glue makes it */
static gemm_plan plan_of(const gemm_kernels *kern, int64_t m, int64_t n, int64_t k, opf_dtype ta, opf_dtype tb) {
    return gemm_plan_make(kern, m, n, k, ta, tb, opf_num_threads());
}

static float *rand_buf(int64_t n, unsigned long long seed) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    for (int64_t i = 0; i < n; i++) p[i] = (float)(check_uniform(&seed) * 2.0 - 1.0);
    return p;
}

/* one product: A stored (m,k) or transposed (k,m); B (k,n) or (n,k); A's rows
 * spaced by an extra pad to make it strided */
static void run_scaled(const gemm_kernels *kern, shape s, int ta, int tb, float alpha, float beta, int bias_kind,
                       int act, int preact) {
    const int64_t pad = 3;
    int64_t lda = (ta ? s.m : s.k) + pad;
    float *a = rand_buf((ta ? s.k : s.m) * lda, 1 + (unsigned long long)s.m);
    float *b = rand_buf(s.k * s.n, 2 + (unsigned long long)s.n);
    float *bias = rand_buf(s.m > s.n ? s.m : s.n, 3);
    float *c = rand_buf(s.m * s.n, 4), *want = malloc((size_t)(s.m * s.n + 1) * sizeof(float));
    float *pre = calloc((size_t)(s.m * s.n + 1), sizeof(float)),
          *pre_want = calloc((size_t)(s.m * s.n + 1), sizeof(float));
    memcpy(want, c, (size_t)(s.m * s.n) * sizeof(float));
    int64_t rsa = ta ? 1 : lda, csa = ta ? lda : 1, rsb = tb ? 1 : s.n, csb = tb ? s.k : 1;
    gemm_epilogue ep = {
        .beta = beta, .bias = bias, .bias_kind = bias_kind, .act = act, .preact = preact ? pre : NULL, .rsp = s.n};
    if (alpha != 1.0f) ep.alpha = &alpha;
    gemm_epilogue ep_ref = ep;
    ep_ref.preact = preact ? pre_want : NULL;
    gemm_ref_f32(s.m, s.n, s.k, a, rsa, csa, b, rsb, csb, want, s.n, &ep_ref);
    const gemm_plan plan = plan_of(kern, s.m, s.n, s.k, OPF_F32, OPF_F32);
    int64_t wsn = gemm_workspace(&plan);
    float *ws = check_ws_alloc(wsn);
    CHECK(gemm_run(&plan, a, rsa, csa, b, rsb, csb, c, s.n, &ep, ws, wsn) == 0, "%s: workspace refused", kern->name);
    check_ws_free(ws, kern->name);
    int64_t bad = 0, first = -1;
    double maxerr = 0;
    const double atol = 4e-7 * (double)s.k + 1e-5;
    for (int64_t i = 0; i < s.m * s.n; i++) {
        double e = fabs((double)c[i] - want[i]);
        if (preact) e = fmax(e, fabs((double)pre[i] - pre_want[i]));
        if (!(e <= atol + 1e-5 * fabs(want[i]))) {
            if (first < 0) first = i;
            bad++;
        }
        if (e > maxerr) maxerr = e;
    }
    CHECK(bad == 0,
          "%s m=%lld n=%lld k=%lld ta=%d tb=%d alpha=%g beta=%g bias=%d act=%s pre=%d: %lld bad, first (%lld,%lld) "
          "got %.7g want %.7g, max err %.3g",
          kern->name, (long long)s.m, (long long)s.n, (long long)s.k, ta, tb, alpha, beta, bias_kind, ACT[act], preact,
          (long long)bad, first < 0 ? -1LL : (long long)(first / s.n), first < 0 ? -1LL : (long long)(first % s.n),
          first < 0 ? 0.0 : c[first], first < 0 ? 0.0 : want[first], maxerr);
    free(a), free(b), free(bias), free(c), free(want), free(pre), free(pre_want);
}

static void run(const gemm_kernels *kern, shape s, int ta, int tb, float beta, int bias_kind, int act, int preact) {
    run_scaled(kern, s, ta, tb, 1.0f, beta, bias_kind, act, preact);
}

static void test_act_grad(const act_kernels *k) {
    enum { N = 1003 };
    float g[N], pre[N], got[N];
    unsigned long long seed = 5;
    for (int i = 0; i < N; i++) {
        g[i] = (float)(check_uniform(&seed) * 2 - 1);
        pre[i] = (float)(check_uniform(&seed) * 16 - 8);
    }
    for (int act = 0; act < ACT_COUNT; act++) {
        k->grad(got, g, pre, N, act);
        double worst = 0;
        for (int i = 0; i < N; i++) worst = fmax(worst, fabs(got[i] - g[i] * act_grad_f64(act, pre[i])));
        CHECK(worst < 2e-6, "%s act_grad %s: max error %g", k->name, ACT[act], worst);
    }
}

/* Pre-activations at the edges of exp's range (infinities, magnitudes whose square overflows float32,
 * exponents far below the smallest float) and NaN */
static const float SPECIAL[] = {INFINITY, -INFINITY, -1e30f, -1e25f, 1e30f, 1e25f, -100.0f,
                                100.0f,   -20.0f,    20.0f,  -2.0f,  0.5f,  NAN};
enum { NSPECIAL = sizeof SPECIAL / sizeof *SPECIAL };

/* got as want: NaN where want is NaN, the same infinity, within 1e-4 relative (an exact 0 where 0) */
static int same_value(float got, float want) {
    if (isnan(want) || isnan(got)) return isnan(want) && isnan(got);
    return got == want || fabsf(got - want) <= 1e-4f * fabsf(want);
}

/* the derivative at SPECIAL as the scalar reference's: the vector exp clamped its argument to [-87.3, 88.7],
 * so GELU's x phi(x) was inf x 1e-38 = inf at inf (the reference: inf x 0 = NaN) and -4.86e-9 at -1e30 */
static void test_act_grad_special(const act_kernels *k) {
    float g[NSPECIAL], got[NSPECIAL];
    for (int i = 0; i < NSPECIAL; i++) g[i] = 1.0f;
    for (int act = 1; act < ACT_COUNT; act++) {
        k->grad(got, g, SPECIAL, NSPECIAL, act);
        for (int i = 0; i < NSPECIAL; i++)
            CHECK(same_value(got[i], act_grad_f32(act, SPECIAL[i])), "%s act_grad %s at %g: got %g, reference %g",
                  k->name, ACT[act], SPECIAL[i], got[i], act_grad_f32(act, SPECIAL[i]));
    }
}

/* g' = g * act'(pre) over strided rows, in place or not, with and without
 * the fused dbias sums (few columns: rows split, then sums; many: columns
 * split, each thread summing its own), float32 and 16-bit: against g' from
 * the scalar derivative and sums in double of g' as stored */
static void test_act_grad_rows(const act_kernels *k) {
    const convert_kernels *cvt = convert_kernels_for(opf_isa_current());
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    const int64_t shapes[][2] = {{5, 3}, {37, 100}, {19, 1500}};
    unsigned long long seed = 11;
    for (int d = 0; d < 3; d++)
        for (int si = 0; si < 3; si++)
            for (int mode = 0; mode < 4; mode++) { /* in place or not, x sums or not */
                const int in_place = mode & 1, sums = mode >> 1;
                const opf_dtype dt = dts[d];
                const int64_t m = shapes[si][0], n = shapes[si][1], rsg = n + 5, rsp = n + 3, es = opf_dtype_size(dt);
                const int act = 1 + (d + si + mode) % (ACT_COUNT - 1);
                char *g = malloc(m * rsg * es), *pre = malloc(m * rsp * es), *sep = malloc(m * rsp * es);
                float *db = malloc(n * sizeof(float));
                double *want = malloc(m * n * sizeof(double));
                for (int64_t e = 0; e < m * rsg; e++) opf_store_elem(g, e, dt, check_uniform(&seed) * 2 - 1);
                for (int64_t e = 0; e < m * rsp; e++) opf_store_elem(pre, e, dt, check_uniform(&seed) * 8 - 4);
                for (int64_t i = 0; i < m; i++)
                    for (int64_t c = 0; c < n; c++)
                        want[i * n + c] =
                            opf_load_elem(g, i * rsg + c, dt) * act_grad_f64(act, opf_load_elem(pre, i * rsp + c, dt));
                char *out = in_place ? pre : sep;
                act_grad_rows(k, cvt, dt, out, rsp, g, rsg, pre, rsp, m, n, act, sums ? db : NULL, opf_num_threads());
                const double tol = dt == OPF_F32 ? 4e-6 : dt == OPF_BF16 ? 8e-3 : 1e-3;
                int64_t bad = 0, bad_sums = 0;
                for (int64_t i = 0; i < m; i++)
                    for (int64_t c = 0; c < n; c++)
                        bad += fabs(opf_load_elem(out, i * rsp + c, dt) - want[i * n + c]) >
                               tol * (1 + fabs(want[i * n + c]));
                for (int64_t c = 0; sums && c < n; c++) { /* the sums of g' as stored */
                    double sum = 0;
                    for (int64_t i = 0; i < m; i++) sum += opf_load_elem(out, i * rsp + c, dt);
                    bad_sums += fabs(db[c] - sum) > 1e-6 * m * (1 + fabs(sum));
                }
                CHECK(bad == 0 && bad_sums == 0,
                      "%s act_grad_rows %s m=%lld n=%lld in_place=%d sums=%d: %lld bad, %lld bad sums", k->name,
                      dt == OPF_F32    ? "f32"
                      : dt == OPF_BF16 ? "bf16"
                                       : "f16",
                      (long long)m, (long long)n, in_place, sums, (long long)bad, (long long)bad_sums);
                free(g), free(pre), free(sep), free(db), free(want);
            }
}

/* bfloat16 / float16 operands, converted while packed: against the oracle on
 * the same (rounded) values */
static void test_half_operands_m(const gemm_kernels *k, int64_t m) {
    const int64_t n = 45, kd = 300;
    float *a = rand_buf(m * kd, 11), *b = rand_buf(kd * n, 12), *want = malloc(sizeof(float) * m * n);
    float *got = malloc(sizeof(float) * m * n);
    uint16_t *ah = malloc(2 * (size_t)(m * kd)), *bh = malloc(2 * (size_t)(kd * n));
    for (int dt = OPF_BF16; dt <= OPF_F16; dt++) {
        const gemm_plan plan = plan_of(k, m, n, kd, dt, dt);
        const int64_t wsn = gemm_workspace(&plan);
        float *ws = check_ws_alloc(wsn);
        convert_store_f32(k->cvt, ah, dt, a, m * kd);
        convert_store_f32(k->cvt, bh, dt, b, kd * n);
        float *ar = malloc(sizeof(float) * m * kd), *br = malloc(sizeof(float) * kd * n);
        convert_load_f32(k->cvt, ar, ah, dt, m * kd, 1);
        convert_load_f32(k->cvt, br, bh, dt, kd * n, 1);
        gemm_epilogue ep = {0};
        gemm_ref_f32(m, n, kd, ar, kd, 1, br, 1, kd, want, n, &ep); /* B read transposed */
        CHECK(gemm_run(&plan, ah, kd, 1, bh, 1, kd, got, n, &ep, ws, wsn) == 0, "workspace refused");
        check_ws_free(ws, "half operands");
        double worst = 0;
        for (int64_t i = 0; i < m * n; i++) worst = fmax(worst, fabs((double)got[i] - want[i]));
        CHECK(worst < 1e-4, "%s %s operands: max error %g", k->name, dt == OPF_BF16 ? "bf16" : "f16", worst);
        free(ar), free(br);
    }
    free(a), free(b), free(want), free(got), free(ah), free(bh);
}

static void test_half_operands(const gemm_kernels *k) {
    test_half_operands_m(k, 37);
    test_half_operands_m(k, 3); /* skinny: a bfloat16 B read along K as it is */
}

/* One product on bfloat16 pairs: A and B each bfloat16 or float32 (at least
 * one bfloat16), stored plain or transposed, A with padded rows, an epilogue
 * with bias, activation and pre-activation. The oracle multiplies the same
 * operands rounded to bfloat16. */
static void run_pairs(const gemm_kernels *k, shape s, int ta, int tb, opf_dtype da, opf_dtype db, int act) {
    const int64_t pad = 5, lda = (ta ? s.m : s.k) + pad, na = (ta ? s.k : s.m) * lda, nb = s.k * s.n;
    float *a = rand_buf(na, 21 + (unsigned long long)s.k), *b = rand_buf(nb, 22 + (unsigned long long)s.m);
    float *bias = rand_buf(s.n, 23), *want = calloc((size_t)(s.m * s.n + 1), sizeof(float));
    float *got = calloc((size_t)(s.m * s.n + 1), sizeof(float)), *pre = calloc((size_t)(s.m * s.n + 1), sizeof(float));
    float *pre_want = calloc((size_t)(s.m * s.n + 1), sizeof(float));
    uint16_t *ah = malloc(2 * (size_t)na + 2), *bh = malloc(2 * (size_t)nb + 2);
    convert_store_f32(k->cvt, ah, OPF_BF16, a, na);
    convert_store_f32(k->cvt, bh, OPF_BF16, b, nb);
    float *ar = malloc(sizeof(float) * (size_t)(na + 1)), *br = malloc(sizeof(float) * (size_t)(nb + 1));
    convert_load_f32(k->cvt, ar, ah, OPF_BF16, na, 1); /* what the pair kernel multiplies */
    convert_load_f32(k->cvt, br, bh, OPF_BF16, nb, 1);
    int64_t rsa = ta ? 1 : lda, csa = ta ? lda : 1, rsb = tb ? 1 : s.n, csb = tb ? s.k : 1;
    gemm_epilogue ep = {.bias = bias, .bias_kind = GEMM_BIAS_ROW, .act = act, .preact = pre, .rsp = s.n}, ep_ref = ep;
    ep_ref.preact = pre_want;
    gemm_ref_f32(s.m, s.n, s.k, ar, rsa, csa, br, rsb, csb, want, s.n, &ep_ref);
    const gemm_plan plan = plan_of(k, s.m, s.n, s.k, da, db);
    const int64_t wsn = gemm_workspace(&plan);
    float *ws = check_ws_alloc(wsn);
    /* both bfloat16: results written as bfloat16 by the epilogue, read back */
    const int out16 = da == OPF_BF16 && db == OPF_BF16;
    uint16_t *got16 = malloc(2 * (size_t)(s.m * s.n) + 2), *pre16 = malloc(2 * (size_t)(s.m * s.n) + 2);
    if (out16) {
        ep.out16 = got16, ep.pre16 = pre16, ep.preact = NULL, ep.out_dt = OPF_BF16;
        if (s.k <= gemm_slice_depth(k, da, db)) { /* one slice: no float32 C at all */
            free(got);
            got = NULL;
        }
    }
    CHECK(gemm_run(&plan, da == OPF_BF16 ? (void *)ah : a, rsa, csa, db == OPF_BF16 ? (void *)bh : b, rsb, csb, got,
                   s.n, &ep, ws, wsn) == 0,
          "workspace refused");
    check_ws_free(ws, k->name);
    if (out16) {
        if (!got) got = malloc(sizeof(float) * (size_t)(s.m * s.n + 1));
        convert_load_f32(k->cvt, got, got16, OPF_BF16, s.m * s.n, 1);
        convert_load_f32(k->cvt, pre, pre16, OPF_BF16, s.m * s.n, 1);
    }
    const double atol = 4e-7 * (double)s.k + 1e-5, rel = out16 ? 1.0 / 128 : 1e-5;
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < s.m * s.n; i++) {
        double e = fmax(fabs((double)got[i] - want[i]), fabs((double)pre[i] - pre_want[i]));
        bad += !(e <= atol + rel * fmax(fabs(want[i]), fabs(pre_want[i])));
        worst = fmax(worst, e);
    }
    free(got16), free(pre16);
    CHECK(bad == 0, "%s pairs m=%lld n=%lld k=%lld ta=%d tb=%d a=%s b=%s act=%s: %lld bad, max err %.3g", k->name,
          (long long)s.m, (long long)s.n, (long long)s.k, ta, tb, da == OPF_BF16 ? "bf16" : "f32",
          db == OPF_BF16 ? "bf16" : "f32", ACT[act], (long long)bad, worst);
    free(a), free(b), free(bias), free(want), free(got), free(pre), free(pre_want), free(ah), free(bh), free(ar),
        free(br);
}

static void test_pair_operands(const gemm_kernels *k) {
    const shape shapes[] = {{1, 1, 1},
                            {7, 13, 5},
                            {6, 16, 2},
                            {13, 33, 257},
                            {123, 77, 301},
                            {300, 70, 100},
                            {37, 45, 2 * k->kc + 37}, /* 300 rows: blocks of A per worker */
                            {3, 45, 37},              /* skinny (B read along K, not float32 rounded to pairs) */
                            {8, 70, 300},
                            {5, 33, 2 * k->kc + 37}};
    const opf_dtype types[3][2] = {{OPF_BF16, OPF_BF16}, {OPF_F32, OPF_BF16}, {OPF_BF16, OPF_F32}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int t = 0; t < 3; t++)
                    run_pairs(k, shapes[i], ta, tb, types[t][0], types[t][1], (int)(i + ta + tb) % ACT_COUNT);
}

/* 16-bit results written by the epilogue (out16 / pre16): one K slice with
 * no float32 C, and several slices with C holding the partial sums. */
static void test_out16(const gemm_kernels *k) {
    const shape shapes[] = {{7, 13, 5}, {123, 77, 301}, {37, 45, 4 * k->kc + 37}, {3, 45, 37}, {5, 13, 4 * k->kc + 37}};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        shape s = shapes[si];
        for (int dt = OPF_BF16; dt <= OPF_F16; dt++) {
            float *a = rand_buf(s.m * s.k, 31), *b = rand_buf(s.k * s.n, 32), *bias = rand_buf(s.n, 33);
            float *want = malloc(sizeof(float) * (size_t)(s.m * s.n)),
                  *pre_want = malloc(sizeof(float) * (size_t)(s.m * s.n));
            uint16_t *out = malloc(2 * (size_t)(s.m * s.n)), *pre = malloc(2 * (size_t)(s.m * s.n));
            const int act = ACT_GELU, one = s.k <= gemm_slice_depth(k, OPF_F32, OPF_F32);
            float *c = one ? NULL : malloc(sizeof(float) * (size_t)(s.m * s.n));
            const gemm_plan plan = plan_of(k, s.m, s.n, s.k, OPF_F32, OPF_F32);
            const int64_t wsn = gemm_workspace(&plan);
            float *ws = check_ws_alloc(wsn);
            float alpha = 0.625f; /* on the shape of several K slices: each slice's share scaled */
            gemm_epilogue ref = {.alpha = si == 2 || si == 4 ? &alpha : NULL,
                                 .bias = bias,
                                 .bias_kind = GEMM_BIAS_ROW,
                                 .act = act,
                                 .preact = pre_want,
                                 .rsp = s.n};
            gemm_ref_f32(s.m, s.n, s.k, a, s.k, 1, b, 1, s.k, want, s.n, &ref);
            gemm_epilogue ep = {.alpha = ref.alpha,
                                .bias = bias,
                                .bias_kind = GEMM_BIAS_ROW,
                                .act = act,
                                .rsp = s.n,
                                .out16 = out,
                                .pre16 = pre,
                                .out_dt = dt};
            CHECK(gemm_run(&plan, a, s.k, 1, b, 1, s.k, c, s.n, &ep, ws, wsn) == 0, "workspace refused");
            check_ws_free(ws, k->name);
            const double rel = dt == OPF_BF16 ? 1.0 / 128 : 1.0 / 1024, atol = 4e-7 * (double)s.k + 1e-5;
            int64_t bad = 0;
            for (int64_t i = 0; i < s.m * s.n; i++) {
                float g = dt == OPF_BF16 ? opf_bf16_to_f32(out[i]) : opf_f16_to_f32(out[i]);
                float p = dt == OPF_BF16 ? opf_bf16_to_f32(pre[i]) : opf_f16_to_f32(pre[i]);
                bad += !(fabs(g - want[i]) <= atol + rel * fabs(want[i]));
                bad += !(fabs(p - pre_want[i]) <= atol + rel * fabs(pre_want[i]));
            }
            CHECK(bad == 0, "%s out16 %s m=%lld n=%lld k=%lld (%s): %lld bad", k->name, dt == OPF_BF16 ? "bf16" : "f16",
                  (long long)s.m, (long long)s.n, (long long)s.k, one ? "one slice, no C" : "C for partial sums",
                  (long long)bad);
            free(a), free(b), free(bias), free(want), free(pre_want), free(out), free(pre), free(c);
        }
    }
}

/* The portable pair kernel: the driver's pair packing tested on every CPU. */
static float bf16_lo(uint32_t w) { return opf_bf16_to_f32((uint16_t)(w & 0xffff)); }
static float bf16_hi(uint32_t w) { return opf_bf16_to_f32((uint16_t)(w >> 16)); }

static void ukernel_pairs_4x4(int64_t kp, const uint32_t *ap, const uint32_t *bp, float *c, int64_t rsc, int m, int n,
                              const gemm_tile *t) {
    float acc[16] = {0};
    for (int64_t p = 0; p < kp; p++, ap += 4, bp += 4)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++)
                acc[i * 4 + j] += bf16_lo(ap[i]) * bf16_lo(bp[j]) + bf16_hi(ap[i]) * bf16_hi(bp[j]);
    gemm_tile_store(acc, 4, c, rsc, m, n, t);
}

static void test_pairs_portable(void) {
    gemm_kernels k = gemm_kernels_ref;
    k.name = "ref_4x4 + portable pairs";
    k.ukernel_pairs = ukernel_pairs_4x4;
    test_pair_operands(&k);
    printf("tested %s\n", k.name);
}

/* the vector conversions against the scalar ones, bit for bit (NaN: any NaN) */
static void test_conversions(const convert_kernels *k) {
    enum { N = 65536 + 5 };
    static uint16_t h[N], got16[N], want16[N];
    static float got[N], want[N], f[N];
    unsigned long long seed = 9;
    for (int i = 0; i < N; i++) {
        h[i] = (uint16_t)i;
        f[i] = (float)((check_uniform(&seed) - 0.5) * (i % 3 ? 8.0 : 1e6));
    }
    f[1] = NAN, f[2] = INFINITY, f[3] = -0.0f, f[4] = 70000.0f, f[5] = 1e-41f;
    for (int dt = OPF_BF16; dt <= OPF_F16; dt++) {
        int bad = 0;
        k->to_f32(got, h, dt, N);
        convert_kernels_ref.to_f32(want, h, dt, N);
        for (int i = 0; i < N; i++) bad += !(isnan(got[i]) ? isnan(want[i]) : memcmp(&got[i], &want[i], 4) == 0);
        k->from_f32(got16, f, dt, N);
        convert_kernels_ref.from_f32(want16, f, dt, N);
        for (int i = 0; i < N; i++) bad += !(isnan(f[i]) || got16[i] == want16[i]);
        CHECK(bad == 0, "%s %s conversions: %d mismatches", k->name, dt == OPF_BF16 ? "bf16" : "f16", bad);
    }
}

/* OPFORGE_NUM_THREADS as a test found it (the standalone pool's thread count), to put back after it sets
 * its own */
typedef struct saved_threads {
    int set;
    char value[32];
} saved_threads;

static saved_threads threads_save(void) {
    const char *env = getenv("OPFORGE_NUM_THREADS");
    saved_threads s = {.set = env != NULL};
    if (env) snprintf(s.value, sizeof s.value, "%s", env);
    return s;
}

static void threads_restore(const saved_threads *s) {
    if (s->set)
        setenv("OPFORGE_NUM_THREADS", s->value, 1);
    else
        unsetenv("OPFORGE_NUM_THREADS");
}

/* The workspace a plan carves against the one gemm_workspace reports: every row count from 1 past the
 * point where each worker packs its own blocks of A (the plans switch there, and the need is not monotonic
 * in M), at 1, 2 and 3 threads, float32 / bfloat16 / float16 operands, each run in a workspace of exactly
 * the size reported, between guard words; a plan made for one thread count runs whatever the pool's
 * count is then (the plan, not the pool, says how the work is split); and a workspace smaller than the
 * plan's is refused without a write. */
static void test_workspace_plans(const gemm_kernels *k) {
    const saved_threads saved = threads_save();
    const int64_t n = 2 * k->nr + 3, kd = 9, mmax = 2 * 3 * k->mc + 3 * k->mr;
    float *a = rand_buf(mmax * kd, 41), *b = rand_buf(kd * n, 42), *want = malloc(sizeof(float) * (size_t)(mmax * n));
    float *got = malloc(sizeof(float) * (size_t)(mmax * n));
    uint16_t *ah = malloc(2 * (size_t)(mmax * kd)), *bh = malloc(2 * (size_t)(kd * n));
    gemm_epilogue ep = {0};
    for (int threads = 1; threads <= 3; threads++) {
        char env[8];
        snprintf(env, sizeof env, "%d", threads);
        setenv("OPFORGE_NUM_THREADS", env, 1);
        for (opf_dtype dt = OPF_F32; dt <= OPF_F16; dt = dt == OPF_F32 ? OPF_BF16 : dt + 1) {
            const void *ap = a, *bp = b;
            if (dt != OPF_F32) {
                convert_store_f32(k->cvt, ah, dt, a, mmax * kd);
                convert_store_f32(k->cvt, bh, dt, b, kd * n);
                ap = ah, bp = bh;
            }
            int64_t bad = 0, refused = 0, first_bad = -1;
            for (int64_t m = 1; m <= mmax; m++) {
                const gemm_plan plan = plan_of(k, m, n, kd, dt, dt);
                int64_t wsn = gemm_workspace(&plan);
                float *ws = check_ws_alloc(wsn);
                refused += gemm_run(&plan, ap, kd, 1, bp, n, 1, got, n, &ep, ws, wsn) != 0;
                check_ws_free(ws, k->name);
                if (m == mmax || m % 37 == 0) { /* values too, now and then */
                    float *ar = malloc(sizeof(float) * (size_t)(m * kd)),
                          *br = malloc(sizeof(float) * (size_t)(kd * n));
                    convert_load_f32(k->cvt, ar, ap, dt, m * kd, 1);
                    convert_load_f32(k->cvt, br, bp, dt, kd * n, 1);
                    gemm_ref_f32(m, n, kd, ar, kd, 1, br, n, 1, want, n, &ep);
                    for (int64_t i = 0; i < m * n; i++)
                        if (!(fabs((double)got[i] - want[i]) <= 1e-2 + 1e-2 * fabs(want[i])) && first_bad < 0)
                            first_bad = m;
                    bad += first_bad >= 0;
                    free(ar), free(br);
                }
            }
            CHECK(refused == 0 && bad == 0,
                  "%s workspace sweep dt=%d threads=%d: %lld refused, wrong values from m=%lld", k->name, (int)dt,
                  threads, (long long)refused, (long long)first_bad);
        }
    }
    /* planned at one thread count, run while the pool has another; too small a workspace: refused */
    for (int64_t m = 1; m <= mmax; m += 7) {
        for (int pair = 0; pair < 2; pair++) {
            const gemm_plan plan = gemm_plan_make(k, m, n, kd, OPF_F32, OPF_F32, pair ? 3 : 1);
            setenv("OPFORGE_NUM_THREADS", pair ? "1" : "3", 1);
            const int64_t wsn = gemm_workspace(&plan);
            float *ws = check_ws_alloc(wsn);
            int rc = gemm_run(&plan, a, kd, 1, b, n, 1, got, n, &ep, ws, wsn);
            check_ws_free(ws, "thread count changed");
            gemm_ref_f32(m, n, kd, a, kd, 1, b, n, 1, want, n, &ep);
            int64_t off = 0;
            for (int64_t i = 0; i < m * n; i++) off += !(fabs((double)got[i] - want[i]) <= 1e-4 + 1e-4 * fabs(want[i]));
            CHECK(rc == 0 && off == 0, "%s m=%lld: planned for %d threads, run on %d: rc %d, %lld values off", k->name,
                  (long long)m, pair ? 3 : 1, pair ? 1 : 3, rc, (long long)off);
        }
        const gemm_plan plan = plan_of(k, m, n, kd, OPF_F32, OPF_F32);
        const int64_t wsn = gemm_workspace(&plan);
        float *ws = check_ws_alloc(wsn - 1);
        CHECK(gemm_run(&plan, a, kd, 1, b, n, 1, got, n, &ep, ws, wsn - 1) == -1,
              "%s m=%lld: a workspace one float short was not refused", k->name, (long long)m);
        check_ws_free(ws, "one float short");
    }
    threads_restore(&saved);
    free(a), free(b), free(want), free(got), free(ah), free(bh);
}

/* Plans for many threads (the standalone pool oversubscribed: 5, 16 and 64 threads on this machine):
 * shapes where A is shared and the units (row slivers x column chunks) are dealt in runs that start and
 * end mid-chunk, two N panels, one and two K slices, and few tiles over many K slices (slices run at
 * once: gemm_plan.ksplit, in rounds where they are more than a round takes); float32 and 16-bit operands
 * (the pair kernel's strips); epilogues: a bias and an activation with beta 0 (C starts NaN: a skipped
 * tile shows) and 0.5 (a tile run twice shows), alpha with a per-row bias and the pre-activation, and
 * 16-bit results with their pre-activation (C then holds the earlier slices' sums); every value against
 * the oracle, and the same bits as one thread. */
enum { MANY_EPILOGUES = 4 };

static gemm_epilogue many_epilogue(int v, const float *bias, float *pre, uint16_t *out16, uint16_t *pre16, int64_t n,
                                   const float *alpha) {
    switch (v) {
    case 0: return (gemm_epilogue){.bias = bias, .bias_kind = GEMM_BIAS_ROW, .act = ACT_GELU};
    case 1: return (gemm_epilogue){.beta = 0.5f, .bias = bias, .bias_kind = GEMM_BIAS_ROW, .act = ACT_GELU};
    case 2:
        return (gemm_epilogue){.beta = 0.5f,
                               .alpha = alpha,
                               .bias = bias,
                               .bias_kind = GEMM_BIAS_COL,
                               .act = ACT_SILU,
                               .preact = pre,
                               .rsp = n};
    default:
        return (gemm_epilogue){.alpha = alpha,
                               .bias = bias,
                               .bias_kind = GEMM_BIAS_ROW,
                               .act = ACT_GELU,
                               .rsp = n,
                               .out16 = out16,
                               .pre16 = pre16,
                               .out_dt = OPF_BF16};
    }
}

static void test_many_threads(const gemm_kernels *k) {
    const saved_threads saved = threads_save();
    const shape shapes[] = {{13, 100, 9},
                            {250, 1100, 9},
                            {517, 300, 7},
                            {97, 1100, k->kc + 5},
                            {250, 77, k->kc + 5},
                            {40, 70, 3 * k->kc + 17},
                            {30, 20, 9 * k->kc + 3},
                            {30, 20, (GEMM_KSPLIT_MAX + 1) * k->kc + 3}};
    const float alpha = -0.375f;
    int split_seen = 0, rounds_seen = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const shape sh = shapes[si];
        const size_t mn = (size_t)(sh.m * sh.n);
        float *a = rand_buf(sh.m * sh.k, 61 + si), *b = rand_buf(sh.k * sh.n, 62 + si);
        float *bias = rand_buf(sh.m > sh.n ? sh.m : sh.n, 63), *c0 = rand_buf(sh.m * sh.n, 64);
        float *one = malloc(sizeof(float) * mn * 2), *got = malloc(sizeof(float) * mn * 2);
        float *want = malloc(sizeof(float) * mn * 2);
        float *ar = malloc(sizeof(float) * (size_t)(sh.m * sh.k)), *br = malloc(sizeof(float) * (size_t)(sh.k * sh.n));
        uint16_t *ah = malloc(2 * (size_t)(sh.m * sh.k)), *bh = malloc(2 * (size_t)(sh.k * sh.n));
        uint16_t *got16 = malloc(2 * mn * 2), *one16 = malloc(2 * mn * 2);
        for (opf_dtype dt = OPF_F32; dt <= OPF_F16; dt = dt == OPF_F32 ? OPF_BF16 : dt + 1) {
            const void *ap = a, *bp = b;
            if (dt != OPF_F32) {
                convert_store_f32(k->cvt, ah, dt, a, sh.m * sh.k);
                convert_store_f32(k->cvt, bh, dt, b, sh.k * sh.n);
                ap = ah, bp = bh;
            }
            convert_load_f32(k->cvt, ar, ap, dt, sh.m * sh.k, 1);
            convert_load_f32(k->cvt, br, bp, dt, sh.k * sh.n, 1);
            for (int v = 0; v < MANY_EPILOGUES; v++) {
                /* got: C, then the pre-activation (variant 2); got16: the 16-bit results, then theirs */
                const gemm_epilogue ep = many_epilogue(v, bias, got + mn, got16, got16 + mn, sh.n, &alpha);
                const int threads[] = {1, 5, 16, 64};
                for (int ti = 0; ti < 4; ti++) {
                    char env[8];
                    snprintf(env, sizeof env, "%d", threads[ti]);
                    setenv("OPFORGE_NUM_THREADS", env, 1);
                    for (size_t i = 0; i < mn; i++) got[i] = ep.beta != 0.0f ? c0[i] : NAN, got[mn + i] = NAN;
                    memset(got16, 0xff, 2 * mn * 2); /* NaN patterns */
                    const gemm_plan plan = plan_of(k, sh.m, sh.n, sh.k, dt, dt);
                    split_seen += plan.ksplit > 1;
                    rounds_seen += plan.ksplit > 1 && plan.ksplit * gemm_slice_depth(k, dt, dt) < sh.k;
                    const int64_t wsn = gemm_workspace(&plan);
                    float *ws = check_ws_alloc(wsn);
                    const int rc = gemm_run(&plan, ap, sh.k, 1, bp, sh.n, 1, got, sh.n, &ep, ws, wsn);
                    check_ws_free(ws, "many threads");
                    if (ti == 0) {
                        memcpy(one, got, sizeof(float) * mn * 2);
                        memcpy(one16, got16, 2 * mn * 2);
                        memcpy(want, c0, sizeof(float) * mn);
                        gemm_epilogue ref = many_epilogue(v, bias, want + mn, NULL, NULL, sh.n, &alpha);
                        if (v == 3) ref.preact = want + mn; /* the 16-bit pre-activation's value */
                        gemm_ref_f32(sh.m, sh.n, sh.k, ar, sh.k, 1, br, sh.n, 1, want, sh.n, &ref);
                    }
                    int64_t off = 0, differ = 0;
                    const double tol = dt == OPF_F32 && v != 3 ? 1e-4 : 2e-2;
                    for (size_t i = 0; i < mn * 2; i++) {
                        if (i >= mn && v < 2) break; /* no pre-activation */
                        float g = got[i];
                        if (v == 3) { /* the 16-bit results, widened */
                            convert_load_f32(k->cvt, &g, got16 + i, OPF_BF16, 1, 1);
                            differ += memcmp(&got16[i], &one16[i], 2) != 0;
                        } else {
                            differ += memcmp(&got[i], &one[i], sizeof(float)) != 0;
                        }
                        off += !(fabs((double)g - want[i]) <= tol + tol * fabs(want[i]));
                    }
                    CHECK(rc == 0 && off == 0 && differ == 0,
                          "%s m=%lld n=%lld k=%lld dt=%d epilogue %d at %d threads (shared A: %d, slices at once: "
                          "%lld): rc %d, %lld values off, %lld not the bits of one thread",
                          k->name, (long long)sh.m, (long long)sh.n, (long long)sh.k, (int)dt, v, threads[ti],
                          !plan.own_a, (long long)plan.ksplit, rc, (long long)off, (long long)differ);
                }
            }
        }
        free(a), free(b), free(bias), free(c0), free(one), free(got), free(want), free(ar), free(br), free(ah),
            free(bh), free(got16), free(one16);
    }
    CHECK(split_seen > 0 && rounds_seen > 0, "%s: %d plans ran K slices at once, %d of them in rounds", k->name,
          split_seen, rounds_seen);
    threads_restore(&saved);
}

/* The epilogue's activations at SPECIAL as the scalar ones: C = act(x . 1) over full register tiles (48
 * rows and 64 columns are whole tiles of every variant), so the vector epilogue runs */
static void test_epilogue_special(const gemm_kernels *k) {
    enum { M = 48, N = 64 };
    float a[M], b[N], c[M * N];
    for (int i = 0; i < M; i++) a[i] = SPECIAL[i % NSPECIAL];
    for (int j = 0; j < N; j++) b[j] = 1.0f;
    const gemm_plan plan = plan_of(k, M, N, 1, OPF_F32, OPF_F32);
    const int64_t wsn = gemm_workspace(&plan);
    for (int act = 1; act < ACT_COUNT; act++) {
        float *ws = check_ws_alloc(wsn);
        gemm_epilogue ep = {.act = act};
        CHECK(gemm_run(&plan, a, 1, 1, b, N, 1, c, N, &ep, ws, wsn) == 0, "%s: workspace refused", k->name);
        check_ws_free(ws, k->name);
        int64_t bad = 0, first = -1;
        for (int64_t e = 0; e < M * N; e++)
            if (!same_value(c[e], act_f32(act, a[e / N])) && bad++ == 0) first = e;
        CHECK(bad == 0, "%s epilogue %s: %lld bad, first at x = %g: got %g, reference %g", k->name, ACT[act],
              (long long)bad, first < 0 ? 0.0 : a[first / N], first < 0 ? 0.0 : c[first],
              first < 0 ? 0.0 : act_f32(act, a[first / N]));
    }
}

/* The log names the table whose micro-kernel ran, as the glue's call line reads it: the table picked for
 * the ISA, a product, then the picks noted since the call began. A product of bfloat16 pairs (a bfloat16
 * operand whose partner is bfloat16 or float32, on a table with a pair kernel) names a table with a pair
 * kernel; any other names a table without one, whose float32 kernel it is (AVX512-BF16 and AMX hand those
 * to the AVX-512 kernel: naming them claimed an ISA that did not run). float64 names its reference. */
static void test_log_names_what_ran(const gemm_kernels *k) {
    if (gemm_kernels_for(k->isa) != k) return; /* a table outside the variant list (the portable pairs) */
    enum { M = 7, N = 13, KD = 5 };
    const opf_dtype types[][2] = {{OPF_F32, OPF_F32}, {OPF_BF16, OPF_BF16}, {OPF_F16, OPF_F16}, {OPF_F32, OPF_BF16}};
    const char *const dt_name[] = {"f32", "f64", "bf16", "f16"};
    uint16_t a16[M * KD], b16[KD * N];
    float a[M * KD] = {0}, b[KD * N] = {0}, c[M * N];
    memset(a16, 0, sizeof a16), memset(b16, 0, sizeof b16);
    char names[128];
    const int saved = opf_log_level_value;
    opf_log_level_value = OPF_LOG_INFO; /* picks are noted at info */
    /* B along K (a linear's weight: the skinny path at these M rows, where the table has one): its name */
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        const opf_dtype ta = types[t][0], tb = types[t][1];
        const gemm_plan plan = plan_of(gemm_kernels_for(k->isa), M, N, KD, ta, tb);
        const char *want = !plan.skinny ? NULL : plan.pairs ? plan.kern->skinny_pairs_name : plan.kern->skinny_name;
        if (!want) want = plan.kern->name;
        gemm_epilogue ep = {0};
        double t0 = opf_now_us();
        const int64_t wsn = gemm_workspace(&plan);
        float *ws = check_ws_alloc(wsn);
        CHECK(gemm_run(&plan, ta == OPF_F32 ? (void *)a : a16, KD, 1, tb == OPF_F32 ? (void *)b : b16, 1, KD, c, N, &ep,
                       ws, wsn) == 0,
              "%s: workspace refused", k->name);
        check_ws_free(ws, k->name);
        opf_log_take_picks(t0, names, sizeof names);
        const int has_form = plan.pairs ? plan.kern->skinny_pairs != NULL : plan.kern->skinny != NULL;
        CHECK(strncmp(names, "gemm:", 5) == 0 && strcmp(names + 5, want) == 0 &&
                  (!has_form || tb == OPF_F16 || plan.skinny),
              "%s %s x %s, B along K: the log names '%s', not '%s' (skinny %d)", k->name, dt_name[ta], dt_name[tb],
              names, want, plan.skinny);
    }
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        const opf_dtype ta = types[t][0], tb = types[t][1];
        const int pairs = k->ukernel_pairs && (ta == OPF_BF16 || tb == OPF_BF16) && ta != OPF_F16 && tb != OPF_F16;
        gemm_epilogue ep = {0};
        double t0 = opf_now_us();
        const gemm_plan plan = plan_of(gemm_kernels_for(k->isa), M, N, KD, ta, tb);
        const int64_t wsn = gemm_workspace(&plan);
        float *ws = check_ws_alloc(wsn);
        CHECK(gemm_run(&plan, ta == OPF_F32 ? (void *)a : a16, KD, 1, tb == OPF_F32 ? (void *)b : b16, N, 1, c, N, &ep,
                       ws, wsn) == 0,
              "%s: workspace refused", k->name);
        check_ws_free(ws, k->name);
        int isa = opf_log_take_picks(t0, names, sizeof names);
        const gemm_kernels *named = NULL;
        for (int i = 0; i < gemm_variants.count; i++) {
            const gemm_kernels *v = gemm_variants.tables[i];
            if (v && strncmp(names, "gemm:", 5) == 0 && strcmp(names + 5, v->name) == 0) named = v;
        }
        CHECK(named && (int)named->isa == isa && (pairs ? named->ukernel_pairs != NULL : named->ukernel_pairs == NULL),
              "%s %s x %s (%s): the log names '%s' (isa %s), not the table whose kernel ran", k->name, dt_name[ta],
              dt_name[tb], pairs ? "pairs" : "float32 kernel", names, isa >= 0 ? opf_isa_name((opf_isa)isa) : "none");
    }
    double a64[M * KD] = {0}, b64[KD * N] = {0}, c64[M * N];
    double t0 = opf_now_us();
    gemm_ref_f64(M, N, KD, a64, KD, 1, b64, N, 1, c64, N, 0.0, NULL, 0, GEMM_BIAS_NONE, ACT_NONE, NULL, 0);
    int isa = opf_log_take_picks(t0, names, sizeof names);
    CHECK(strcmp(names, "gemm:ref_f64") == 0 && isa == OPF_ISA_REF, "float64: the log names '%s', not gemm:ref_f64",
          names);
    opf_log_level_value = saved;
}

/* A table with a strip kernel against the same table one sliver at a time, bit for bit: bfloat16
 * operands, strips of several slivers, K slices, partial slivers and columns, every epilogue, with and
 * without a float32 C. */
static void test_strip(const gemm_kernels *k) {
    if (!k->ukernel_strip) return;
    gemm_kernels one = *k;
    one.ukernel_strip = NULL;
    const shape shapes[] = {{300, 70, 100}, {37, 45, 2 * k->kc + 37}, {290, 333, 300}, {64, 64, 512}};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const shape s = shapes[si];
        float *a32 = rand_buf(s.m * s.k, 41), *b32 = rand_buf(s.k * s.n, 42), *bias = rand_buf(s.n, 43);
        uint16_t *a = malloc(sizeof *a * s.m * s.k), *b = malloc(sizeof *b * s.k * s.n);
        for (int64_t i = 0; i < s.m * s.k; i++) a[i] = opf_f32_to_bf16(a32[i]);
        for (int64_t i = 0; i < s.k * s.n; i++) b[i] = opf_f32_to_bf16(b32[i]);
        for (int act = 0; act < ACT_COUNT; act++) {
            const int out16 = act % 2 && s.k <= gemm_slice_depth(k, OPF_BF16, OPF_BF16);
            float *c[2], *pre[2];
            uint16_t *c16[2];
            for (int v = 0; v < 2; v++) {
                const gemm_kernels *kern = v ? &one : k;
                gemm_plan plan = plan_of(kern, s.m, s.n, s.k, OPF_BF16, OPF_BF16);
                float *ws = malloc(sizeof(float) * (plan.floats + 1));
                c[v] = calloc((size_t)(s.m * s.n), sizeof(float));
                pre[v] = calloc((size_t)(s.m * s.n), sizeof(float));
                c16[v] = calloc((size_t)(s.m * s.n), sizeof(uint16_t));
                gemm_epilogue ep = {.bias = bias,
                                    .bias_kind = GEMM_BIAS_ROW,
                                    .act = act,
                                    .preact = act ? pre[v] : NULL,
                                    .rsp = s.n,
                                    .out16 = out16 ? c16[v] : NULL,
                                    .out_dt = OPF_BF16};
                int rc = gemm_run_own(&plan, a, s.k, 1, b, s.n, 1, out16 ? NULL : c[v], s.n, &ep, ws, plan.floats);
                CHECK(rc == 0, "%s strip m=%lld: rc %d", k->name, (long long)s.m, rc);
                free(ws);
            }
            CHECK(!memcmp(c[0], c[1], sizeof(float) * s.m * s.n) &&
                      !memcmp(pre[0], pre[1], sizeof(float) * s.m * s.n) &&
                      !memcmp(c16[0], c16[1], sizeof(uint16_t) * s.m * s.n),
                  "%s strip kernel m=%lld n=%lld k=%lld act=%d out16=%d: not the bits of one sliver at a time", k->name,
                  (long long)s.m, (long long)s.n, (long long)s.k, act, out16);
            for (int v = 0; v < 2; v++) free(c[v]), free(pre[v]), free(c16[v]);
        }
        free(a32), free(b32), free(bias), free(a), free(b);
    }
}

/* The skinny product (few rows of A, B read along K): every epilogue against the oracle on odd shapes,
 * K below, at and past one vector and across several of the blocked kernels' slices, A plain and
 * transposed; B stored the other way runs blocked (the same checks). */
static void test_skinny(const gemm_kernels *k) {
    const gemm_plan p = plan_of(k, 4, 9, 5, OPF_F32, OPF_F32);
    CHECK(p.skinny == (p.kern->skinny != NULL), "%s: a 4-row product's plan skinny=%d", k->name, p.skinny);
    CHECK(!plan_of(k, GEMM_SKINNY_M + 1, 9, 5, OPF_F32, OPF_F32).skinny, "%s: 9 rows planned skinny", k->name);
    const int64_t ms[] = {1, 2, 3, 4, 5, 8}, ns[] = {1, 3, 45, 133}, ks[] = {1, 7, 16, 37, 300};
    for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
        for (size_t j = 0; j < sizeof ns / sizeof *ns; j++)
            for (size_t q = 0; q < sizeof ks / sizeof *ks; q++) {
                const shape s = {ms[i], ns[j], ks[q]};
                for (int ta = 0; ta < 2; ta++) run(k, s, ta, 1, 0.0f, GEMM_BIAS_NONE, ACT_NONE, 0);
                run(k, s, 0, 0, 0.0f, GEMM_BIAS_NONE, ACT_NONE, 0);
            }
    const shape e[] = {{3, 45, 37}, {7, 13, 2 * k->kc + 37}, {1, 133, 300}};
    for (size_t i = 0; i < sizeof e / sizeof *e; i++)
        for (int act = 0; act < ACT_COUNT; act++)
            for (int bias = 0; bias < 3; bias++) {
                run(k, e[i], 0, 1, 0.0f, bias, act, 1);
                run(k, e[i], 1, 1, 1.0f, bias, act, 0);
                run_scaled(k, e[i], 0, 1, -0.375f, 0.5f, bias, act, 1);
            }
}

static void test_variant(const gemm_kernels *k) {
    test_log_names_what_ran(k);
    test_epilogue_special(k);
    test_workspace_plans(k);
    test_many_threads(k);
    test_half_operands(k);
    test_out16(k);
    test_skinny(k);
    if (k->ukernel_pairs) test_pair_operands(k);
    const shape shapes[] = {{1, 1, 1},       {7, 13, 5},      {6, 16, 1},      {13, 33, 257}, {123, 77, 301},
                            {1, 4096, 4096}, {4096, 1, 4096}, {130, 3100, 20}, {0, 5, 3},     {5, 4, 0}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) run(k, shapes[i], ta, tb, 0.0f, GEMM_BIAS_NONE, ACT_NONE, 0);
    /* every epilogue on a shape with partial tiles in both directions and several K slices */
    const shape e = {37, 45, 2 * k->kc + 37};
    for (int act = 0; act < ACT_COUNT; act++)
        for (int bias = 0; bias < 3; bias++) {
            run(k, e, 0, 1, 0.0f, bias, act, 1);
            run(k, e, 1, 0, 1.0f, bias, act, 0);
            run(k, e, 0, 0, 0.5f, bias, act, 1);
            run_scaled(k, e, 1, 1, -0.375f, 0.5f, bias, act, 1); /* alpha: each K slice's share scaled */
        }
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) run_scaled(k, shapes[i], 0, 1, 3.0f, 0.0f, 0, 0, 0);
    test_strip(k);
}

/* A provider of the test's own (gemm.h): float32 products by the oracle, with no epilogue, into
 * scratch, finished by gemm_finish (or, with provider_in_place, into C first and finished there, as
 * the torch provider finishes its result in place); so every epilogue check above runs again over a
 * product another GEMM made. */
static int provider_calls, provider_in_place;

static int oracle_provider(const gemm_call *k) {
    const gemm_plan *p = k->plan;
    if (p->ta != OPF_F32 || p->tb != OPF_F32) return 0; /* declined: opforge's kernels run it */
    float *prod = malloc((size_t)(p->m * p->n) * sizeof(float));
    gemm_epilogue plain = {0};
    gemm_ref_f32(p->m, p->n, p->k, k->a, k->rsa, k->csa, k->b, k->rsb, k->csb, prod, p->n, &plain);
    if (provider_in_place && k->c && !k->ep->out16 && k->ep->beta == 0.0f) {
        for (int64_t i = 0; i < p->m; i++) memcpy(k->c + i * k->rsc, prod + i * p->n, (size_t)p->n * sizeof(float));
        gemm_finish(p, k->c, OPF_F32, k->rsc, 0, k->c, k->rsc, k->ep);
    } else {
        gemm_finish(p, prod, OPF_F32, p->n, 1, k->c, k->rsc, k->ep);
    }
    free(prod);
    provider_calls++;
    return 1;
}

static void test_provider(const gemm_kernels *k) {
    static const gemm_provider oracle = {.name = "oracle", .run = oracle_provider};
    gemm_provider_set(&oracle);
    CHECK(gemm_provider_get() == &oracle, "the provider installed is not the one read back");
    provider_calls = 0;
    test_epilogue_special(k);
    test_workspace_plans(k); /* a workspace too small is refused before the provider is asked */
    test_out16(k);
    const shape e = {37, 45, 2 * k->kc + 37}, shapes[] = {{1, 1, 1}, {13, 33, 257}, {130, 310, 20}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) run(k, shapes[i], ta, tb, 0.0f, GEMM_BIAS_NONE, ACT_NONE, 0);
    for (int act = 0; act < ACT_COUNT; act++)
        for (int bias = 0; bias < 3; bias++) {
            run(k, e, 0, 1, 0.0f, bias, act, 1);
            run(k, e, 1, 0, 1.0f, bias, act, 0);
            run(k, e, 0, 0, 0.5f, bias, act, 1);
            run_scaled(k, e, 1, 1, -0.375f, 0.5f, bias, act, 1);
        }
    CHECK(provider_calls > 50, "%s: the provider ran %d products", k->name, provider_calls);
    provider_in_place = 1;
    for (int act = 0; act < ACT_COUNT; act++)
        for (int bias = 0; bias < 3; bias++) run(k, e, 0, 1, 0.0f, bias, act, 1);
    provider_in_place = 0;
    gemm_provider_set(NULL);
}

static void test_act_variant(const act_kernels *k) {
    test_act_grad(k);
    test_act_grad_special(k);
    test_act_grad_rows(k);
}

static void test_activations(void) {
    /* the scalar activations against their definitions, derivatives by central difference */
    for (int act = 1; act < ACT_COUNT; act++) {
        double worst = 0;
        for (double x = -6; x <= 6; x += 0.01) {
            double h = 1e-3, num = (act_f32(act, (float)(x + h)) - act_f32(act, (float)(x - h))) / (2 * h);
            if (act == ACT_RELU && fabs(x) < 2 * h) continue;
            worst = fmax(worst, fabs(num - act_grad_f32(act, (float)x)));
        }
        CHECK(worst < 2e-3, "%s derivative off by %g", ACT[act], worst);
    }
    CHECK(isnan(act_f32(ACT_RELU, NAN)), "relu keeps NaN");
}

int main(void) {
    test_activations();
    test_pairs_portable();
#ifdef OPF_AMX_EMULATE
    /* the AMX kernel's packing, padding and epilogue over the C model of its
     * tile instructions (the epilogue and the model's build need AVX-512) */
    if (opf_isa_best() >= OPF_ISA_AVX512_BF16) {
        test_variant(&gemm_kernels_amx);
        printf("tested %s over emulated tiles\n", gemm_kernels_amx.name);
    } else {
        printf("skip %s over emulated tiles: the CPU lacks AVX512-BF16\n", gemm_kernels_amx.name);
    }
    (void)test_act_variant, (void)test_conversions, (void)test_provider; /* the plain build's checks */
    return check_report("test_gemm (AMX emulated)");
#else
    CHECK_EACH_VARIANT(act_kernels_for, test_act_variant);
    CHECK_EACH_VARIANT(convert_kernels_for, test_conversions);
    CHECK_EACH_VARIANT(gemm_kernels_for, test_variant);
    CHECK_EACH_VARIANT(gemm_kernels_for, test_provider);
    return check_report("test_gemm");
#endif
}
