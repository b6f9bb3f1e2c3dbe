/*
 * The CUDA kernels of softmax / log_softmax and their backwards
 * (csrc/cuda/softmax.cu), run on the CPU over tests/emu/cuda_emu.h, against
 * the C reference kernels line by line: every dtype, row lengths around the
 * warp, block and register limits, rows misaligned from each other and from
 * the output, row strides larger than the row, the reduction along a strided
 * dim (lane path), operands without any unit-stride dim (strided loop), 0-d
 * and empty tensors, and rows holding -inf (some, most, all), +inf and NaN. Every path of the
 * launchers is seen for every dtype that has it.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/softmax.h"
#include "../../csrc/kernels/softmax.h"
#include "../c/check.h"

static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};

/* the kernels the launchers ran, per dtype and direction, to check every path was taken */
enum { MAX_SEEN = 32 };
static const char *seen[OPF_DTYPE_COUNT][2][MAX_SEEN];
static void saw(opf_dtype dt, int bwd, const char *k) {
    for (int i = 0; i < MAX_SEEN; i++) {
        if (seen[dt][bwd][i] && strcmp(seen[dt][bwd][i], k) == 0) return;
        if (!seen[dt][bwd][i]) {
            seen[dt][bwd][i] = k;
            return;
        }
    }
}
static int was_seen(opf_dtype dt, int bwd, const char *k) {
    for (int i = 0; i < MAX_SEEN && seen[dt][bwd][i]; i++)
        if (strcmp(seen[dt][bwd][i], k) == 0) return 1;
    return 0;
}

/* A tensor layout: sizes, the input's strides, the output's strides, the input's offset in elements. */
typedef struct layout {
    int ndim, dim;
    int64_t sizes[4], xs[4], ys[4], xoff;
    const char *what;
} layout;

static int64_t numel_of(const layout *L) {
    int64_t n = 1;
    for (int d = 0; d < L->ndim; d++) n *= L->sizes[d];
    return n;
}
/* elements a buffer with these strides needs */
static int64_t span_of(const layout *L, const int64_t *st) {
    int64_t s = 1;
    for (int d = 0; d < L->ndim; d++)
        if (L->sizes[d] == 0) return 0;
    for (int d = 0; d < L->ndim; d++) s += (L->sizes[d] - 1) * st[d];
    return s;
}
/* offset of flat element i (row-major over sizes) */
static int64_t offset_of(const layout *L, const int64_t *st, int64_t i) {
    int64_t off = 0;
    for (int d = L->ndim - 1; d >= 0; d--) {
        off += (i % L->sizes[d]) * st[d];
        i /= L->sizes[d];
    }
    return off;
}

static void fill(opf_dtype dt, void *p, int64_t n, double lo, double hi, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, lo + (hi - lo) * check_uniform(&seed));
}

static double tol_of(opf_dtype dt) {
    return dt == OPF_F64 ? 1e-12 : dt == OPF_F32 ? 3e-6 : dt == OPF_BF16 ? 1e-2 : 2e-3;
}

static void compare(const char *what, const layout *L, opf_dtype dt, const void *got, const void *want,
                    const int64_t *st) {
    const double tol = tol_of(dt);
    const int64_t n = numel_of(L);
    int64_t bad = 0, first = -1;
    double ga = 0, wa = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t o = offset_of(L, st, i);
        double a = opf_load_elem(got, o, dt), b = opf_load_elem(want, o, dt);
        int ok = (isnan(a) && isnan(b)) || a == b || fabs(a - b) <= tol * fmax(1.0, fabs(b));
        if (!ok) {
            if (first < 0) first = i, ga = a, wa = b;
            bad++;
        }
    }
    CHECK(bad == 0, "%s %s (%s, dim %d of %lld elements): %lld mismatches, first at %lld: got %.9g want %.9g", what,
          DT_NAME[dt], L->what, L->dim, (long long)n, (long long)bad, (long long)first, ga, wa);
}

/* the reference along every line of L: out (strides os) from in (strides is), saved y (strides ys) */
static void reference(const layout *L, opf_dtype dt, int bwd, int log, void *out, const int64_t *os, const void *in,
                      const int64_t *is, const void *y, const int64_t *yst) {
    const size_t es = opf_dtype_size(dt);
    layout lines = *L;
    lines.sizes[L->dim] = 1;
    const int64_t nl = numel_of(&lines), n = L->sizes[L->dim];
    for (int64_t i = 0; i < nl; i++) {
        char *o = (char *)out + offset_of(&lines, os, i) * (int64_t)es;
        const char *a = (const char *)in + offset_of(&lines, is, i) * (int64_t)es;
        if (bwd)
            softmax_kernels_ref.bwd[dt](o, a, (const char *)y + offset_of(&lines, yst, i) * (int64_t)es, n, 1,
                                        os[L->dim], is[L->dim], yst[L->dim], log);
        else
            softmax_kernels_ref.fwd[dt](o, a, n, 1, os[L->dim], is[L->dim], log);
    }
}

/* Forward and backward of L (the backward's grad laid out as x, its saved y and dx as the output);
 * special: put -inf, +inf and NaN into some rows of x. */
static void run_case(opf_dtype dt, const layout *L, int special) {
    const size_t es = opf_dtype_size(dt);
    const int64_t nx = span_of(L, L->xs) + L->xoff, ny = span_of(L, L->ys) + 1, n = L->sizes[L->dim];
    char *xbuf = calloc((size_t)nx + 16, es), *gbuf = calloc((size_t)nx + 16, es);
    char *y = calloc((size_t)ny + 16, es), *ref = calloc((size_t)ny + 16, es);
    char *dx = calloc((size_t)ny + 16, es), *dref = calloc((size_t)ny + 16, es);
    char *x = xbuf + L->xoff * (int64_t)es, *g = gbuf + L->xoff * (int64_t)es;
    fill(dt, xbuf, nx, -8, 8, 7 + (unsigned long long)nx);
    fill(dt, gbuf, nx, -1, 1, 11 + (unsigned long long)nx);
    if (special && numel_of(L) > 0) {
        /* line j starts at flat index (j * n) when dim is the last one; the cases that use this are */
        const int64_t lines = numel_of(L) / n;
        for (int64_t j = 0; j < lines; j++) {
            int64_t base = j * n;
            switch (j % 7) {
            case 0: opf_store_elem(x, offset_of(L, L->xs, base + n / 2), dt, -INFINITY); break;
            case 1:
                for (int64_t k = 0; k < n; k++) opf_store_elem(x, offset_of(L, L->xs, base + k), dt, -INFINITY);
                break;
            case 2: opf_store_elem(x, offset_of(L, L->xs, base + n - 1), dt, INFINITY); break;
            case 3: opf_store_elem(x, offset_of(L, L->xs, base + n / 3), dt, NAN); break;
            case 4:
                for (int64_t k = 0; k < n; k += 2) opf_store_elem(x, offset_of(L, L->xs, base + k), dt, -INFINITY);
                break;
            case 5: /* -inf over whole batches of packs before the finite values */
                for (int64_t k = 0; k < n * 9 / 10; k++)
                    opf_store_elem(x, offset_of(L, L->xs, base + k), dt, -INFINITY);
                break;
            default: break;
            }
        }
    }
    softmax_cuda_lines l;
    for (int log = 0; log < 2; log++) {
        const int64_t *s2[] = {L->ys, L->xs}, *s3[] = {L->ys, L->xs, L->ys};
        CHECK(softmax_cuda_plan(&l, L->ndim, L->dim, L->sizes, 2, s2) == 0, "plan");
        softmax_cuda_launch r = softmax_cuda_fwd(dt, y, x, &l, log, NULL);
        CHECK((r.grid == 0) == (numel_of(L) == 0), "%s: blocks launched %u for %lld elements", L->what, r.grid,
              (long long)numel_of(L));
        if (r.grid) saw(dt, 0, r.kernel);
        reference(L, dt, 0, log, ref, L->ys, x, L->xs, NULL, NULL);
        compare(log ? "log_softmax fwd" : "softmax fwd", L, dt, y, ref, L->ys);
        /* the backward from the reference's y, so that both sides see the same saved output */
        CHECK(softmax_cuda_plan(&l, L->ndim, L->dim, L->sizes, 3, s3) == 0, "plan");
        r = softmax_cuda_bwd(dt, dx, g, ref, &l, log, NULL);
        if (r.grid) saw(dt, 1, r.kernel);
        reference(L, dt, 1, log, dref, L->ys, g, L->xs, ref, L->ys);
        compare(log ? "log_softmax bwd" : "softmax bwd", L, dt, dx, dref, L->ys);
    }
    free(xbuf), free(gbuf), free(y), free(ref), free(dx), free(dref);
}

static layout rows_layout(int64_t rows, int64_t n, int64_t row_stride, int64_t xoff, const char *what) {
    layout L = {
        .ndim = 2, .dim = 1, .sizes = {rows, n}, .xs = {row_stride, 1}, .ys = {n, 1}, .xoff = xoff, .what = what};
    return L;
}

int main(void) {
    static const int64_t NS[] = {1, 3, 31, 32, 33, 100, 128, 129, 256, 257, 512, 513, 1000, 4096, 8193, 16384, 16385};
    for (int dti = 0; dti < OPF_DTYPE_COUNT; dti++) {
        const opf_dtype dt = (opf_dtype)dti;
        for (size_t i = 0; i < sizeof NS / sizeof *NS; i++) {
            const int64_t n = NS[i], rows = n <= 512 ? 19 : n <= 4096 ? 5 : 2;
            layout L = rows_layout(rows, n, n, 0, "contiguous rows");
            run_case(dt, &L, 0);
        }
        /* x one element off the output's 16-byte phase: every row element by element */
        static const int64_t MIS[] = {33, 300, 1000, 20000};
        for (size_t i = 0; i < sizeof MIS / sizeof *MIS; i++) {
            layout L = rows_layout(3, MIS[i], MIS[i], 1, "x misaligned from y");
            run_case(dt, &L, 0);
        }
        /* rows further apart than their length */
        static const int64_t RS[] = {7, 100, 600, 5000, 17000};
        for (size_t i = 0; i < sizeof RS / sizeof *RS; i++) {
            layout L = rows_layout(3, RS[i], RS[i] + 5, 0, "row stride > row");
            run_case(dt, &L, 0);
        }
        /* the reduced dim strided, a unit-stride dim beside it: the lane path */
        {
            layout a = {.ndim = 2, .dim = 0, .sizes = {50, 70}, .xs = {70, 1}, .ys = {70, 1}, .what = "dim 0"};
            layout b = {.ndim = 3, .dim = 1, .sizes = {2, 7, 9}, .xs = {63, 9, 1}, .ys = {63, 9, 1}, .what = "nchw"};
            layout c = {.ndim = 2, .dim = 0, .sizes = {3, 33}, .xs = {33, 1}, .ys = {33, 1}, .what = "dim 0 short"};
            layout d = {.ndim = 2, .dim = 1, .sizes = {40, 6}, .xs = {1, 40}, .ys = {1, 40}, .what = "transposed"};
            layout e = {.ndim = 2, .dim = 1, .sizes = {5, 1}, .xs = {1, 1}, .ys = {1, 1}, .what = "n = 1"};
            run_case(dt, &a, 0), run_case(dt, &b, 0), run_case(dt, &c, 0), run_case(dt, &d, 0), run_case(dt, &e, 0);
        }
        /* no dim of stride 1 in every operand: strided rows, two passes */
        {
            layout a = {.ndim = 2, .dim = 1, .sizes = {6, 40}, .xs = {100, 2}, .ys = {40, 1}, .what = "every other"};
            layout b = {.ndim = 2, .dim = 1, .sizes = {2, 2000}, .xs = {4001, 2}, .ys = {2000, 1}, .what = "long"};
            layout c = {.ndim = 3, .dim = 2, .sizes = {2, 3, 5}, .xs = {40, 12, 2}, .ys = {15, 5, 1}, .what = "3-d"};
            run_case(dt, &a, 0), run_case(dt, &b, 0), run_case(dt, &c, 0);
        }
        /* 0-d, 1-d, empty */
        {
            layout z = {.ndim = 0, .dim = 0, .what = "0-d"};
            /* a 0-d tensor is planned as one element, as the glue does */
            layout one = {.ndim = 1, .dim = 0, .sizes = {1}, .xs = {1}, .ys = {1}, .what = "0-d as (1,)"};
            (void)z;
            layout v = {.ndim = 1, .dim = 0, .sizes = {777}, .xs = {1}, .ys = {1}, .what = "1-d"};
            layout e0 = rows_layout(0, 5, 5, 0, "no rows"), e1 = rows_layout(5, 0, 0, 0, "empty rows");
            run_case(dt, &one, 0), run_case(dt, &v, 0), run_case(dt, &e0, 0), run_case(dt, &e1, 0);
        }
        /* -inf, a row of -inf only, +inf, NaN: on each path */
        static const int64_t SP[] = {40, 300, 3000, 20000};
        for (size_t i = 0; i < sizeof SP / sizeof *SP; i++) {
            layout L = rows_layout(SP[i] > 5000 ? 7 : 14, SP[i], SP[i], 0, "special values");
            run_case(dt, &L, 1);
            layout M = rows_layout(7, SP[i], SP[i], 1, "special values, misaligned");
            if (SP[i] <= 3000) run_case(dt, &M, 1);
        }
        layout S = rows_layout(7, 50, 100, 0, "special values, strided");
        S.xs[1] = 2;
        run_case(dt, &S, 1);
        /* every path ran */
        static const char *const FWD[] = {"softmax_fwd_warp1", "softmax_fwd_warp2",     "softmax_fwd_warp4",
                                          "softmax_fwd_block", "softmax_fwd_loop_warp", "softmax_fwd_loop",
                                          "softmax_fwd_lanes"};
        for (size_t k = 0; k < sizeof FWD / sizeof *FWD; k++) {
            if (dt == OPF_F64 && k < 4) continue;                      /* float64: no register path */
            if ((dt == OPF_BF16 || dt == OPF_F16) && k == 2) continue; /* 2 packs of 8 halves hold 512 */
            char bwd[64];
            snprintf(bwd, sizeof bwd, "softmax_bwd_%s", FWD[k] + strlen("softmax_fwd_"));
            CHECK(was_seen(dt, 0, FWD[k]), "%s never ran for %s", FWD[k], DT_NAME[dt]);
            CHECK(was_seen(dt, 1, bwd), "%s never ran for %s", bwd, DT_NAME[dt]);
        }
    }
    return check_report("test_softmax (CUDA, emulated)");
}
