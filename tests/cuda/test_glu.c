/*
 * The CUDA kernels of glu (csrc/cuda/glu.cu), run on the CPU over
 * tests/emu/cuda_emu.h, against the C reference kernels: every dtype and
 * activation, forward and backward, dense tensors around the vector packs
 * and the block (aligned: vector kernel; one element off: scalar kernel),
 * the packed (..., 2F) form split by chunk at row lengths from 1 to 8193
 * (vector rows when F is a whole number of packs, else scalar), outer dims
 * that do not merge, an inner stride of 2, a grad broadcast along rows (vector
 * and scalar), a transposed dense gate and strided outputs. Outputs are
 * checked past their end for stray writes. The emulated launch caps the grid
 * at a few blocks, so the grid-stride loop runs too.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/glu.h"
#include "../../csrc/kernels/glu.h"
#include "../c/check.h"

static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const act_kind ACTS[] = {ACT_GELU, ACT_GELU_TANH, ACT_SILU};
static const char *const ACT_NAME[] = {[ACT_GELU] = "gelu", [ACT_GELU_TANH] = "gelu_tanh", [ACT_SILU] = "silu"};
enum { PAD = 16 }; /* elements after each output, checked untouched */

typedef struct glu_case {
    const char *name;
    int ndim;
    int64_t sizes[3];
    int64_t os[3], gs[3], us[3], rs[3]; /* strides of out (dgate, dup), gate, up, grad */
    int64_t goff, uoff;                 /* gate and up in one input buffer at these element offsets */
    int64_t roff;                       /* grad's offset in its buffer */
    int want_vec;                       /* the kernel the launch should take (-1: not checked) */
} glu_case;

static int64_t span(int ndim, const int64_t *sizes, const int64_t *st) {
    int64_t s = 1;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] == 0) return 0;
        s += (sizes[d] - 1) * st[d];
    }
    return s;
}

static void fill(opf_dtype dt, void *p, int64_t n, double scale, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, (check_uniform(&seed) * 2.0 - 1.0) * scale);
}

/* offset of logical element i (row-major over sizes) under strides st */
static int64_t offset_of(int ndim, const int64_t *sizes, const int64_t *st, int64_t i) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        off += (i % sizes[d]) * st[d];
        i /= sizes[d];
    }
    return off;
}

/* within one rounding of the dtype, relative to the value's magnitude or 1 (the GPU's exp, erf and
 * tanh, and its contractions, round differently from the C library's) */
static int close_enough(opf_dtype dt, double a, double b) {
    const double tol = dt == OPF_F64 ? 1e-13 : dt == OPF_F32 ? 1e-6 : dt == OPF_BF16 ? 8e-3 : 1e-3;
    return fabs(a - b) <= tol * fmax(1.0, fabs(b));
}

static void compare(const glu_case *c, const char *what, opf_dtype dt, act_kind act, const char *got, const char *want,
                    int64_t n) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = offset_of(c->ndim, c->sizes, c->os, i);
        if (!close_enough(dt, opf_load_elem(got, o, dt), opf_load_elem(want, o, dt))) {
            if (first < 0) first = i;
            bad++;
        }
    }
    const int64_t fo = first >= 0 ? offset_of(c->ndim, c->sizes, c->os, first) : 0;
    CHECK(bad == 0, "%s %s %s %s n=%lld: %lld mismatches, first at %lld: got %.9g want %.9g", c->name, what,
          DT_NAME[dt], ACT_NAME[act], (long long)n, (long long)bad, (long long)first,
          first >= 0 ? opf_load_elem(got, fo, dt) : 0.0, first >= 0 ? opf_load_elem(want, fo, dt) : 0.0);
}

/* the PAD elements after an output's span still hold the sentinel 7 */
static void check_pad(const glu_case *c, const char *what, opf_dtype dt, const char *buf, int64_t n) {
    int bad = 0;
    for (int64_t i = n; i < n + PAD; i++) bad += opf_load_elem(buf, i, dt) != 7.0;
    CHECK(bad == 0, "%s %s %s: %d elements written past the output", c->name, what, DT_NAME[dt], bad);
}

static void run_case(const glu_case *c, opf_dtype dt, act_kind act) {
    const size_t es = opf_dtype_size(dt);
    int64_t n = 1;
    for (int d = 0; d < c->ndim; d++) n *= c->sizes[d];
    const int64_t on = span(c->ndim, c->sizes, c->os), gn = span(c->ndim, c->sizes, c->gs),
                  un = span(c->ndim, c->sizes, c->us), rn = span(c->ndim, c->sizes, c->rs);
    const int64_t inn = (c->goff + gn > c->uoff + un ? c->goff + gn : c->uoff + un) + 1, gradn = c->roff + rn + 1;
    char *in = malloc((size_t)inn * es), *grad = malloc((size_t)gradn * es);
    char *out[4], *ref[4]; /* out / dgate / dup and their references */
    for (int i = 0; i < 3; i++) {
        out[i] = malloc((size_t)(on + PAD) * es), ref[i] = malloc((size_t)(on + PAD) * es);
        for (int64_t e = 0; e < on + PAD; e++) opf_store_elem(out[i], e, dt, 7.0), opf_store_elem(ref[i], e, dt, 7.0);
    }
    fill(dt, in, inn, 4.0, 5 + (unsigned long long)n);
    fill(dt, grad, gradn, 2.0, 9 + (unsigned long long)n);
    char *gate = in + c->goff * es, *up = in + c->uoff * es, *g = grad + c->roff * es;

    opf_cuda_nd nd;
    const int64_t *s3[] = {c->os, c->gs, c->us}, *s4[] = {c->os, c->rs, c->gs, c->us};
    CHECK(opf_cuda_nd_make(&nd, c->ndim, c->sizes, 3, s3) == 0, "nd");
    const void *p3[] = {out[0], gate, up};
    if (c->want_vec >= 0 && n > 0)
        CHECK(glu_cuda_vector(dt, &nd, p3, 3) == c->want_vec, "%s %s: the %s kernel expected", c->name, DT_NAME[dt],
              c->want_vec ? "vector" : "scalar");
    unsigned grid = glu_cuda_fwd(dt, out[0], gate, up, &nd, act, NULL);
    CHECK((n == 0) == (grid == 0), "%s: blocks launched for n=%lld: %u", c->name, (long long)n, grid);
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = offset_of(c->ndim, c->sizes, c->os, i), gi = offset_of(c->ndim, c->sizes, c->gs, i),
                      ui = offset_of(c->ndim, c->sizes, c->us, i);
        glu_kernels_ref.fwd[dt](ref[0] + o * es, gate + gi * es, up + ui * es, 1, 1, 1, 1, act);
    }
    compare(c, "fwd", dt, act, out[0], ref[0], n);
    check_pad(c, "fwd", dt, out[0], on);

    CHECK(opf_cuda_nd_make(&nd, c->ndim, c->sizes, 4, s4) == 0, "nd");
    glu_cuda_bwd(dt, out[1], out[2], g, gate, up, &nd, act, NULL);
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = offset_of(c->ndim, c->sizes, c->os, i), gi = offset_of(c->ndim, c->sizes, c->gs, i),
                      ui = offset_of(c->ndim, c->sizes, c->us, i), ri = offset_of(c->ndim, c->sizes, c->rs, i);
        glu_kernels_ref.bwd[dt](ref[1] + o * es, ref[2] + o * es, g + ri * es, gate + gi * es, up + ui * es, 1, 1, 1, 1,
                                1, act);
    }
    compare(c, "bwd dgate", dt, act, out[1], ref[1], n);
    compare(c, "bwd dup", dt, act, out[2], ref[2], n);
    check_pad(c, "bwd dgate", dt, out[1], on);
    check_pad(c, "bwd dup", dt, out[2], on);
    for (int i = 0; i < 3; i++) free(out[i]), free(ref[i]);
    free(in), free(grad);
}

static void run_all_dtypes(const glu_case *c, int vec_when_f_packs, int64_t f) {
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        glu_case cc = *c;
        if (vec_when_f_packs) cc.want_vec = f % (16 / (int64_t)opf_dtype_size((opf_dtype)dt)) == 0;
        for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++) run_case(&cc, (opf_dtype)dt, ACTS[a]);
    }
}

/* one dense run: aligned (the vector kernel, partial last pack included) or one element off (scalar) */
static void test_flat(int64_t n, int misaligned) {
    glu_case c = {.name = misaligned ? "flat misaligned" : "flat",
                  .ndim = 1,
                  .sizes = {n},
                  .os = {1},
                  .gs = {1},
                  .us = {1},
                  .rs = {1},
                  .goff = misaligned,
                  .uoff = (n + 64) / 16 * 16 + misaligned,
                  .roff = misaligned,
                  .want_vec = !misaligned};
    run_all_dtypes(&c, 0, 0);
}

/* x (m, 2f) split by chunk: gate = x[:, :f], up = x[:, f:], out contiguous (m, f) */
static void test_packed(int64_t m, int64_t f) {
    glu_case c = {.name = "packed",
                  .ndim = 2,
                  .sizes = {m, f},
                  .os = {f, 1},
                  .gs = {2 * f, 1},
                  .us = {2 * f, 1},
                  .rs = {f, 1},
                  .goff = 0,
                  .uoff = f,
                  .roff = 0};
    run_all_dtypes(&c, 1, f);
}

/* gate = x[:, :3, :f], up = x[:, :3, f:] of an x (2, 4, 2f): two outer dims that do not merge */
static void test_outer_dims(int64_t f) {
    glu_case c = {.name = "outer dims",
                  .ndim = 3,
                  .sizes = {2, 3, f},
                  .os = {3 * f, f, 1},
                  .gs = {8 * f, 2 * f, 1},
                  .us = {8 * f, 2 * f, 1},
                  .rs = {3 * f, f, 1},
                  .goff = 0,
                  .uoff = f,
                  .roff = 0};
    run_all_dtypes(&c, 1, f);
}

/* gate every other element of its rows, up contiguous, grad one row broadcast (stride 0) */
static void test_inner_strided(void) {
    enum { M = 4, F = 37 };
    glu_case c = {.name = "inner stride 2",
                  .ndim = 2,
                  .sizes = {M, F},
                  .os = {F, 1},
                  .gs = {2 * F, 2},
                  .us = {F, 1},
                  .rs = {0, 1},
                  .goff = 0,
                  .uoff = 2 * M * F,
                  .roff = 0,
                  .want_vec = 0};
    run_all_dtypes(&c, 0, 0);
}

/* the packed form with grad one row broadcast (stride 0): still the vector kernel */
static void test_broadcast_grad(void) {
    enum { M = 5, F = 24 };
    glu_case c = {.name = "broadcast grad",
                  .ndim = 2,
                  .sizes = {M, F},
                  .os = {F, 1},
                  .gs = {2 * F, 1},
                  .us = {2 * F, 1},
                  .rs = {0, 1},
                  .goff = 0,
                  .uoff = F,
                  .roff = 0};
    run_all_dtypes(&c, 1, F);
}

/* gate a dense (f, m) tensor viewed as (m, f): out takes its strides (as opf_empty_like gives) */
static void test_transposed(void) {
    enum { M = 6, F = 9 };
    glu_case c = {.name = "transposed",
                  .ndim = 2,
                  .sizes = {M, F},
                  .os = {1, M},
                  .gs = {1, M},
                  .us = {F, 1},
                  .rs = {1, M},
                  .goff = 0,
                  .uoff = M * F,
                  .roff = 0,
                  .want_vec = 0};
    run_all_dtypes(&c, 0, 0);
}

/* outputs every other element of their rows (the launcher takes any output strides, though the glue
 * allocates dense ones) */
static void test_strided_out(void) {
    enum { M = 3, F = 16 };
    glu_case c = {.name = "strided out",
                  .ndim = 2,
                  .sizes = {M, F},
                  .os = {2 * F, 2},
                  .gs = {F, 1},
                  .us = {F, 1},
                  .rs = {F, 1},
                  .goff = 0,
                  .uoff = M * F,
                  .roff = 0,
                  .want_vec = 0};
    run_all_dtypes(&c, 0, 0);
}

int main(void) {
    static const int64_t SIZES[] = {0, 1, 7, 8, 9, 255, 256, 257, 2049, 70001};
    for (size_t i = 0; i < sizeof SIZES / sizeof *SIZES; i++) {
        test_flat(SIZES[i], 0);
        test_flat(SIZES[i], 1);
    }
    static const int64_t ROWS[] = {1, 3, 8, 31, 32, 33, 1000, 4096};
    for (size_t i = 0; i < sizeof ROWS / sizeof *ROWS; i++) test_packed(ROWS[i] >= 1000 ? 3 : 37, ROWS[i]);
    test_packed(2, 8193);
    test_packed(0, 64);
    test_outer_dims(40);
    test_outer_dims(33);
    test_inner_strided();
    test_broadcast_grad();
    test_transposed();
    test_strided_out();
    return check_report("test_glu (CUDA, emulated)");
}
