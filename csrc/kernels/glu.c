/*
 * Gated linear units: scalar reference kernels (the oracle, kept forever),
 * the ISA table and the whole-tensor drivers. Formulas in glu.h.
 */
#include <stddef.h>

#include "glu.h"

/* One scalar loop per dtype; LD/ST convert to and from the compute type T,
 * ACT/GRAD are act.h's scalar activation and derivative in T. */
#define GLU_REF(name, E, T, LD, ST, ACT, GRAD)                                                                    \
    static void glu_fwd_##name(void *out_, const void *gate_, const void *up_, int64_t n, int64_t os, int64_t gs, \
                               int64_t us, act_kind act) {                                                        \
        E *out = out_;                                                                                            \
        const E *gate = gate_, *up = up_;                                                                         \
        for (int64_t i = 0; i < n; i++) out[i * os] = ST(ACT(act, LD(gate[i * gs])) * LD(up[i * us]));            \
    }                                                                                                             \
    static void glu_bwd_##name(void *dgate_, void *dup_, const void *grad_, const void *gate_, const void *up_,   \
                               int64_t n, int64_t ds, int64_t rs, int64_t gs, int64_t us, act_kind act) {         \
        E *dgate = dgate_, *dup = dup_;                                                                           \
        const E *grad = grad_, *gate = gate_, *up = up_;                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                         \
            T g = LD(grad[i * rs]), x = LD(gate[i * gs]);                                                         \
            dgate[i * ds] = ST(g * LD(up[i * us]) * GRAD(act, x));                                                \
            dup[i * ds] = ST(g * ACT(act, x));                                                                    \
        }                                                                                                         \
    }

#define GLU_ID(v) (v)
GLU_REF(f32, float, float, GLU_ID, GLU_ID, act_f32, act_grad_f32)
GLU_REF(f64, double, double, GLU_ID, GLU_ID, act_f64, act_grad_f64)
GLU_REF(bf16, uint16_t, float, opf_bf16_to_f32, opf_f32_to_bf16, act_f32, act_grad_f32)
GLU_REF(f16, uint16_t, float, opf_f16_to_f32, opf_f32_to_f16, act_f32, act_grad_f32)

const glu_kernels glu_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .fwd = {[OPF_F32] = glu_fwd_f32, [OPF_F64] = glu_fwd_f64, [OPF_BF16] = glu_fwd_bf16, [OPF_F16] = glu_fwd_f16},
    .bwd = {[OPF_F32] = glu_bwd_f32, [OPF_F64] = glu_bwd_f64, [OPF_BF16] = glu_bwd_bf16, [OPF_F16] = glu_bwd_f16},
};

/* The ISA files are left out of builds for other architectures: weak references
 * resolve to NULL there and the choice falls back. */
extern const glu_kernels glu_kernels_avx2 __attribute__((weak));
extern const glu_kernels glu_kernels_avx512 __attribute__((weak));

const opf_variants glu_variants = OPF_VARIANTS("glu", &glu_kernels_ref, &glu_kernels_avx2, &glu_kernels_avx512);

const glu_kernels *glu_kernels_for(opf_isa isa) { return opf_variant_pick(&glu_variants, isa); }

/* ---- drivers ---------------------------------------------------------------- */

typedef struct glu_job {
    glu_fwd_fn fwd;
    glu_bwd_fn bwd;
    size_t es;
    char *out, *out2;
    const char *in1, *in2, *in3;
    act_kind act;
} glu_job;

/* The pick, or the reference for float64, which the picks hand to it (reported for the log, once per call). */
static const glu_kernels *runs(const glu_kernels *k, opf_dtype dt) {
    return opf_variant_or_ref(&glu_variants, k, dt == OPF_F64 ? "float64" : NULL);
}

static void glu_segment(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {
    const glu_job *j = ctx;
    const size_t es = j->es;
    if (j->fwd)
        j->fwd(j->out + off[0] * es, j->in1 + off[1] * es, j->in2 + off[2] * es, n, st[0], st[1], st[2], j->act);
    else
        j->bwd(j->out + off[0] * es, j->out2 + off[0] * es, j->in1 + off[1] * es, j->in2 + off[2] * es,
               j->in3 + off[3] * es, n, st[0], st[1], st[2], st[3], j->act);
}

void glu_fwd(const glu_kernels *k, opf_dtype dt, const opf_nd *nd, void *out, const void *gate, const void *up,
             act_kind act) {
    glu_job j = {.fwd = runs(k, dt)->fwd[dt], .es = opf_dtype_size(dt), .out = out, .in1 = gate, .in2 = up, .act = act};
    opf_nd_parallel(nd, GLU_GRAIN, glu_segment, &j);
}

void glu_bwd(const glu_kernels *k, opf_dtype dt, const opf_nd *nd, void *dgate, void *dup, const void *grad,
             const void *gate, const void *up, act_kind act) {
    glu_job j = {.bwd = runs(k, dt)->bwd[dt],
                 .es = opf_dtype_size(dt),
                 .out = dgate,
                 .out2 = dup,
                 .in1 = grad,
                 .in2 = gate,
                 .in3 = up,
                 .act = act};
    opf_nd_parallel(nd, GLU_GRAIN, glu_segment, &j);
}
