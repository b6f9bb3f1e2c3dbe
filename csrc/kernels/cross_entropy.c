/*
 * cross_entropy: scalar reference row kernels (the oracle, kept forever:
 * every dtype computed in double), the ISA table and the whole-problem
 * drivers (rows split over opf_parallel_for, the reduction in fixed blocks).
 * Formulas in the header.
 */
#include <math.h>
#include <stddef.h>

#include "cross_entropy.h"

static inline double cross_entropy_cap(double v, double c) { return c > 0 ? c * tanh(v / c) : v; }

#define CROSS_ENTROPY_ID(v) ((double)(v))
#define CROSS_ENTROPY_F32(v) ((float)(v))
#define CROSS_ENTROPY_TO_BF16(v) opf_f32_to_bf16((float)(v))
#define CROSS_ENTROPY_TO_F16(v) opf_f32_to_f16((float)(v))

#define CROSS_ENTROPY_REF(name, E, LD, ST)                                                                       \
    static void cross_entropy_fwd_##name(const void *x_, int64_t C, int64_t xs, const void *w_, int64_t ws,      \
                                         double cap, double *lse, double *wz) {                                  \
        const E *x = x_, *w = w_;                                                                                \
        double m = -INFINITY, s = 0, t = 0;                                                                      \
        for (int64_t j = 0; j < C; j++) {                                                                        \
            double v = LD(x[j * xs]);                                                                            \
            if (v > m || v != v) m = v;                                                                          \
            if (m != m) break;                                                                                   \
        }                                                                                                        \
        m = cross_entropy_cap(m, cap); /* tanh is increasing: the max of z is the capped max of x */             \
        for (int64_t j = 0; j < C; j++) {                                                                        \
            double z = cross_entropy_cap(LD(x[j * xs]), cap);                                                    \
            s += exp(z - m);                                                                                     \
            if (wz) t += (w ? LD(w[j * ws]) : 1.0) * z;                                                          \
        }                                                                                                        \
        *lse = m + log(s);                                                                                       \
        if (wz) *wz = t;                                                                                         \
    }                                                                                                            \
    static void cross_entropy_bwd_##name(void *dx_, const void *x_, int64_t C, int64_t dxs, int64_t xs,          \
                                         const void *w_, int64_t ws, double cap, double lse, double a, double b, \
                                         int64_t t, double ct) {                                                 \
        E *dx = dx_;                                                                                             \
        const E *x = x_, *w = w_;                                                                                \
        const int zero = a == 0 && b == 0 && ct == 0;                                                            \
        for (int64_t j = 0; j < C; j++) {                                                                        \
            if (zero) {                                                                                          \
                dx[j * dxs] = ST(0.0);                                                                           \
                continue;                                                                                        \
            }                                                                                                    \
            double z = cross_entropy_cap(LD(x[j * xs]), cap);                                                    \
            double g = a * exp(z - lse) - b * (w ? LD(w[j * ws]) : 1.0) - (j == t ? ct : 0.0);                   \
            if (cap > 0) g *= 1.0 - (z / cap) * (z / cap);                                                       \
            dx[j * dxs] = ST(g);                                                                                 \
        }                                                                                                        \
    }

CROSS_ENTROPY_REF(f32, float, CROSS_ENTROPY_ID, CROSS_ENTROPY_F32)
CROSS_ENTROPY_REF(f64, double, CROSS_ENTROPY_ID, CROSS_ENTROPY_ID)
CROSS_ENTROPY_REF(bf16, uint16_t, opf_bf16_to_f32, CROSS_ENTROPY_TO_BF16)
CROSS_ENTROPY_REF(f16, uint16_t, opf_f16_to_f32, CROSS_ENTROPY_TO_F16)

const cross_entropy_kernels cross_entropy_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .fwd = {[OPF_F32] = cross_entropy_fwd_f32,
            [OPF_F64] = cross_entropy_fwd_f64,
            [OPF_BF16] = cross_entropy_fwd_bf16,
            [OPF_F16] = cross_entropy_fwd_f16},
    .bwd = {[OPF_F32] = cross_entropy_bwd_f32,
            [OPF_F64] = cross_entropy_bwd_f64,
            [OPF_BF16] = cross_entropy_bwd_bf16,
            [OPF_F16] = cross_entropy_bwd_f16},
};

extern const cross_entropy_kernels cross_entropy_kernels_avx2 __attribute__((weak));
extern const cross_entropy_kernels cross_entropy_kernels_avx512 __attribute__((weak));

const opf_variants cross_entropy_variants = OPF_VARIANTS("cross_entropy", &cross_entropy_kernels_ref,
                                                         &cross_entropy_kernels_avx2, &cross_entropy_kernels_avx512);

const cross_entropy_kernels *cross_entropy_kernels_for(opf_isa isa) {
    return opf_variant_pick(&cross_entropy_variants, isa);
}

/* ---- drivers ---------------------------------------------------------------- */

/* offset (in elements) of row i in a tensor of the lead dims with these strides */
static int64_t row_offset(const cross_entropy_problem *p, const int64_t *strides, int64_t i) {
    int64_t off = 0;
    for (int d = p->lead_ndim - 1; d >= 0; d--) {
        off += (i % p->lead_sizes[d]) * strides[d];
        i /= p->lead_sizes[d];
    }
    return off;
}

static const char *row_ptr(const cross_entropy_problem *p, int64_t i) {
    return (const char *)p->logits + row_offset(p, p->logits_strides, i) * (int64_t)opf_dtype_size(p->dt);
}

static int64_t row_target(const cross_entropy_problem *p, int64_t i) {
    return p->target[row_offset(p, p->target_strides, i)];
}

static double weight_of(const cross_entropy_problem *p, int64_t c) {
    return p->weight ? opf_load_elem(p->weight, c * p->weight_stride, p->dt) : 1.0;
}

/* sum_j w_j: C without weight */
static double weight_total(const cross_entropy_problem *p) {
    if (!p->weight) return (double)p->classes;
    double s = 0;
    for (int64_t c = 0; c < p->classes; c++) s += weight_of(p, c);
    return s;
}

int64_t cross_entropy_check_target(const cross_entropy_problem *p, int64_t *value) {
    for (int64_t i = 0; i < p->rows; i++) {
        int64_t t = row_target(p, i);
        if (t != p->ignore_index && (t < 0 || t >= p->classes)) {
            *value = t;
            return i;
        }
    }
    return -1;
}

int64_t cross_entropy_fwd_workspace(const cross_entropy_problem *p) {
    return 4 * ((p->rows + CROSS_ENTROPY_BLOCK - 1) / CROSS_ENTROPY_BLOCK);
}

typedef struct cross_entropy_job {
    const cross_entropy_kernels *k;
    const cross_entropy_problem *p;
    double wc, coef;  /* Wc; backward: grad_loss * (1/W or 1) */
    double *partials; /* forward: (loss sum, weight sum) per block */
} cross_entropy_job;

static void cross_entropy_fwd_blocks(int64_t b0, int64_t b1, void *ctx) {
    const cross_entropy_job *j = ctx;
    const cross_entropy_problem *p = j->p;
    const int64_t cs = p->logits_strides[p->lead_ndim];
    const double eps = p->label_smoothing, C = (double)p->classes;
    for (int64_t b = b0; b < b1; b++) {
        double lsum = 0, wsum = 0;
        int64_t end = (b + 1) * CROSS_ENTROPY_BLOCK < p->rows ? (b + 1) * CROSS_ENTROPY_BLOCK : p->rows;
        for (int64_t i = b * CROSS_ENTROPY_BLOCK; i < end; i++) {
            int64_t t = row_target(p, i);
            double loss = 0, lse = 0, wz = 0;
            if (t != p->ignore_index) {
                const char *x = row_ptr(p, i);
                j->k->fwd[p->dt](x, p->classes, cs, p->weight, p->weight_stride, p->softcap, &lse,
                                 eps > 0 ? &wz : NULL);
                double zt = cross_entropy_cap(opf_load_elem(x, t * cs, p->dt), p->softcap), wt = weight_of(p, t);
                loss = (1 - eps) * wt * (lse - zt);
                if (eps > 0) loss += eps / C * (lse * j->wc - wz);
                wsum += wt;
            }
            opf_store_elem(p->losses, i, p->dt, loss);
            p->lse[i] = lse;
            lsum += loss;
        }
        j->partials[2 * b] = lsum;
        j->partials[2 * b + 1] = wsum;
    }
}

/* The table the rows run: the pick, or the reference where the pick hands every row to it (reported for
 * the log, once per call): float64, or logits or weight of a stride other than 1 along the classes. */
static const cross_entropy_kernels *runs(const cross_entropy_kernels *k, const cross_entropy_problem *p) {
    const char *why = p->dt == OPF_F64                             ? "float64"
                      : p->logits_strides[p->lead_ndim] != 1       ? "class stride != 1"
                      : p->weight != NULL && p->weight_stride != 1 ? "weight stride != 1"
                                                                   : NULL;
    return opf_variant_or_ref(&cross_entropy_variants, k, why);
}

void cross_entropy_fwd(const cross_entropy_kernels *k, const cross_entropy_problem *p, float *ws) {
    cross_entropy_job j = {.k = runs(k, p), .p = p, .wc = weight_total(p), .partials = (double *)ws};
    int64_t blocks = (p->rows + CROSS_ENTROPY_BLOCK - 1) / CROSS_ENTROPY_BLOCK,
            per = CROSS_ENTROPY_BLOCK * (p->classes > 0 ? p->classes : 1);
    if (blocks > 0)
        opf_parallel_for(0, blocks, CROSS_ENTROPY_GRAIN / per > 1 ? CROSS_ENTROPY_GRAIN / per : 1,
                         cross_entropy_fwd_blocks, &j);
    double total = 0, wtotal = 0;
    for (int64_t b = 0; b < blocks; b++) total += j.partials[2 * b], wtotal += j.partials[2 * b + 1];
    opf_store_elem(p->loss, 0, p->dt, p->reduction == CROSS_ENTROPY_REDUCTION_MEAN ? total / wtotal : total);
}

static void cross_entropy_bwd_rows(int64_t i0, int64_t i1, void *ctx) {
    const cross_entropy_job *j = ctx;
    const cross_entropy_problem *p = j->p;
    const int64_t cs = p->logits_strides[p->lead_ndim], C = p->classes;
    const double eps = p->label_smoothing;
    for (int64_t i = i0; i < i1; i++) {
        int64_t t = row_target(p, i);
        char *dx = (char *)p->dlogits + i * C * (int64_t)opf_dtype_size(p->dt);
        double a = 0, b = 0, ct = 0;
        if (t != p->ignore_index) {
            double s = j->coef + opf_load_elem(p->grad_losses, row_offset(p, p->grad_losses_strides, i), p->dt);
            double wt = weight_of(p, t);
            a = s * ((1 - eps) * wt + eps / (double)C * j->wc);
            b = s * eps / (double)C;
            ct = s * (1 - eps) * wt;
        } else {
            t = -1;
        }
        j->k->bwd[p->dt](dx, row_ptr(p, i), C, 1, cs, p->weight, p->weight_stride, p->softcap,
                         opf_load_elem(p->lse_saved, i, p->lse_dt), a, b, t, ct);
    }
}

void cross_entropy_bwd(const cross_entropy_kernels *k, const cross_entropy_problem *p) {
    cross_entropy_job j = {.k = runs(k, p), .p = p, .wc = weight_total(p)};
    double g = opf_load_elem(p->grad_loss, 0, p->dt);
    if (p->reduction == CROSS_ENTROPY_REDUCTION_MEAN && g != 0) {
        double w = 0; /* block by block, as the forward adds it up: the same W */
        for (int64_t b = 0; b * CROSS_ENTROPY_BLOCK < p->rows; b++) {
            double wb = 0;
            for (int64_t i = b * CROSS_ENTROPY_BLOCK; i < p->rows && i < (b + 1) * CROSS_ENTROPY_BLOCK; i++) {
                int64_t t = row_target(p, i);
                if (t != p->ignore_index) wb += weight_of(p, t);
            }
            w += wb;
        }
        j.coef = g / w;
    } else {
        j.coef = g;
    }
    int64_t per = p->classes > 0 ? p->classes : 1;
    if (p->rows > 0)
        opf_parallel_for(0, p->rows, CROSS_ENTROPY_GRAIN / per > 1 ? CROSS_ENTROPY_GRAIN / per : 1,
                         cross_entropy_bwd_rows, &j);
}
