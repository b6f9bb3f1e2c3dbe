/*
 * Every compiled rope variant against a float64 oracle written from the
 * Hugging Face formulas (rotate_half, rotate_every_two and their
 * transposes), through the whole driver: all dtypes, head_dim D = 2, 6, 64,
 * 128 with rotary dims R = D and R < D (partial rotary), N = 1, 7, 33,
 * grouped-query heads (Hq = 3, Hk = 1), both conventions, forward and
 * backward, cos / sin per batch or broadcast or picked by position ids, and q
 * read in place from a (B, N, H, D) layout. float32 and float64 must also
 * equal the reference variant bit for bit (no FMA anywhere).
 */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/rope.h"
#include "check.h"

static const int64_t DIMS[][2] = {{2, 2}, {2, 0}, {6, 6}, {6, 4}, {64, 64}, {64, 32}, {128, 128}, {128, 96}};
static const int64_t LENS[] = {1, 7, 33};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const double RTOL[] = {1e-6, 1e-14, 8e-3, 1e-3};
static const double ATOL[] = {1e-6, 1e-14, 8e-3, 1e-3};

enum { B = 2, HQ = 3, HK = 1, P = 40 };

static void fill(opf_dtype dt, void *p, int64_t n, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, check_uniform(&seed) * 2.0 - 1.0);
}

/* rot(x)[j] (forward) or rot^T(y)[j] (inverse) in double, from x / y at unit stride */
static double rot(const double *x, int64_t j, int64_t r, int interleaved, int inverse) {
    double v;
    if (interleaved)
        v = j % 2 == 0 ? -x[j + 1] : x[j - 1];
    else
        v = j < r / 2 ? -x[j + r / 2] : x[j - r / 2];
    return inverse ? -v : v;
}

typedef struct layout {
    int64_t n, d, r;
    int interleaved, inverse, by_pos, cos_batch;
} layout;

static void run_case(const rope_kernels *k, opf_dtype dt, layout L) {
    const int64_t n = L.n, d = L.d, r = L.r;
    const size_t es = opf_dtype_size(dt);
    /* q stored as (B, N, HQ, D) and read as (B, HQ, N, D); k contiguous (B, HK, N, D) */
    const int64_t nq = B * HQ * n * d, nk = B * HK * n * d, rows = L.by_pos ? P : B * n;
    char *q = malloc((size_t)nq * es), *kk = malloc((size_t)nk * es), *oq = malloc((size_t)nq * es),
         *ok = malloc((size_t)nk * es), *rq = malloc((size_t)nq * es), *rk = malloc((size_t)nk * es);
    char *c = malloc((size_t)(rows * r + 1) * es), *s = malloc((size_t)(rows * r + 1) * es);
    int64_t pos[B * 33];
    unsigned long long seed = 77;
    fill(dt, q, nq, 1 + (unsigned long long)(n * d));
    fill(dt, kk, nk, 2 + (unsigned long long)(n * d));
    fill(dt, c, rows * r, 3);
    fill(dt, s, rows * r, 4);
    for (int64_t i = 0; i < B * n; i++) pos[i] = (int64_t)(check_uniform(&seed) * P) % P;
    rope_problem p = {.dt = dt,
                      .b = B,
                      .hq = HQ,
                      .hk = HK,
                      .n = n,
                      .d = d,
                      .r = r,
                      .interleaved = L.interleaved,
                      .inverse = L.inverse,
                      .q = q,
                      .k = kk,
                      .cos = c,
                      .sin = s,
                      .oq = oq,
                      .ok = ok,
                      .pos = L.by_pos ? pos : NULL,
                      .qs = {n * HQ * d, d, HQ * d, 1},
                      .ks = {HK * n * d, n * d, d, 1},
                      .oqs = {n * HQ * d, d, HQ * d, 1},
                      .oks = {HK * n * d, n * d, d, 1},
                      .cb = L.by_pos      ? 0
                            : L.cos_batch ? n * r
                                          : 0,
                      .cn = r,
                      .cr = 1,
                      .sb = L.by_pos      ? 0
                            : L.cos_batch ? n * r
                                          : 0,
                      .sn = r,
                      .sr = 1,
                      .pb = n,
                      .pn = 1};
    rope_run(k, &p);
    rope_problem pr = p;
    pr.oq = rq, pr.ok = rk;
    rope_run(&rope_kernels_ref, &pr);
    double x[128], y[128];
    int64_t nbad = 0;
    double maxerr = 0;
    for (int t = 0; t < 2; t++) {
        const int64_t heads = t == 0 ? HQ : HK;
        const int64_t *xs = t == 0 ? p.qs : p.ks;
        const char *in = t == 0 ? q : kk, *got = t == 0 ? oq : ok, *ref = t == 0 ? rq : rk;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < heads; h++)
                for (int64_t i = 0; i < n; i++) {
                    const int64_t base = b * xs[0] + h * xs[1] + i * xs[2];
                    const int64_t row = L.by_pos ? pos[b * n + i] : (L.cos_batch ? b * n : 0) + i;
                    for (int64_t j = 0; j < d; j++) x[j] = opf_load_elem(in, base + j, dt);
                    /* inverse: rot^T applies to g * sin */
                    for (int64_t j = 0; j < r; j++) y[j] = L.inverse ? x[j] * opf_load_elem(s, row * r + j, dt) : x[j];
                    for (int64_t j = 0; j < d; j++) {
                        double want = x[j];
                        if (j < r) {
                            double rv = rot(y, j, r, L.interleaved, L.inverse);
                            want = x[j] * opf_load_elem(c, row * r + j, dt) +
                                   (L.inverse ? rv : rv * opf_load_elem(s, row * r + j, dt));
                        }
                        double g = opf_load_elem(got, base + j, dt), e = fabs(g - want);
                        if (e > maxerr) maxerr = e;
                        int exact = dt == OPF_F32 || dt == OPF_F64
                                        ? memcmp(got + (base + j) * es, ref + (base + j) * es, es) == 0
                                        : 1;
                        if ((e > ATOL[dt] + RTOL[dt] * fabs(want) || !exact) && nbad++ == 0)
                            CHECK(0,
                                  "%s %s D=%lld R=%lld N=%lld inter=%d inv=%d pos=%d %s[%lld,%lld,%lld,%lld]: got %.9g "
                                  "want %.9g ref %.9g",
                                  k->name, DT_NAME[dt], (long long)d, (long long)r, (long long)n, L.interleaved,
                                  L.inverse, L.by_pos, t == 0 ? "q" : "k", (long long)b, (long long)h, (long long)i,
                                  (long long)j, g, want, opf_load_elem(ref, base + j, dt));
                    }
                }
    }
    CHECK(nbad == 0, "%s %s D=%lld R=%lld N=%lld inter=%d inv=%d pos=%d: %lld bad, max err %g", k->name, DT_NAME[dt],
          (long long)d, (long long)r, (long long)n, L.interleaved, L.inverse, L.by_pos, (long long)nbad, maxerr);
    free(q), free(kk), free(oq), free(ok), free(rq), free(rk), free(c), free(s);
}

static void test_variant(const rope_kernels *k) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++)
        for (size_t di = 0; di < sizeof DIMS / sizeof *DIMS; di++)
            for (size_t ni = 0; ni < sizeof LENS / sizeof *LENS; ni++)
                for (int mode = 0; mode < 8; mode++)
                    run_case(k, (opf_dtype)dt,
                             (layout){.n = LENS[ni],
                                      .d = DIMS[di][0],
                                      .r = DIMS[di][1],
                                      .interleaved = mode & 1,
                                      .inverse = (mode >> 1) & 1,
                                      .by_pos = mode >> 2,
                                      .cos_batch = (int)(ni % 2)});
}

/* The reference row on strided x / out / cos (every other element) against the unit-stride row. */
static void test_strided_row(const rope_kernels *k) {
    enum { D = 64, R = 48 };
    float x[2 * D], c[2 * R], s[2 * R], xd[D], cd[R], sd[R], got[2 * D], want[D];
    unsigned long long seed = 9;
    for (int i = 0; i < 2 * D; i++) x[i] = (float)check_uniform(&seed);
    for (int i = 0; i < 2 * R; i++) c[i] = (float)check_uniform(&seed), s[i] = (float)check_uniform(&seed);
    for (int i = 0; i < D; i++) xd[i] = x[2 * i];
    for (int i = 0; i < R; i++) cd[i] = c[2 * i], sd[i] = s[2 * i];
    for (int mode = 0; mode < 4; mode++) {
        k->row[OPF_F32](got, x, c, s, D, R, 2, 2, 2, 2, mode & 1, mode >> 1);
        k->row[OPF_F32](want, xd, cd, sd, D, R, 1, 1, 1, 1, mode & 1, mode >> 1);
        int bad = 0;
        for (int i = 0; i < D; i++) bad += got[2 * i] != want[i];
        CHECK(bad == 0, "%s strided row mode %d: %d elements differ from the unit-stride row", k->name, mode, bad);
    }
}

static void test_positions(void) {
    const int64_t pos[6] = {0, 3, 4, 1, 5, 2};
    int64_t bad = 0;
    CHECK(rope_check_positions(pos, 2, 3, 3, 1, 6, &bad) == -1, "positions in range reported out of range");
    CHECK(rope_check_positions(pos, 2, 3, 3, 1, 5, &bad) == 4 && bad == 5, "position 5 of a 5-row table not found");
    CHECK(rope_check_positions(pos, 2, 3, 0, 1, 5, &bad) == -1, "broadcast batch reads the first row only");
}

#define TEST_ALL(k)          \
    do {                     \
        test_variant(k);     \
        test_strided_row(k); \
    } while (0)

int main(void) {
    test_positions();
    CHECK_EACH_VARIANT(rope_kernels_for, TEST_ALL);
    return check_report("test_rope");
}
