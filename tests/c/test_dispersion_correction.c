/*
 * Every compiled dispersion_correction variant against the scalar reference:
 * all dtypes, sizes 0..4097 around the vector widths, special values (0, -0,
 * negatives, inf, nan, subnormals), strided runs, and the n-d threaded driver
 * on strided, transposed and broadcast views. Results must agree bit for bit
 * (NaN matches any NaN): the variants round exactly as the reference does.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/dispersion_correction.h"
#include "check.h"

static const int64_t SIZES[] = {0, 1, 7, 15, 16, 17, 31, 33, 123, 4097};
static const double SPECIAL[] = {0.0, -0.0,  1.0,  4.0,    -1.0,    INFINITY, -INFINITY,
                                 NAN, 1e-40, 6e-8, 1e-300, 65504.0, 3e38,     2.5};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const size_t DT_SIZE[] = {4, 8, 2, 2};
static const double ALPHA = 0.8;

static void store(opf_dtype dt, void *p, int64_t i, double v) {
    switch (dt) {
    case OPF_F32: ((float *)p)[i] = (float)v; break;
    case OPF_F64: ((double *)p)[i] = v; break;
    case OPF_BF16: ((uint16_t *)p)[i] = opf_f32_to_bf16((float)v); break;
    default: ((uint16_t *)p)[i] = opf_f32_to_f16((float)v); break;
    }
}

static double load(opf_dtype dt, const void *p, int64_t i) {
    switch (dt) {
    case OPF_F32: return ((const float *)p)[i];
    case OPF_F64: return ((const double *)p)[i];
    case OPF_BF16: return opf_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return opf_f16_to_f32(((const uint16_t *)p)[i]);
    }
}

static int same(opf_dtype dt, const void *a, const void *b, int64_t i) {
    double x = load(dt, a, i), y = load(dt, b, i);
    if (isnan(x) || isnan(y)) return isnan(x) && isnan(y);
    return memcmp((const char *)a + i * DT_SIZE[dt], (const char *)b + i * DT_SIZE[dt], DT_SIZE[dt]) == 0;
}

static void fill(opf_dtype dt, void *p, int64_t n, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) {
        double v = check_uniform(&seed) * 10.0;
        if (i % 11 == 5) v = SPECIAL[(i / 11) % (sizeof SPECIAL / sizeof *SPECIAL)];
        store(dt, p, i, v);
    }
}

/* out[i * os] vs ref for n elements; reports the first mismatch and max error */
static void compare(const char *what, const char *isa, opf_dtype dt, const void *got, const void *want, int64_t n,
                    int64_t stride) {
    int64_t bad = -1, nbad = 0;
    double maxerr = 0;
    for (int64_t i = 0; i < n; i++) {
        if (same(dt, got, want, i * stride)) continue;
        if (bad < 0) bad = i;
        nbad++;
        double e = fabs(load(dt, got, i * stride) - load(dt, want, i * stride));
        if (e > maxerr) maxerr = e;
    }
    CHECK(nbad == 0, "%s %s %s n=%lld: %lld mismatches, first at %lld: got %.9g want %.9g, max err %g", what, isa,
          DT_NAME[dt], (long long)n, (long long)nbad, (long long)bad, bad >= 0 ? load(dt, got, bad * stride) : 0.0,
          bad >= 0 ? load(dt, want, bad * stride) : 0.0, maxerr);
}

static void test_variant(opf_isa isa, const dispersion_correction_kernels *k) {
    const dispersion_correction_kernels *ref = &dispersion_correction_kernels_ref;
    const char *name = opf_isa_name(isa);
    enum { N = 4097 * 3 };
    static char x[N * 8], dy[N * 8], want[N * 8], got[N * 8];
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        for (size_t s = 0; s < sizeof SIZES / sizeof *SIZES; s++) {
            int64_t n = SIZES[s];
            fill(dt, x, N, 1234 + (unsigned long long)n);
            fill(dt, dy, N, 99 + (unsigned long long)n);
            /* unit stride */
            ref->fwd[dt](want, x, n, 1, 1, ALPHA);
            k->fwd[dt](got, x, n, 1, 1, ALPHA);
            compare("fwd", name, dt, got, want, n, 1);
            ref->bwd[dt](want, dy, x, n, 1, 1, 1, ALPHA);
            k->bwd[dt](got, dy, x, n, 1, 1, 1, ALPHA);
            compare("bwd", name, dt, got, want, n, 1);
            /* strided input and output, and a broadcast (stride 0) gradient */
            ref->fwd[dt](want, x, n, 2, 3, ALPHA);
            k->fwd[dt](got, x, n, 2, 3, ALPHA);
            compare("fwd strided", name, dt, got, want, n, 2);
            ref->bwd[dt](want, dy, x, n, 1, 0, 3, ALPHA);
            k->bwd[dt](got, dy, x, n, 1, 0, 3, ALPHA);
            compare("bwd strided", name, dt, got, want, n, 1);
        }
    }
}

/* Runs long enough for the streaming (non-temporal) stores, from a misaligned
 * start so the scalar head runs too. */
static void test_long_runs(opf_isa isa, const dispersion_correction_kernels *k) {
    const int64_t n = ((int64_t)9 << 20) / 2 + 37; /* > 8 MiB of 16-bit output */
    char *x = malloc((size_t)(n + 1) * 8), *want = malloc((size_t)(n + 1) * 8), *got = malloc((size_t)(n + 1) * 8);
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        int64_t m = n * 2 / (int64_t)DT_SIZE[dt] + 5; /* > 8 MiB in every dtype */
        if (m > n) m = n;
        fill(dt, x, m + 1, 3);
        char *xs = x + DT_SIZE[dt], *ws = want + DT_SIZE[dt], *gs = got + DT_SIZE[dt];
        dispersion_correction_kernels_ref.fwd[dt](ws, xs, m, 1, 1, ALPHA);
        k->fwd[dt](gs, xs, m, 1, 1, ALPHA);
        compare("fwd long", opf_isa_name(isa), dt, gs, ws, m, 1);
    }
    free(x), free(want), free(got);
}

/* The whole-tensor driver on a view, against the reference element by element. */
static void test_driver_view(opf_isa isa, opf_dtype dt, int ndim, const int64_t *sizes, const int64_t *x_strides,
                             const int64_t *dy_strides) {
    const dispersion_correction_kernels *k = dispersion_correction_kernels_for(isa);
    int64_t y_strides[OPF_MAX_DIMS], numel = 1, span = 1;
    for (int d = 0; d < ndim; d++) {
        numel *= sizes[d];
        span += (sizes[d] - 1) * (x_strides[d] > dy_strides[d] ? x_strides[d] : dy_strides[d]);
    }
    opf_output_strides(ndim, sizes, x_strides, y_strides);
    char *x = calloc((size_t)span, 8), *dy = calloc((size_t)span, 8);
    char *y = calloc((size_t)numel, 8), *dx = calloc((size_t)numel, 8);
    fill(dt, x, span, 7);
    fill(dt, dy, span, 8);
    opf_nd nd;
    const int64_t *fs[] = {y_strides, x_strides};
    opf_nd_init(&nd, ndim, sizes, 2, fs);
    dispersion_correction_fwd(k, dt, &nd, y, x, ALPHA);
    const int64_t *bs[] = {y_strides, dy_strides, x_strides};
    opf_nd_init(&nd, ndim, sizes, 3, bs);
    dispersion_correction_bwd(k, dt, &nd, dx, dy, x, ALPHA);
    int64_t bad = 0;
    char want[8];
    for (int64_t flat = 0; flat < numel; flat++) {
        int64_t rest = flat, xo = 0, yo = 0, go = 0;
        for (int d = ndim - 1; d >= 0; d--) {
            int64_t i = rest % sizes[d];
            rest /= sizes[d];
            xo += i * x_strides[d];
            yo += i * y_strides[d];
            go += i * dy_strides[d];
        }
        dispersion_correction_kernels_ref.fwd[dt](want, x + xo * DT_SIZE[dt], 1, 1, 1, ALPHA);
        if (!same(dt, y + yo * DT_SIZE[dt], want, 0) && bad++ == 0)
            CHECK(0, "driver fwd %s %s: element %lld got %g want %g", opf_isa_name(isa), DT_NAME[dt], (long long)flat,
                  load(dt, y, yo), load(dt, want, 0));
        dispersion_correction_kernels_ref.bwd[dt](want, dy + go * DT_SIZE[dt], x + xo * DT_SIZE[dt], 1, 1, 1, 1, ALPHA);
        if (!same(dt, dx + yo * DT_SIZE[dt], want, 0) && bad++ == 0)
            CHECK(0, "driver bwd %s %s: element %lld got %g want %g", opf_isa_name(isa), DT_NAME[dt], (long long)flat,
                  load(dt, dx, yo), load(dt, want, 0));
    }
    CHECK(bad == 0, "driver %s %s ndim=%d: %lld bad elements", opf_isa_name(isa), DT_NAME[dt], ndim, (long long)bad);
    free(x), free(dy), free(y), free(dx);
}

static void test_driver(opf_isa isa) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        /* contiguous, large enough for several threads */
        test_driver_view(isa, dt, 1, (int64_t[]){100003}, (int64_t[]){1}, (int64_t[]){1});
        /* rows of a wider buffer (a slice) */
        test_driver_view(isa, dt, 2, (int64_t[]){7, 13}, (int64_t[]){20, 1}, (int64_t[]){13, 1});
        /* transposed: the output copies the dense layout */
        test_driver_view(isa, dt, 2, (int64_t[]){13, 7}, (int64_t[]){1, 13}, (int64_t[]){7, 1});
        /* broadcast input and gradient (stride 0), 3-d with a size-1 dim */
        test_driver_view(isa, dt, 3, (int64_t[]){5, 1, 123}, (int64_t[]){0, 7, 1}, (int64_t[]){123, 1, 0});
        /* every other column, strided by 2, large enough to split */
        test_driver_view(isa, dt, 2, (int64_t[]){300, 257}, (int64_t[]){600, 2}, (int64_t[]){257, 1});
        /* 0-dim and empty */
        test_driver_view(isa, dt, 0, (int64_t[]){0}, (int64_t[]){0}, (int64_t[]){0});
        test_driver_view(isa, dt, 2, (int64_t[]){0, 5}, (int64_t[]){5, 1}, (int64_t[]){5, 1});
    }
}

int main(void) {
    int tested = 0;
    for (int isa = 0; isa < OPF_ISA_COUNT; isa++) {
        if (!check_use_isa(isa)) continue;
        const dispersion_correction_kernels *k = dispersion_correction_kernels_for((opf_isa)isa);
        CHECK(isa == OPF_ISA_REF || k != &dispersion_correction_kernels_ref, "%s variant missing from this build",
              opf_isa_name((opf_isa)isa));
        test_variant((opf_isa)isa, k);
        test_long_runs((opf_isa)isa, k);
        test_driver((opf_isa)isa);
        printf("tested %s\n", opf_isa_name((opf_isa)isa));
        tested++;
    }
    CHECK(tested >= 1, "no variant tested");
    return check_report("test_dispersion_correction");
}
