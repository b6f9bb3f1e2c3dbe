/*
 * The CUDA kernels of dispersion_correction (csrc/cuda/dispersion_correction.cu),
 * run on the CPU over tests/emu/cuda_emu.h, against the C reference kernel:
 * every dtype, sizes around the vector packs and the block, a misaligned
 * start (the scalar path), strided and broadcast operands (the strided walk).
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/dispersion_correction.h"
#include "../../csrc/kernels/dispersion_correction.h"
#include "../c/check.h"

static const int64_t SIZES[] = {0, 1, 7, 8, 9, 255, 256, 257, 2049, 70001};
static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const double ALPHA = 0.8;

static void fill(opf_dtype dt, void *p, int64_t n, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, check_uniform(&seed) * 10.0 + (i % 13 == 3 ? 0.0 : 1e-3));
}

/* within one rounding of the dtype (the GPU's contractions round differently from the reference's) */
static void compare(const char *what, opf_dtype dt, const void *got, const void *want, int64_t n, int64_t stride) {
    const double tol = dt == OPF_F64 ? 1e-14 : dt == OPF_F32 ? 3e-7 : dt == OPF_BF16 ? 8e-3 : 1e-3;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double a = opf_load_elem(got, i * stride, dt), b = opf_load_elem(want, i * stride, dt);
        if (!(fabs(a - b) <= tol * fmax(1.0, fabs(b)))) {
            if (first < 0) first = i;
            bad++;
        }
    }
    CHECK(bad == 0, "%s %s n=%lld: %lld mismatches, first at %lld: got %g want %g", what, DT_NAME[dt], (long long)n,
          (long long)bad, (long long)first, first >= 0 ? opf_load_elem(got, first * stride, dt) : 0.0,
          first >= 0 ? opf_load_elem(want, first * stride, dt) : 0.0);
}

static void test_flat(opf_dtype dt, int64_t n, int offset) {
    const size_t es = opf_dtype_size(dt);
    char *x = calloc((size_t)(n + 1) * es + 16, 1), *g = calloc((size_t)(n + 1) * es + 16, 1);
    char *y = calloc((size_t)(n + 1) * es + 16, 1), *ref = calloc((size_t)(n + 1) * es + 16, 1);
    void *xo = x + offset * es, *go = g + offset * es, *yo = y + offset * es;
    fill(dt, xo, n, 7 + (unsigned long long)n);
    fill(dt, go, n, 11 + (unsigned long long)n);
    const int64_t one = 1, *s2[] = {&one, &one}, *s3[] = {&one, &one, &one};
    opf_cuda_nd nd;
    CHECK(opf_cuda_nd_make(&nd, 1, &n, 2, s2) == 0, "nd");
    CHECK(n <= 1 || nd.flat, "a dense tensor is one flat walk");
    unsigned grid = dispersion_correction_cuda_fwd(dt, yo, xo, &nd, ALPHA, NULL);
    CHECK((n == 0) == (grid == 0), "blocks launched for n=%lld: %u", (long long)n, grid);
    dispersion_correction_kernels_ref.fwd[dt](ref, xo, n, 1, 1, ALPHA);
    compare(offset ? "fwd flat (misaligned)" : "fwd flat", dt, yo, ref, n, 1);
    opf_cuda_nd_make(&nd, 1, &n, 3, s3);
    dispersion_correction_cuda_bwd(dt, yo, go, xo, &nd, ALPHA, NULL);
    dispersion_correction_kernels_ref.bwd[dt](ref, go, xo, n, 1, 1, 1, ALPHA);
    compare(offset ? "bwd flat (misaligned)" : "bwd flat", dt, yo, ref, n, 1);
    free(x), free(g), free(y), free(ref);
}

/* x: every other element of a (rows, 2 * cols) tensor; grad broadcast along rows (stride 0) */
static void test_strided(opf_dtype dt, int64_t rows, int64_t cols) {
    const size_t es = opf_dtype_size(dt);
    const int64_t n = rows * cols, sizes[] = {rows, cols};
    char *x = calloc((size_t)(2 * n + 1) * es, 1), *g = calloc((size_t)(cols + 1) * es, 1);
    char *y = calloc((size_t)(n + 1) * es, 1), *ref = calloc((size_t)(n + 1) * es, 1);
    fill(dt, x, 2 * n, 3);
    fill(dt, g, cols, 5);
    const int64_t ys[] = {cols, 1}, xs[] = {2 * cols, 2}, gs[] = {0, 1};
    const int64_t *s2[] = {ys, xs}, *s3[] = {ys, gs, xs};
    opf_cuda_nd nd;
    opf_cuda_nd_make(&nd, 2, sizes, 2, s2);
    CHECK(!nd.flat || n <= 1, "a strided x is not flat");
    dispersion_correction_cuda_fwd(dt, y, x, &nd, ALPHA, NULL);
    for (int64_t r = 0; r < rows; r++)
        dispersion_correction_kernels_ref.fwd[dt](ref + r * cols * es, x + r * 2 * cols * es, cols, 1, 2, ALPHA);
    compare("fwd strided", dt, y, ref, n, 1);
    opf_cuda_nd_make(&nd, 2, sizes, 3, s3);
    dispersion_correction_cuda_bwd(dt, y, g, x, &nd, ALPHA, NULL);
    for (int64_t r = 0; r < rows; r++)
        dispersion_correction_kernels_ref.bwd[dt](ref + r * cols * es, g, x + r * 2 * cols * es, cols, 1, 1, 2, ALPHA);
    compare("bwd strided (broadcast grad)", dt, y, ref, n, 1);
    free(x), free(g), free(y), free(ref);
}

int main(void) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        for (size_t i = 0; i < sizeof SIZES / sizeof *SIZES; i++) {
            test_flat((opf_dtype)dt, SIZES[i], 0);
            test_flat((opf_dtype)dt, SIZES[i], 1);
        }
        test_strided((opf_dtype)dt, 3, 5);
        test_strided((opf_dtype)dt, 17, 300);
    }
    return check_report("test_dispersion_correction (CUDA, emulated)");
}
