/*
 * dispersion_correction: scalar reference kernels (the oracle, kept forever),
 * the ISA table and the whole-tensor drivers. Formulas in the header.
 */
#include <math.h>
#include <stddef.h>

#include "dispersion_correction.h"

/* One scalar loop per dtype; LD/ST convert to and from the compute type T. */
#define DISPERSION_CORRECTION_REF(name, E, T, LD, ST, SQRT)                                                          \
    static void dispersion_correction_fwd_##name(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs,        \
                                                 double alpha_) {                                                    \
        E *y = y_;                                                                                                   \
        const E *x = x_;                                                                                             \
        const T alpha = (T)alpha_;                                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                                            \
            T v = LD(x[i * xs]);                                                                                     \
            y[i * ys] = ST(v * alpha + SQRT(v));                                                                     \
        }                                                                                                            \
    }                                                                                                                \
    static void dispersion_correction_bwd_##name(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs, \
                                                 int64_t dys, int64_t xs, double alpha_) {                           \
        E *dx = dx_;                                                                                                 \
        const E *dy = dy_, *x = x_;                                                                                  \
        const T alpha = (T)alpha_;                                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                                            \
            T g = LD(dy[i * dys]);                                                                                   \
            dx[i * dxs] = ST(g * alpha + g / ((T)2 * SQRT(LD(x[i * xs]))));                                          \
        }                                                                                                            \
    }

#define DISPERSION_CORRECTION_ID(v) (v)
DISPERSION_CORRECTION_REF(f32, float, float, DISPERSION_CORRECTION_ID, DISPERSION_CORRECTION_ID, sqrtf)
DISPERSION_CORRECTION_REF(f64, double, double, DISPERSION_CORRECTION_ID, DISPERSION_CORRECTION_ID, sqrt)
DISPERSION_CORRECTION_REF(bf16, uint16_t, float, opf_bf16_to_f32, opf_f32_to_bf16, sqrtf)
DISPERSION_CORRECTION_REF(f16, uint16_t, float, opf_f16_to_f32, opf_f32_to_f16, sqrtf)

const dispersion_correction_kernels dispersion_correction_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .fwd = {[OPF_F32] = dispersion_correction_fwd_f32,
            [OPF_F64] = dispersion_correction_fwd_f64,
            [OPF_BF16] = dispersion_correction_fwd_bf16,
            [OPF_F16] = dispersion_correction_fwd_f16},
    .bwd = {[OPF_F32] = dispersion_correction_bwd_f32,
            [OPF_F64] = dispersion_correction_bwd_f64,
            [OPF_BF16] = dispersion_correction_bwd_bf16,
            [OPF_F16] = dispersion_correction_bwd_f16},
};

/* The ISA files are left out of builds for other architectures: weak references
 * resolve to NULL there and the choice falls back. */
extern const dispersion_correction_kernels dispersion_correction_kernels_avx2 __attribute__((weak));
extern const dispersion_correction_kernels dispersion_correction_kernels_avx512 __attribute__((weak));

const opf_variants dispersion_correction_variants =
    OPF_VARIANTS("dispersion_correction", &dispersion_correction_kernels_ref, &dispersion_correction_kernels_avx2,
                 &dispersion_correction_kernels_avx512);

const dispersion_correction_kernels *dispersion_correction_kernels_for(opf_isa isa) {
    return opf_variant_pick(&dispersion_correction_variants, isa);
}

/* ---- drivers ---------------------------------------------------------------- */

typedef struct dispersion_correction_job {
    dispersion_correction_fwd_fn fwd;
    dispersion_correction_bwd_fn bwd;
    size_t es;
    char *out;
    const char *in1, *in2;
    double alpha;
} dispersion_correction_job;

static void dispersion_correction_segment(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const dispersion_correction_job *j = ctx;
    if (j->fwd)
        j->fwd(j->out + off[0] * j->es, j->in1 + off[1] * j->es, n, st[0], st[1], j->alpha);
    else
        j->bwd(j->out + off[0] * j->es, j->in1 + off[1] * j->es, j->in2 + off[2] * j->es, n, st[0], st[1], st[2],
               j->alpha);
}

/* The table the runs take: the pick, or the reference where the pick hands every run to it (reported for
 * the log, once per call): an operand of an inner stride other than 1 (operand 1 of the backward is the
 * gradient, stride 0 when it was broadcast, as the gradient of a sum is). */
static const dispersion_correction_kernels *runs(const dispersion_correction_kernels *k, const opf_nd *nd) {
    const char *why = NULL;
    for (int op = 0; op < nd->nops && !why; op++) {
        const int64_t s = nd->stride[op][nd->ndim - 1];
        why = s == 1 ? NULL : s == 0 && op == 1 && nd->nops == 3 ? "stride-0 gradient" : "inner stride != 1";
    }
    return opf_variant_or_ref(&dispersion_correction_variants, k, why);
}

void dispersion_correction_fwd(const dispersion_correction_kernels *k, opf_dtype dt, const opf_nd *nd, void *y,
                               const void *x, double alpha) {
    dispersion_correction_job j = {
        .fwd = runs(k, nd)->fwd[dt], .es = opf_dtype_size(dt), .out = y, .in1 = x, .alpha = alpha};
    opf_nd_parallel(nd, DISPERSION_CORRECTION_GRAIN, dispersion_correction_segment, &j);
}

void dispersion_correction_bwd(const dispersion_correction_kernels *k, opf_dtype dt, const opf_nd *nd, void *dx,
                               const void *dy, const void *x, double alpha) {
    dispersion_correction_job j = {
        .bwd = runs(k, nd)->bwd[dt], .es = opf_dtype_size(dt), .out = dx, .in1 = dy, .in2 = x, .alpha = alpha};
    opf_nd_parallel(nd, DISPERSION_CORRECTION_GRAIN, dispersion_correction_segment, &j);
}
