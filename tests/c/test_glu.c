/*
 * Every compiled glu variant against the double-precision oracle and the
 * scalar reference: all dtypes, the three activations, F = 1, 7, 123, 4097
 * over several rows, strided and broadcast (stride 0) operands, and the
 * threaded n-d driver (same bits serial and threaded), and float32 at
 * infinite, huge and NaN gates as the scalar reference; the backward written over
 * gate and up (glu_backward_) as out of place. The vector variants
 * use exp / erf / tanh approximations (~1-2 ulp in float32), so values are
 * compared within per-dtype tolerances, reporting index, both values and the
 * max error.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/glu.h"
#include "check.h"

static const int64_t SIZES[] = {1, 7, 123, 4097};
static const act_kind ACTS[] = {ACT_SILU, ACT_GELU, ACT_GELU_TANH};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
/* |got - want| <= ATOL scale + RTOL |want| against the float64 oracle on the rounded inputs, where scale
 * is 1 + |the factor the activation (or its derivative) is multiplied by|: gelu_tanh's derivative is a
 * difference of O(1) terms for negative inputs, so float32's error is absolute on the scale of grad * up */
static const double RTOL[] = {2e-6, 1e-13, 8e-3, 1e-3};
static const double ATOL[] = {1.5e-6, 1e-13, 1e-3, 1e-4};

static void fill(opf_dtype dt, void *p, int64_t n, unsigned long long seed, double scale) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, (check_uniform(&seed) * 2.0 - 1.0) * scale);
}

/* got[i * gs] against want64[i] for n elements; reports the first failure and the max error */
static void compare(const char *what, const char *variant, opf_dtype dt, act_kind act, int64_t n, const void *got,
                    int64_t gs, const double *want, const double *scale) {
    int64_t bad = -1, nbad = 0;
    double maxerr = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = opf_load_elem(got, i * gs, dt), e = fabs(g - want[i]);
        if (e > maxerr) maxerr = e;
        if (e <= ATOL[dt] * scale[i] + RTOL[dt] * fabs(want[i])) continue;
        if (bad < 0) bad = i;
        nbad++;
    }
    CHECK(nbad == 0, "%s %s %s act=%d n=%lld: %lld out of tolerance, first at %lld: got %.9g want %.9g, max err %g",
          what, variant, DT_NAME[dt], (int)act, (long long)n, (long long)nbad, (long long)bad,
          bad >= 0 ? opf_load_elem(got, bad * gs, dt) : 0.0, bad >= 0 ? want[bad] : 0.0, maxerr);
}

enum { MAXN = 4097 * 3 };

/* one variant's row kernels at strides (os / ds, gs, us, rs) against the oracle */
static void test_rows(const glu_kernels *k, opf_dtype dt, act_kind act, int64_t n, int64_t os, int64_t gs, int64_t us,
                      int64_t rs) {
    static char gate[MAXN * 8], up[MAXN * 8], grad[MAXN * 8], out[MAXN * 8], out2[MAXN * 8];
    static double want[MAXN], want2[MAXN], scale[MAXN], scale2[MAXN];
    fill(dt, gate, MAXN, 11 + (unsigned long long)n, 6.0);
    fill(dt, up, MAXN, 12 + (unsigned long long)n, 3.0);
    fill(dt, grad, MAXN, 13 + (unsigned long long)n, 2.0);
    for (int64_t i = 0; i < n; i++) {
        double x = opf_load_elem(gate, i * gs, dt), u = opf_load_elem(up, i * us, dt);
        want[i] = act_f64(act, x) * u;
        scale[i] = 1.0 + fabs(u);
    }
    k->fwd[dt](out, gate, up, n, os, gs, us, act);
    compare("fwd", k->name, dt, act, n, out, os, want, scale);
    for (int64_t i = 0; i < n; i++) {
        double x = opf_load_elem(gate, i * gs, dt), u = opf_load_elem(up, i * us, dt);
        double g = opf_load_elem(grad, i * rs, dt);
        want[i] = g * u * act_grad_f64(act, x);
        want2[i] = g * act_f64(act, x);
        scale[i] = 1.0 + fabs(g * u);
        scale2[i] = 1.0 + fabs(g);
    }
    k->bwd[dt](out, out2, grad, gate, up, n, os, rs, gs, us, act);
    compare("bwd dgate", k->name, dt, act, n, out, os, want, scale);
    compare("bwd dup", k->name, dt, act, n, out2, os, want2, scale2);
}

/* Gates at the edges of exp's range (infinities, magnitudes whose square overflows float32, exponents far
 * below the smallest float) and NaN, float32: the scalar reference's values, NaN where it has NaN. The
 * vector exp clamped its argument to [-87.3, 88.7], so GELU's derivative x phi(x) was inf x 1e-38 = inf at
 * inf (the reference: inf x 0 = NaN) and -4.86e-9 at -1e30 (the reference: 0). */
static void test_special(const glu_kernels *k) {
    static const float gate[] = {INFINITY, -INFINITY, -1e30f, -1e25f, 1e30f, 1e25f, -100.0f,
                                 100.0f,   -20.0f,    20.0f,  -2.0f,  0.5f,  NAN};
    enum { N = sizeof gate / sizeof *gate };
    float up[N], grad[N], got[3][N], want[3][N];
    for (int i = 0; i < N; i++) up[i] = 1.0f, grad[i] = 1.0f;
    for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++) {
        k->fwd[OPF_F32](got[0], gate, up, N, 1, 1, 1, ACTS[a]);
        k->bwd[OPF_F32](got[1], got[2], grad, gate, up, N, 1, 1, 1, 1, ACTS[a]);
        glu_kernels_ref.fwd[OPF_F32](want[0], gate, up, N, 1, 1, 1, ACTS[a]);
        glu_kernels_ref.bwd[OPF_F32](want[1], want[2], grad, gate, up, N, 1, 1, 1, 1, ACTS[a]);
        static const char *const what[] = {"fwd", "bwd dgate", "bwd dup"};
        for (int o = 0; o < 3; o++)
            for (int i = 0; i < N; i++) {
                float g = got[o][i], w = want[o][i];
                int same = isnan(w) || isnan(g) ? isnan(w) && isnan(g) : g == w || fabsf(g - w) <= 1e-4f * fabsf(w);
                CHECK(same, "%s %s act=%d at %g: got %g, reference %g", what[o], k->name, (int)ACTS[a], gate[i], g, w);
            }
    }
}

#define TEST_VARIANT(k)                                                                                  \
    do {                                                                                                 \
        for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++)                                                     \
            for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++)                                      \
                for (size_t s = 0; s < sizeof SIZES / sizeof *SIZES; s++) {                              \
                    test_rows(k, (opf_dtype)dt, ACTS[a], SIZES[s], 1, 1, 1, 1);                          \
                    test_rows(k, (opf_dtype)dt, ACTS[a], SIZES[s], 2, 3, 1, 0); /* strided, broadcast */ \
                }                                                                                        \
    } while (0)

/* The driver over a (rows, F) view: threaded (the default pthreads backend)
 * and serial give the same bits, and match the row kernel element by element. */
static void serial_for(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx) {
    (void)grain;
    fn(begin, end, ctx);
}
static int one_thread(void) { return 1; }

static void test_driver(const glu_kernels *k) {
    const opf_parallel_backend serial = {.parallel_for = serial_for, .num_threads = one_thread};
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        /* 65 rows of the gate half of a packed (rows, 2F) buffer and its up half; F = 4097 */
        const int64_t rows = 65, f = 4097, sizes[2] = {rows, f}, packed[2] = {2 * f, 1}, dense[2] = {f, 1};
        const size_t es = opf_dtype_size((opf_dtype)dt), nb = (size_t)(rows * 2 * f) * es;
        char *x = malloc(nb), *g = malloc(nb / 2), *o1 = malloc(nb / 2), *o2 = malloc(nb / 2), *d1 = malloc(nb / 2),
             *d2 = malloc(nb / 2), *e1 = malloc(nb / 2), *e2 = malloc(nb / 2);
        fill(dt, x, rows * 2 * f, 5, 5.0);
        fill(dt, g, rows * f, 6, 1.0);
        opf_nd nd;
        const int64_t *fs[] = {dense, packed, packed};
        opf_nd_init(&nd, 2, sizes, 3, fs);
        const int64_t *bs[] = {dense, dense, packed, packed};
        opf_nd bnd;
        opf_nd_init(&bnd, 2, sizes, 4, bs);
        glu_fwd(k, dt, &nd, o1, x, x + f * es, ACT_SILU);
        glu_bwd(k, dt, &bnd, d1, e1, g, x, x + f * es, ACT_GELU);
        opf_parallel_set_backend(&serial);
        glu_fwd(k, dt, &nd, o2, x, x + f * es, ACT_SILU);
        glu_bwd(k, dt, &bnd, d2, e2, g, x, x + f * es, ACT_GELU);
        opf_parallel_set_backend(NULL);
        CHECK(memcmp(o1, o2, nb / 2) == 0 && memcmp(d1, d2, nb / 2) == 0 && memcmp(e1, e2, nb / 2) == 0,
              "driver %s %s: threaded and serial results differ", k->name, DT_NAME[dt]);
        /* row r of the output is the row kernel on row r */
        for (int64_t r = 0; r < rows; r += 16) {
            k->fwd[dt](o2, x + (size_t)(r * 2 * f) * es, x + (size_t)(r * 2 * f + f) * es, f, 1, 1, 1, ACT_SILU);
            CHECK(memcmp(o1 + (size_t)(r * f) * es, o2, (size_t)f * es) == 0, "driver %s %s: row %lld differs", k->name,
                  DT_NAME[dt], (long long)r);
        }
        free(x), free(g), free(o1), free(o2), free(d1), free(d2), free(e1), free(e2);
    }
}

/* Runs long enough for the streaming (non-temporal) stores, from a misaligned start so the head block
 * runs too: the same bits as the same kernel on short pieces (which store normally). */
static void test_long_runs(const glu_kernels *k) {
    const int64_t n = ((int64_t)9 << 20) / 2 + 37, piece = 4097; /* > 8 MiB of 16-bit output */
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        const size_t es = opf_dtype_size((opf_dtype)dt), nb = (size_t)(n + 1) * es;
        char *gate = malloc(nb), *up = malloc(nb), *grad = malloc(nb), *a = malloc(nb), *b = malloc(nb),
             *c = malloc(nb), *d = malloc(nb);
        fill(dt, gate, n + 1, 21, 6.0);
        fill(dt, up, n + 1, 22, 3.0);
        fill(dt, grad, n + 1, 23, 2.0);
        char *g1 = gate + es, *u1 = up + es, *r1 = grad + es; /* misaligned by one element */
        k->fwd[dt](a + es, g1, u1, n, 1, 1, 1, ACT_SILU);
        for (int64_t i = 0; i < n; i += piece)
            k->fwd[dt](b + es + (size_t)i * es, g1 + (size_t)i * es, u1 + (size_t)i * es, n - i < piece ? n - i : piece,
                       1, 1, 1, ACT_SILU);
        CHECK(memcmp(a + es, b + es, (size_t)n * es) == 0, "%s %s: streamed forward differs from short runs", k->name,
              DT_NAME[dt]);
        k->bwd[dt](a + es, c + es, r1, g1, u1, n, 1, 1, 1, 1, ACT_GELU_TANH);
        for (int64_t i = 0; i < n; i += piece) {
            const size_t o = (size_t)i * es;
            k->bwd[dt](b + es + o, d + es + o, r1 + o, g1 + o, u1 + o, n - i < piece ? n - i : piece, 1, 1, 1, 1,
                       ACT_GELU_TANH);
        }
        CHECK(memcmp(a + es, b + es, (size_t)n * es) == 0 && memcmp(c + es, d + es, (size_t)n * es) == 0,
              "%s %s: streamed backward differs from short runs", k->name, DT_NAME[dt]);
        /* written over gate and up (glu_backward_: plain stores), and over them at stride 2 */
        memcpy(b, gate, nb), memcpy(d, up, nb);
        k->bwd[dt](b + es, d + es, r1, b + es, d + es, n, 1, 1, 1, 1, ACT_GELU_TANH);
        CHECK(memcmp(a + es, b + es, (size_t)n * es) == 0 && memcmp(c + es, d + es, (size_t)n * es) == 0,
              "%s %s: backward written over gate and up differs", k->name, DT_NAME[dt]);
        const int64_t half = n / 2;
        k->bwd[dt](a, c, grad, gate, up, half, 2, 2, 2, 2, ACT_SILU);
        memcpy(b, gate, nb), memcpy(d, up, nb);
        k->bwd[dt](b, d, grad, b, d, half, 2, 2, 2, 2, ACT_SILU);
        int same = 1;
        for (int64_t i = 0; i < half; i++)
            same &= memcmp(a + 2 * i * es, b + 2 * i * es, es) == 0 && memcmp(c + 2 * i * es, d + 2 * i * es, es) == 0;
        CHECK(same, "%s %s: strided backward written over gate and up differs", k->name, DT_NAME[dt]);
        free(gate), free(up), free(grad), free(a), free(b), free(c), free(d);
    }
}

#define TEST_ALL(k)        \
    do {                   \
        TEST_VARIANT(k);   \
        test_special(k);   \
        test_driver(k);    \
        test_long_runs(k); \
    } while (0)

int main(void) {
    CHECK_EACH_VARIANT(glu_kernels_for, TEST_ALL);
    return check_report("test_glu");
}
