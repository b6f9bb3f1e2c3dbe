/*
 * softmax / log_softmax: scalar reference kernels (the oracle, kept forever:
 * every dtype computed in double and rounded once), the ISA table and the
 * whole-tensor drivers. Formulas and the line-kernel contract in the header.
 */
#include <math.h>
#include <stddef.h>

#include "softmax.h"

#define SOFTMAX_REF(name, E, LD, ST)                                                                                \
    static void sm_fwd_##name(void *y_, const void *x_, int64_t n, int64_t w, int64_t ys, int64_t xs, int is_log) { \
        for (int64_t l = 0; l < w; l++) {                                                                           \
            E *y = (E *)y_ + l;                                                                                     \
            const E *x = (const E *)x_ + l;                                                                         \
            double m = -INFINITY, s = 0;                                                                            \
            for (int64_t k = 0; k < n; k++) {                                                                       \
                double v = LD(x[k * xs]);                                                                           \
                if (v > m || v != v) m = v; /* NaN stays: the row turns NaN, as torch's */                          \
                if (m != m) break;                                                                                  \
            }                                                                                                       \
            for (int64_t k = 0; k < n; k++) s += exp(LD(x[k * xs]) - m);                                            \
            if (is_log) {                                                                                           \
                double ls = m + log(s);                                                                             \
                for (int64_t k = 0; k < n; k++) y[k * ys] = ST(LD(x[k * xs]) - ls);                                 \
            } else {                                                                                                \
                for (int64_t k = 0; k < n; k++) y[k * ys] = ST(exp(LD(x[k * xs]) - m) / s);                         \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    static void sm_bwd_##name(void *dx_, const void *dy_, const void *y_, int64_t n, int64_t w, int64_t dxs,        \
                              int64_t dys, int64_t ys, int is_log) {                                                \
        for (int64_t l = 0; l < w; l++) {                                                                           \
            E *dx = (E *)dx_ + l;                                                                                   \
            const E *dy = (const E *)dy_ + l, *y = (const E *)y_ + l;                                               \
            double s = 0;                                                                                           \
            if (is_log) {                                                                                           \
                for (int64_t k = 0; k < n; k++) s += LD(dy[k * dys]);                                               \
                for (int64_t k = 0; k < n; k++) dx[k * dxs] = ST(LD(dy[k * dys]) - exp(LD(y[k * ys])) * s);         \
            } else {                                                                                                \
                for (int64_t k = 0; k < n; k++) s += LD(dy[k * dys]) * LD(y[k * ys]);                               \
                for (int64_t k = 0; k < n; k++) dx[k * dxs] = ST(LD(y[k * ys]) * (LD(dy[k * dys]) - s));            \
            }                                                                                                       \
        }                                                                                                           \
    }

#define SOFTMAX_ID(v) ((double)(v))
#define SOFTMAX_F32(v) ((float)(v))
#define SOFTMAX_TO_BF16(v) opf_f32_to_bf16((float)(v))
#define SOFTMAX_TO_F16(v) opf_f32_to_f16((float)(v))
SOFTMAX_REF(f32, float, SOFTMAX_ID, SOFTMAX_F32)
SOFTMAX_REF(f64, double, SOFTMAX_ID, SOFTMAX_ID)
SOFTMAX_REF(bf16, uint16_t, opf_bf16_to_f32, SOFTMAX_TO_BF16)
SOFTMAX_REF(f16, uint16_t, opf_f16_to_f32, SOFTMAX_TO_F16)

const softmax_kernels softmax_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .fwd = {[OPF_F32] = sm_fwd_f32, [OPF_F64] = sm_fwd_f64, [OPF_BF16] = sm_fwd_bf16, [OPF_F16] = sm_fwd_f16},
    .bwd = {[OPF_F32] = sm_bwd_f32, [OPF_F64] = sm_bwd_f64, [OPF_BF16] = sm_bwd_bf16, [OPF_F16] = sm_bwd_f16},
};

extern const softmax_kernels softmax_kernels_avx2 __attribute__((weak));
extern const softmax_kernels softmax_kernels_avx512 __attribute__((weak));

const opf_variants softmax_variants =
    OPF_VARIANTS("softmax", &softmax_kernels_ref, &softmax_kernels_avx2, &softmax_kernels_avx512);

const softmax_kernels *softmax_kernels_for(opf_isa isa) { return opf_variant_pick(&softmax_variants, isa); }

/* ---- drivers ---------------------------------------------------------------- */

/* The lines of a problem: the reduction axis (n, nstride), an optional lane
 * dim of unit stride cut into chunks of SOFTMAX_LANES, and the other dims
 * ("outer", walked by index). An item is one kernel call. */
typedef struct sm_job {
    const softmax_kernels *k;
    const softmax_problem *p;
    int nops, nouter;
    int64_t osize[OPF_MAX_DIMS], ostride[3][OPF_MAX_DIMS];
    int64_t n, nstride[3];
    int64_t lanes, chunks; /* lanes: size of the lane dim (1: none) */
    size_t es;
} sm_job;

static void sm_items(int64_t begin, int64_t end, void *ctx) {
    const sm_job *j = ctx;
    const softmax_problem *p = j->p;
    for (int64_t i = begin; i < end; i++) {
        int64_t o = i / j->chunks, c = i % j->chunks, off[3] = {0, 0, 0};
        for (int d = j->nouter - 1; d >= 0; d--) {
            int64_t idx = o % j->osize[d];
            o /= j->osize[d];
            for (int q = 0; q < j->nops; q++) off[q] += idx * j->ostride[q][d];
        }
        int64_t l0 = c * SOFTMAX_LANES, w = j->lanes - l0 < SOFTMAX_LANES ? j->lanes - l0 : SOFTMAX_LANES;
        for (int q = 0; q < j->nops; q++) off[q] += l0;
        char *out = (char *)p->out + off[0] * (int64_t)j->es;
        const char *in = (const char *)p->in + off[1] * (int64_t)j->es;
        if (j->nops == 2)
            j->k->fwd[p->dt](out, in, j->n, w, j->nstride[0], j->nstride[1], p->log);
        else
            j->k->bwd[p->dt](out, in, (const char *)p->y + off[2] * (int64_t)j->es, j->n, w, j->nstride[0],
                             j->nstride[1], j->nstride[2], p->log);
    }
}

static int unit_in_all(const softmax_problem *p, int nops, int d) {
    for (int q = 0; q < nops; q++)
        if (p->strides[q][d] != 1) return 0;
    return 1;
}

static void sm_run(const softmax_kernels *k, const softmax_problem *p, int nops) {
    sm_job j = {.k = k, .p = p, .nops = nops, .lanes = 1, .chunks = 1, .es = opf_dtype_size(p->dt)};
    int64_t numel = 1;
    for (int d = 0; d < p->ndim; d++) numel *= p->sizes[d];
    if (numel == 0) return;
    j.n = p->sizes[p->dim];
    for (int q = 0; q < nops; q++) j.nstride[q] = p->strides[q][p->dim];
    int lane = -1;
    if (!(j.n > 1 && unit_in_all(p, nops, p->dim)))
        for (int d = p->ndim - 1; d >= 0; d--)
            if (d != p->dim && p->sizes[d] > 1 && unit_in_all(p, nops, d)) {
                lane = d;
                break;
            }
    /* the reference where the pick would hand every line to it, reported for the log once per call */
    j.k = opf_variant_or_ref(&softmax_variants, k,
                             p->dt == OPF_F64                            ? "float64"
                             : lane < 0 && !unit_in_all(p, nops, p->dim) ? "reduction stride != 1"
                                                                         : NULL);
    if (lane >= 0) {
        j.lanes = p->sizes[lane];
        j.chunks = (j.lanes + SOFTMAX_LANES - 1) / SOFTMAX_LANES;
    }
    int64_t items = j.chunks;
    for (int d = 0; d < p->ndim; d++) {
        if (d == p->dim || d == lane || p->sizes[d] == 1) continue;
        j.osize[j.nouter] = p->sizes[d];
        for (int q = 0; q < nops; q++) j.ostride[q][j.nouter] = p->strides[q][d];
        j.nouter++;
        items *= p->sizes[d];
    }
    int64_t per_item = j.n * (j.lanes < SOFTMAX_LANES ? j.lanes : SOFTMAX_LANES);
    int64_t grain = SOFTMAX_GRAIN / (per_item > 0 ? per_item : 1);
    opf_parallel_for(0, items, grain > 1 ? grain : 1, sm_items, &j);
}

void softmax_fwd(const softmax_kernels *k, const softmax_problem *p) { sm_run(k, p, 2); }

void softmax_bwd(const softmax_kernels *k, const softmax_problem *p) { sm_run(k, p, 3); }
