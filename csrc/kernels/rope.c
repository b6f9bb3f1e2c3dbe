/*
 * Rotary position embedding: the scalar reference row kernels (the oracle,
 * kept forever), the ISA table, the position check and the driver. Formulas
 * in rope.h.
 */
#include <stddef.h>

#include "rope.h"

/* rot(x)[j] (forward) or the transpose's partner element and sign (inverse),
 * read from x (or g sin) at stride: the one rule both conventions follow is
 * "partner element, times +-1". */
static inline int64_t rope_partner(int64_t j, int64_t r, int interleaved) {
    if (interleaved) return j ^ 1;
    return j < r / 2 ? j + r / 2 : j - r / 2;
}

/* sign of rot(x)[j] = sign * x[partner]: -1 on the first of each pair (the
 * first half, or even j); the transpose flips it */
static inline int rope_sign(int64_t j, int64_t r, int interleaved, int inverse) {
    int first = interleaved ? (j & 1) == 0 : j < r / 2;
    return (first ? -1 : 1) * (inverse ? -1 : 1);
}

/* forward: out[j] = x[j] c[j] + sign x[p] s[j]; inverse: out[j] = x[j] c[j] + sign x[p] s[p] */
#define ROPE_REF(name, E, T, LD, ST)                                                                                  \
    static void rope_row_##name(void *out_, const void *x_, const void *cos_, const void *sin_, int64_t d, int64_t r, \
                                int64_t os, int64_t xs, int64_t cs, int64_t ss, int interleaved, int inverse) {       \
        E *out = out_;                                                                                                \
        const E *x = x_, *c = cos_, *s = sin_;                                                                        \
        for (int64_t j = 0; j < r; j++) {                                                                             \
            int64_t p = rope_partner(j, r, interleaved);                                                              \
            T sv = LD(s[(inverse ? p : j) * ss]);                                                                     \
            T rx = (T)rope_sign(j, r, interleaved, inverse) * LD(x[p * xs]);                                          \
            out[j * os] = ST(LD(x[j * xs]) * LD(c[j * cs]) + rx * sv);                                                \
        }                                                                                                             \
        for (int64_t j = r; j < d; j++) out[j * os] = x[j * xs];                                                      \
    }

#define ROPE_ID(v) (v)
ROPE_REF(f32, float, float, ROPE_ID, ROPE_ID)
ROPE_REF(f64, double, double, ROPE_ID, ROPE_ID)
ROPE_REF(bf16, uint16_t, float, opf_bf16_to_f32, opf_f32_to_bf16)
ROPE_REF(f16, uint16_t, float, opf_f16_to_f32, opf_f32_to_f16)

const rope_kernels rope_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .row = {[OPF_F32] = rope_row_f32, [OPF_F64] = rope_row_f64, [OPF_BF16] = rope_row_bf16, [OPF_F16] = rope_row_f16},
};

/* The ISA files are left out of builds for other architectures: weak references
 * resolve to NULL there and the choice falls back. */
extern const rope_kernels rope_kernels_avx2 __attribute__((weak));
extern const rope_kernels rope_kernels_avx512 __attribute__((weak));

const opf_variants rope_variants = OPF_VARIANTS("rope", &rope_kernels_ref, &rope_kernels_avx2, &rope_kernels_avx512);

const rope_kernels *rope_kernels_for(opf_isa isa) { return opf_variant_pick(&rope_variants, isa); }

int64_t rope_check_positions(const int64_t *pos, int64_t b, int64_t n, int64_t pb, int64_t pn, int64_t table_rows,
                             int64_t *bad) {
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < n; j++) {
            int64_t v = pos[i * pb + j * pn];
            if (v < 0 || v >= table_rows) {
                *bad = v;
                return i * n + j;
            }
        }
    return -1;
}

/* ---- driver ------------------------------------------------------------------- */

typedef struct rope_job {
    const rope_problem *p;
    rope_row_fn row;
    size_t es;
} rope_job;

static void rope_range(int64_t begin, int64_t end, void *ctx) {
    const rope_job *j = ctx;
    const rope_problem *p = j->p;
    const size_t es = j->es;
    for (int64_t bn = begin; bn < end; bn++) {
        const int64_t b = bn / p->n, n = bn % p->n;
        const char *c, *s;
        if (p->pos) {
            const int64_t row = p->pos[b * p->pb + n * p->pn];
            c = (const char *)p->cos + (size_t)(row * p->cn) * es;
            s = (const char *)p->sin + (size_t)(row * p->sn) * es;
        } else {
            c = (const char *)p->cos + (size_t)(b * p->cb + n * p->cn) * es;
            s = (const char *)p->sin + (size_t)(b * p->sb + n * p->sn) * es;
        }
        for (int64_t h = 0; h < p->hq; h++) {
            const char *x = (const char *)p->q + (size_t)(b * p->qs[0] + h * p->qs[1] + n * p->qs[2]) * es;
            char *o = (char *)p->oq + (size_t)(b * p->oqs[0] + h * p->oqs[1] + n * p->oqs[2]) * es;
            j->row(o, x, c, s, p->d, p->r, p->oqs[3], p->qs[3], p->cr, p->sr, p->interleaved, p->inverse);
        }
        for (int64_t h = 0; h < p->hk; h++) {
            const char *x = (const char *)p->k + (size_t)(b * p->ks[0] + h * p->ks[1] + n * p->ks[2]) * es;
            char *o = (char *)p->ok + (size_t)(b * p->oks[0] + h * p->oks[1] + n * p->oks[2]) * es;
            j->row(o, x, c, s, p->d, p->r, p->oks[3], p->ks[3], p->cr, p->sr, p->interleaved, p->inverse);
        }
    }
}

/* The table the rows run: the pick, or the reference where the pick hands rows to it (reported for the
 * log, once per call): float64, or a head or table row of a stride other than 1. The reference then runs
 * every row (not only the strided ones): every variant gives it the same bits. */
static const rope_kernels *runs(const rope_kernels *k, const rope_problem *p) {
    const int strided = (p->hq > 0 && (p->qs[3] != 1 || p->oqs[3] != 1)) ||
                        (p->hk > 0 && (p->ks[3] != 1 || p->oks[3] != 1)) || p->cr != 1 || p->sr != 1;
    return opf_variant_or_ref(&rope_variants, k, p->dt == OPF_F64 ? "float64" : strided ? "row stride != 1" : NULL);
}

void rope_run(const rope_kernels *k, const rope_problem *p) {
    rope_job j = {.p = p, .row = runs(k, p)->row[p->dt], .es = opf_dtype_size(p->dt)};
    const int64_t per = (p->hq + p->hk) * p->d; /* elements per position */
    opf_parallel_for(0, p->b * p->n, per > 0 ? 1 + 16384 / per : 1, rope_range, &j);
}
