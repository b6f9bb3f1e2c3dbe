/*
 * Every compiled adamw variant against the scalar reference, bit for bit (NaN matches any NaN):
 * float32 and bfloat16 parameters, sizes 0..4097 around the vector widths, coefficient sets that
 * take each branch (weight decay or none, maximize, beta1 below and above 0.5, first and tenth
 * step), values with zeros, tiny and huge gradients. Then the reference against the update
 * computed in double (the formula, not only the rounding), and the driver over a list of tensors
 * of odd sizes (empty ones included, float32 and float64 step counts, both parameter dtypes in
 * one list) against the reference tensor by tensor.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/kernels/adamw.h"
#include "check.h"

static const int64_t SIZES[] = {0, 1, 7, 15, 16, 17, 31, 33, 123, 4097};
enum { NMAX = 4097 };

static const adamw_hparams HP[] = {
    {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2},
    {.lr = 3e-2, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.0, .maximize = 1},
    {.lr = 1e-1, .beta1 = 0.3, .beta2 = 0.5, .eps = 1e-3, .weight_decay = 0.5}, /* 1 - beta1 >= 0.5: lerp from g */
};
static const double STEPS[] = {1.0, 10.0};

static float tricky(unsigned long long *s, int64_t i, double scale) {
    static const float SPECIAL[] = {0.0f, -0.0f, 1e-30f, -1e-20f, 1e20f, 3.0e38f, 1e-40f};
    if (i % 13 == 6) return SPECIAL[(i / 13) % (sizeof SPECIAL / sizeof *SPECIAL)];
    return (float)((check_uniform(s) * 2.0 - 1.0) * scale);
}

typedef struct state {
    float p[NMAX], m[NMAX], v[NMAX], g[NMAX];
    uint16_t pb[NMAX], gb[NMAX];
} state;

static void fill(state *s, unsigned long long seed) {
    for (int64_t i = 0; i < NMAX; i++) {
        s->p[i] = tricky(&seed, i, 2.0);
        s->g[i] = tricky(&seed, i + 5, 1.0);
        s->m[i] = (float)((check_uniform(&seed) * 2.0 - 1.0) * 0.1);
        s->v[i] = i % 17 == 3 ? 0.0f : (float)(check_uniform(&seed) * 0.01);
        s->pb[i] = opf_f32_to_bf16(s->p[i]);
        s->gb[i] = opf_f32_to_bf16(s->g[i]);
    }
}

static int same_f32(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

static void compare(const char *what, const char *ctx, const float *got, const float *want, int64_t n) {
    int64_t bad = -1, nbad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!same_f32(got[i], want[i]) && nbad++ == 0) bad = i;
    CHECK(nbad == 0, "%s %s n=%lld: %lld differ, first at %lld: got %.9g want %.9g", ctx, what, (long long)n,
          (long long)nbad, (long long)bad, bad >= 0 ? got[bad] : 0.0, bad >= 0 ? want[bad] : 0.0);
}

static void widen(float *out, const uint16_t *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = opf_bf16_to_f32(in[i]);
}

static void test_variant(const adamw_kernels *k) {
    static state want, got;
    static float a[NMAX], b[NMAX];
    for (size_t h = 0; h < sizeof HP / sizeof *HP; h++)
        for (size_t t = 0; t < sizeof STEPS / sizeof *STEPS; t++)
            for (size_t s = 0; s < sizeof SIZES / sizeof *SIZES; s++) {
                const int64_t n = SIZES[s];
                const adamw_coef c = adamw_coefs(&HP[h], STEPS[t]);
                char ctx[128];
                fill(&want, 7 + (unsigned long long)(n * 31 + (int64_t)h));
                got = want;
                snprintf(ctx, sizeof ctx, "%s float32 hparams %zu step %g", k->name, h, STEPS[t]);
                adamw_kernels_ref.step[OPF_F32](want.p, want.m, want.v, want.g, n, &c);
                k->step[OPF_F32](got.p, got.m, got.v, got.g, n, &c);
                compare("param", ctx, got.p, want.p, n);
                compare("exp_avg", ctx, got.m, want.m, n);
                compare("exp_avg_sq", ctx, got.v, want.v, n);
                CHECK(memcmp(got.p + n, want.p + n, (size_t)(NMAX - n) * sizeof(float)) == 0, "%s: wrote past n=%lld",
                      ctx, (long long)n);

                snprintf(ctx, sizeof ctx, "%s bfloat16 hparams %zu step %g", k->name, h, STEPS[t]);
                adamw_kernels_ref.step[OPF_BF16](want.pb, want.m, want.v, want.gb, n, &c);
                k->step[OPF_BF16](got.pb, got.m, got.v, got.gb, n, &c);
                widen(a, got.pb, n), widen(b, want.pb, n);
                compare("param", ctx, a, b, n);
                compare("exp_avg", ctx, got.m, want.m, n);
                compare("exp_avg_sq", ctx, got.v, want.v, n);
                CHECK(memcmp(got.pb + n, want.pb + n, (size_t)(NMAX - n) * sizeof(uint16_t)) == 0,
                      "%s: wrote past n=%lld", ctx, (long long)n);
            }
}

/* The reference against torch.optim.AdamW's formula in double, on ordinary values (float32 roundings
 * of a few operations). */
static void test_formula(void) {
    for (size_t h = 0; h < sizeof HP / sizeof *HP; h++)
        for (size_t t = 0; t < sizeof STEPS / sizeof *STEPS; t++) {
            const adamw_hparams *hp = &HP[h];
            const double step = STEPS[t];
            unsigned long long seed = 42 + h;
            enum { N = 257 };
            float p[N], m[N], v[N], g[N];
            double pd[N], md[N], vd[N];
            for (int i = 0; i < N; i++) {
                p[i] = (float)(check_uniform(&seed) * 2 - 1), g[i] = (float)(check_uniform(&seed) * 2 - 1);
                m[i] = (float)(check_uniform(&seed) * 0.2 - 0.1), v[i] = (float)(check_uniform(&seed) * 0.01);
                pd[i] = p[i], md[i] = m[i], vd[i] = v[i];
            }
            const adamw_coef c = adamw_coefs(hp, step);
            adamw_kernels_ref.step[OPF_F32](p, m, v, g, N, &c);
            double maxerr = 0;
            for (int i = 0; i < N; i++) {
                const double gi = hp->maximize ? -(double)g[i] : g[i];
                double pi = pd[i] * (1 - hp->lr * hp->weight_decay);
                md[i] = hp->beta1 * md[i] + (1 - hp->beta1) * gi;
                vd[i] = hp->beta2 * vd[i] + (1 - hp->beta2) * gi * gi;
                const double denom = sqrt(vd[i]) / sqrt(1 - pow(hp->beta2, step)) + hp->eps;
                pi -= hp->lr / (1 - pow(hp->beta1, step)) * md[i] / denom;
                /* a few float32 roundings of the parameter, and a relative 1e-4 of the update */
                maxerr = fmax(maxerr, fabs(p[i] - pi) / (4 * ldexp(fabs(pi), -24) + 1e-4 * fabs(pi - pd[i]) + 1e-30));
                CHECK(fabs(m[i] - md[i]) <= 1e-6 && fabs(v[i] - vd[i]) <= 1e-6 * (vd[i] + 1e-3),
                      "formula hparams %zu step %g: moment %d got %g %g want %g %g", h, step, i, m[i], v[i], md[i],
                      vd[i]);
            }
            CHECK(maxerr <= 1.0, "formula hparams %zu step %g: parameter off by %g of its tolerance", h, step, maxerr);
        }
}

/* The driver over a list: tensors laid end to end and split over threads, each updated as the
 * reference updates it alone, its step count incremented first. */
static void test_driver(const adamw_kernels *k) {
    static const int64_t LEN[] = {0, 1, 40000, 7, 0, 33, 70001, 16, 123};
    enum { T = sizeof LEN / sizeof *LEN };
    adamw_tensor ts[T];
    float *want[T][3], stepf[T];
    double stepd[T];
    unsigned long long seed = 5;
    for (int i = 0; i < T; i++) {
        const int64_t n = LEN[i];
        const opf_dtype dt = i % 3 == 1 ? OPF_BF16 : OPF_F32;
        const size_t es = opf_dtype_size(dt);
        char *p = malloc((size_t)(n + 1) * es), *g = malloc((size_t)(n + 1) * es);
        float *m = malloc((size_t)(n + 1) * sizeof(float)), *v = malloc((size_t)(n + 1) * sizeof(float));
        for (int64_t j = 0; j < n; j++) {
            opf_store_elem(p, j, dt, check_uniform(&seed) * 2 - 1);
            opf_store_elem(g, j, dt, check_uniform(&seed) * 2 - 1);
            m[j] = (float)(check_uniform(&seed) * 0.1), v[j] = (float)(check_uniform(&seed) * 0.01);
        }
        stepf[i] = (float)i, stepd[i] = (double)i;
        ts[i] = (adamw_tensor){.param = p,
                               .exp_avg = m,
                               .exp_avg_sq = v,
                               .grad = g,
                               .step = i % 2 ? (void *)&stepd[i] : (void *)&stepf[i],
                               .numel = n,
                               .dt = dt,
                               .step_dt = i % 2 ? OPF_F64 : OPF_F32};
        /* the expected tensor: the reference on copies, at step i + 1 */
        for (int a = 0; a < 3; a++) want[i][a] = malloc((size_t)(n + 1) * sizeof(float));
        char *pw = malloc((size_t)(n + 1) * es);
        memcpy(pw, p, (size_t)n * es), memcpy(want[i][1], m, (size_t)n * 4), memcpy(want[i][2], v, (size_t)n * 4);
        const adamw_coef c = adamw_coefs(&HP[0], i + 1.0);
        adamw_kernels_ref.step[dt](pw, want[i][1], want[i][2], g, n, &c);
        for (int64_t j = 0; j < n; j++) want[i][0][j] = (float)opf_load_elem(pw, j, dt);
        free(pw);
    }
    adamw_step(k, ts, T, &HP[0]);
    for (int i = 0; i < T; i++) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "driver %s tensor %d (%s)", k->name, i,
                 ts[i].dt == OPF_BF16 ? "bfloat16" : "float32");
        float *got = malloc((size_t)(LEN[i] + 1) * sizeof(float));
        for (int64_t j = 0; j < LEN[i]; j++) got[j] = (float)opf_load_elem(ts[i].param, j, ts[i].dt);
        compare("param", ctx, got, want[i][0], LEN[i]);
        compare("exp_avg", ctx, ts[i].exp_avg, want[i][1], LEN[i]);
        compare("exp_avg_sq", ctx, ts[i].exp_avg_sq, want[i][2], LEN[i]);
        const double step = i % 2 ? stepd[i] : stepf[i];
        CHECK(step == i + 1.0, "%s: step count %g, want %d", ctx, step, i + 1);
        free(got), free(ts[i].param), free((void *)ts[i].grad), free(ts[i].exp_avg), free(ts[i].exp_avg_sq);
        for (int a = 0; a < 3; a++) free(want[i][a]);
    }
}

#define TEST_ADAMW(k) (test_variant(k), test_driver(k))

int main(void) {
    test_formula();
    CHECK_EACH_VARIANT(adamw_kernels_for, TEST_ADAMW);
    return check_report("test_adamw");
}
