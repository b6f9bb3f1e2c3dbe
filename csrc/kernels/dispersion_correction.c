/*
 * dispersion_correction: scalar reference kernels (the oracle, kept forever),
 * the ISA table and the whole-tensor drivers. Formulas in the header.
 */
#include <math.h>
#include <stddef.h>

#include "dispersion_correction.h"

/* One scalar loop per dtype; LD/ST convert to and from the compute type T. */
#define DC_REF(name, E, T, LD, ST, SQRT)                                                                       \
    static void dc_fwd_##name(void *y_, const void *x_, int64_t n, int64_t ys, int64_t xs, double alpha_) {    \
        E *y = y_;                                                                                             \
        const E *x = x_;                                                                                       \
        const T alpha = (T)alpha_;                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            T v = LD(x[i * xs]);                                                                               \
            y[i * ys] = ST(v * alpha + SQRT(v));                                                               \
        }                                                                                                      \
    }                                                                                                          \
    static void dc_bwd_##name(void *dx_, const void *dy_, const void *x_, int64_t n, int64_t dxs, int64_t dys, \
                              int64_t xs, double alpha_) {                                                     \
        E *dx = dx_;                                                                                           \
        const E *dy = dy_, *x = x_;                                                                            \
        const T alpha = (T)alpha_;                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            T g = LD(dy[i * dys]);                                                                             \
            dx[i * dxs] = ST(g * alpha + g / ((T)2 * SQRT(LD(x[i * xs]))));                                    \
        }                                                                                                      \
    }

#define DC_ID(v) (v)
DC_REF(f32, float, float, DC_ID, DC_ID, sqrtf)
DC_REF(f64, double, double, DC_ID, DC_ID, sqrt)
DC_REF(bf16, uint16_t, float, opf_bf16_to_f32, opf_f32_to_bf16, sqrtf)
DC_REF(f16, uint16_t, float, opf_f16_to_f32, opf_f32_to_f16, sqrtf)

const dc_kernels dc_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .fwd = {[OPF_F32] = dc_fwd_f32, [OPF_F64] = dc_fwd_f64, [OPF_BF16] = dc_fwd_bf16, [OPF_F16] = dc_fwd_f16},
    .bwd = {[OPF_F32] = dc_bwd_f32, [OPF_F64] = dc_bwd_f64, [OPF_BF16] = dc_bwd_bf16, [OPF_F16] = dc_bwd_f16},
};

/* The ISA files are left out of builds for other architectures: weak references
 * resolve to NULL there and the choice falls back. */
extern const dc_kernels dc_kernels_avx2 __attribute__((weak));
extern const dc_kernels dc_kernels_avx512 __attribute__((weak));

const opf_variants dc_variants =
    OPF_VARIANTS("dispersion_correction", &dc_kernels_ref, &dc_kernels_avx2, &dc_kernels_avx512);

const dc_kernels *dc_kernels_for(opf_isa isa) { return opf_variant_pick(&dc_variants, isa); }

/* ---- drivers ---------------------------------------------------------------- */

typedef struct dc_job {
    dc_fwd_fn fwd;
    dc_bwd_fn bwd;
    size_t es;
    char *out;
    const char *in1, *in2;
    double alpha;
} dc_job;

static void dc_segment(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const dc_job *j = ctx;
    if (j->fwd)
        j->fwd(j->out + off[0] * j->es, j->in1 + off[1] * j->es, n, st[0], st[1], j->alpha);
    else
        j->bwd(j->out + off[0] * j->es, j->in1 + off[1] * j->es, j->in2 + off[2] * j->es, n, st[0], st[1], st[2],
               j->alpha);
}

void dc_fwd(const dc_kernels *k, opf_dtype dt, const opf_nd *nd, void *y, const void *x, double alpha) {
    dc_job j = {.fwd = k->fwd[dt], .es = opf_dtype_size(dt), .out = y, .in1 = x, .alpha = alpha};
    opf_nd_parallel(nd, DC_GRAIN, dc_segment, &j);
}

void dc_bwd(const dc_kernels *k, opf_dtype dt, const opf_nd *nd, void *dx, const void *dy, const void *x,
            double alpha) {
    dc_job j = {.bwd = k->bwd[dt], .es = opf_dtype_size(dt), .out = dx, .in1 = dy, .in2 = x, .alpha = alpha};
    opf_nd_parallel(nd, DC_GRAIN, dc_segment, &j);
}
