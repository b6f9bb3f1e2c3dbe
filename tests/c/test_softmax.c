/*
 * Every compiled softmax / log_softmax variant against the reference (which
 * computes in double and rounds once), forward and backward, all dtypes:
 * rows of n = 1, 7, 123, 4097, 32000 elements, 1, 3 and 37 of them, laid out
 * as rows (dim of stride 1), transposed (the reduction down a strided dim,
 * the lanes vectorised) and with every other element (a strided row). Rows
 * hold -inf entries, one row is all -inf (NaN, as torch), one holds +inf and
 * one NaN (the whole row NaN). Tolerance per dtype: float32 1e-5 relative
 * (+1e-6), halves one unit of their last place (+1e-6); float64 runs the
 * reference on every variant, so it must match to 1e-12.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/kernels/softmax.h"
#include "check.h"

static const int64_t NS[] = {1, 7, 123, 4097, 32000};
static const int64_t ROWS[] = {1, 3, 37};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};

static double rtol(opf_dtype dt) {
    return dt == OPF_F64 ? 1e-12 : dt == OPF_F32 ? 1e-5 : dt == OPF_BF16 ? 0x1p-7 : 0x1p-10;
}

/* value of element (r, k) of the input */
static double input_value(int64_t r, int64_t k, unsigned long long *seed) {
    double v = check_uniform(seed) * 16.0 - 8.0;
    if (k % 13 == 4) v = -INFINITY;
    if (r == 1) v = -INFINITY;
    if (r == 2 && k == 0) v = INFINITY;
    if (r == 5 && k == 3) v = NAN;
    return v;
}

static void compare(const char *what, const char *isa, opf_dtype dt, const void *got, const void *want,
                    const int64_t *offs, int64_t count, int64_t rows, int64_t n, const char *layout) {
    int64_t bad = -1, nbad = 0;
    double maxerr = 0, gb = 0, wb = 0;
    for (int64_t i = 0; i < count; i++) {
        double g = opf_load_elem(got, offs[i], dt), w = opf_load_elem(want, offs[i], dt);
        int ok;
        if (isnan(w) || isnan(g))
            ok = isnan(w) && isnan(g);
        else if (isinf(w) || isinf(g))
            ok = g == w;
        else {
            double err = fabs(g - w);
            ok = err <= rtol(dt) * fabs(w) + (dt == OPF_F64 ? 1e-12 : 1e-6);
            if (err > maxerr) maxerr = err;
        }
        if (!ok && bad < 0) bad = i, gb = g, wb = w;
        nbad += !ok;
    }
    CHECK(nbad == 0, "%s %s %s rows=%lld n=%lld %s: %lld mismatches, first at %lld: got %.9g want %.9g (max err %.3g)",
          isa, what, DT_NAME[dt], (long long)rows, (long long)n, layout, (long long)nbad, (long long)bad, gb, wb,
          maxerr);
}

/* layout 0: rows (rows, n), dim 1; 1: transposed, (n, rows), dim 0; 2: (rows, n) at every other element */
static void run_case(const softmax_kernels *k, opf_dtype dt, int64_t rows, int64_t n, int layout, int is_log) {
    static const char *const LAYOUT[] = {"rows", "transposed", "stride 2"};
    const size_t es = opf_dtype_size(dt);
    const int64_t span = rows * n * (layout == 2 ? 2 : 1);
    int64_t sizes[2], strides[2];
    int dim;
    if (layout == 1)
        sizes[0] = n, sizes[1] = rows, strides[0] = rows, strides[1] = 1, dim = 0;
    else
        sizes[0] = rows, sizes[1] = n, strides[0] = n * (layout == 2 ? 2 : 1), strides[1] = layout == 2 ? 2 : 1,
        dim = 1;
    char *x = calloc((size_t)span, es), *dy = calloc((size_t)span, es), *y = calloc((size_t)span, es);
    char *yr = calloc((size_t)span, es), *dx = calloc((size_t)span, es), *dxr = calloc((size_t)span, es);
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)(rows * n));
    unsigned long long seed = 0x9e3779b97f4a7c15ull ^ (unsigned long long)(n * 131 + rows);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            int64_t off = layout == 1 ? c * rows + r : r * strides[0] + c * strides[1];
            offs[r * n + c] = off;
            opf_store_elem(x, off, dt, input_value(r, c, &seed));
            opf_store_elem(dy, off, dt, check_uniform(&seed) * 2.0 - 1.0);
        }
    softmax_problem p = {
        .dt = dt, .log = is_log, .ndim = 2, .dim = dim, .sizes = sizes, .strides = {strides, strides, strides}};
    p.out = yr, p.in = x;
    softmax_fwd(&softmax_kernels_ref, &p);
    p.out = y;
    softmax_fwd(k, &p);
    compare(is_log ? "log_softmax fwd" : "softmax fwd", k->name, dt, y, yr, offs, rows * n, rows, n, LAYOUT[layout]);
    p.in = dy, p.y = yr, p.out = dxr;
    softmax_bwd(&softmax_kernels_ref, &p);
    p.out = dx;
    softmax_bwd(k, &p);
    compare(is_log ? "log_softmax bwd" : "softmax bwd", k->name, dt, dx, dxr, offs, rows * n, rows, n, LAYOUT[layout]);
    free(x), free(dy), free(y), free(yr), free(dx), free(dxr), free(offs);
}

/* exact zeros and -inf where the input is -inf, finite gradients there */
static void check_masked(const softmax_kernels *k) {
    float x[9] = {1, -INFINITY, 2, 3, -INFINITY, 0.5f, -1, 4, -INFINITY}, y[9], ly[9], dy[9], dx[9];
    int64_t sizes[1] = {9}, st[1] = {1};
    softmax_problem p = {
        .dt = OPF_F32, .ndim = 1, .dim = 0, .sizes = sizes, .strides = {st, st, st}, .in = x, .out = y};
    softmax_fwd(k, &p);
    p.log = 1, p.out = ly;
    softmax_fwd(k, &p);
    for (int i = 0; i < 9; i++) dy[i] = (float)i - 4.0f;
    p.in = dy, p.y = ly, p.out = dx;
    softmax_bwd(k, &p);
    for (int i = 0; i < 9; i++) {
        if (isinf(x[i])) {
            CHECK(y[i] == 0.0f && ly[i] == -INFINITY, "%s: -inf at %d gives %g and %g, want 0 and -inf", k->name, i,
                  y[i], ly[i]);
            CHECK(dx[i] == dy[i], "%s: log_softmax gradient at a -inf entry is %g, want dy = %g", k->name, dx[i],
                  dy[i]);
        }
        CHECK(isfinite(dx[i]), "%s: gradient %d not finite: %g", k->name, i, dx[i]);
    }
}

static void test_variant(const softmax_kernels *k) {
    check_masked(k);
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++)
        for (size_t a = 0; a < sizeof NS / sizeof *NS; a++)
            for (size_t b = 0; b < sizeof ROWS / sizeof *ROWS; b++)
                for (int layout = 0; layout < 3; layout++)
                    for (int is_log = 0; is_log < 2; is_log++)
                        run_case(k, (opf_dtype)dt, ROWS[b], NS[a], layout, is_log);
}

int main(void) {
    CHECK_EACH_VARIANT(softmax_kernels_for, test_variant);
    return check_report("test_softmax");
}
