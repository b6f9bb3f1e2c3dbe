/*
 * Normalisation: scalar reference row kernels (the oracle, kept forever), the
 * variant table and the whole-tensor drivers. Formulas in norm.h.
 */
#include <math.h>
#include <string.h>

#include "norm.h"

/* One set of row kernels per dtype: E the element, T the compute type, LD / ST
 * convert, RECOMPUTE (float64) recomputes rstd / mean from x in the backward. */
#define NORM_REF(name, E, T, LD, ST, SQRT, RECOMPUTE)                                                              \
    static void rms_fwd_##name(void *y_, void *s_, float *rstd, const void *x_, int64_t xcs, const void *r_,       \
                               int64_t rcs, const void *w_, int64_t wcs, int64_t n, double eps, int offset) {      \
        E *y = y_, *s = s_;                                                                                        \
        const E *x = x_, *r = r_, *w = w_;                                                                         \
        T ss = 0;                                                                                                  \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T v = LD(x[i * xcs]);                                                                                  \
            if (r) {                                                                                               \
                s[i] = ST(v + LD(r[i * rcs]));                                                                     \
                v = LD(s[i]);                                                                                      \
            }                                                                                                      \
            ss += v * v;                                                                                           \
        }                                                                                                          \
        const T rs = (T)1 / SQRT(ss / (T)n + (T)eps);                                                              \
        *rstd = (float)rs;                                                                                         \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T o = (r ? LD(s[i]) : LD(x[i * xcs])) * rs;                                                            \
            if (w) o *= offset ? (T)1 + LD(w[i * wcs]) : LD(w[i * wcs]);                                           \
            y[i] = ST(o);                                                                                          \
        }                                                                                                          \
    }                                                                                                              \
    static void rms_bwd_##name(void *dx_, void *dr_, void *dw_, const void *g_, int64_t gcs, const void *gs_,      \
                               int64_t gscs, const void *x_, int64_t xcs, float rstd, const void *w_, int64_t wcs, \
                               int64_t n, double eps, int offset) {                                                \
        E *dx = dx_, *dr = dr_;                                                                                    \
        T *dw = dw_;                                                                                               \
        const E *g = g_, *gs = gs_, *x = x_, *w = w_;                                                              \
        T rs = (T)rstd;                                                                                            \
        if (RECOMPUTE) {                                                                                           \
            T ss = 0;                                                                                              \
            for (int64_t i = 0; i < n; i++) ss += LD(x[i * xcs]) * LD(x[i * xcs]);                                 \
            rs = (T)1 / SQRT(ss / (T)n + (T)eps);                                                                  \
        }                                                                                                          \
        T dot = 0;                                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T we = w ? (offset ? (T)1 + LD(w[i * wcs]) : LD(w[i * wcs])) : (T)1;                                   \
            dot += LD(g[i * gcs]) * we * (LD(x[i * xcs]) * rs);                                                    \
        }                                                                                                          \
        const T c = dot / (T)n;                                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T we = w ? (offset ? (T)1 + LD(w[i * wcs]) : LD(w[i * wcs])) : (T)1;                                   \
            T gi = LD(g[i * gcs]), xh = LD(x[i * xcs]) * rs;                                                       \
            T d = rs * (gi * we - xh * c);                                                                         \
            if (gs) d += LD(gs[i * gscs]);                                                                         \
            dx[i] = ST(d);                                                                                         \
            if (dr) dr[i] = ST(d);                                                                                 \
            if (dw) dw[i] += gi * xh;                                                                              \
        }                                                                                                          \
    }                                                                                                              \
    static void ln_fwd_##name(void *y_, float *mean, float *rstd, const void *x_, int64_t xcs, const void *w_,     \
                              int64_t wcs, const void *b_, int64_t bcs, int64_t n, double eps) {                   \
        E *y = y_;                                                                                                 \
        const E *x = x_, *w = w_, *b = b_;                                                                         \
        T sum = 0, var = 0;                                                                                        \
        for (int64_t i = 0; i < n; i++) sum += LD(x[i * xcs]);                                                     \
        const T mu = sum / (T)n;                                                                                   \
        for (int64_t i = 0; i < n; i++) var += (LD(x[i * xcs]) - mu) * (LD(x[i * xcs]) - mu);                      \
        const T rs = (T)1 / SQRT(var / (T)n + (T)eps);                                                             \
        *mean = (float)mu, *rstd = (float)rs;                                                                      \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T o = (LD(x[i * xcs]) - mu) * rs;                                                                      \
            if (w) o *= LD(w[i * wcs]);                                                                            \
            if (b) o += LD(b[i * bcs]);                                                                            \
            y[i] = ST(o);                                                                                          \
        }                                                                                                          \
    }                                                                                                              \
    static void ln_bwd_##name(void *dx_, void *dw_, void *db_, const void *g_, int64_t gcs, const void *x_,        \
                              int64_t xcs, float mean, float rstd, const void *w_, int64_t wcs, int64_t n,         \
                              double eps) {                                                                        \
        E *dx = dx_;                                                                                               \
        T *dw = dw_, *db = db_;                                                                                    \
        const E *g = g_, *x = x_, *w = w_;                                                                         \
        T mu = (T)mean, rs = (T)rstd;                                                                              \
        if (RECOMPUTE) {                                                                                           \
            T sum = 0, var = 0;                                                                                    \
            for (int64_t i = 0; i < n; i++) sum += LD(x[i * xcs]);                                                 \
            mu = sum / (T)n;                                                                                       \
            for (int64_t i = 0; i < n; i++) var += (LD(x[i * xcs]) - mu) * (LD(x[i * xcs]) - mu);                  \
            rs = (T)1 / SQRT(var / (T)n + (T)eps);                                                                 \
        }                                                                                                          \
        T sg = 0, sgx = 0;                                                                                         \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T gw = LD(g[i * gcs]) * (w ? LD(w[i * wcs]) : (T)1);                                                   \
            sg += gw;                                                                                              \
            sgx += gw * ((LD(x[i * xcs]) - mu) * rs);                                                              \
        }                                                                                                          \
        const T a = sg / (T)n, c = sgx / (T)n;                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            T gi = LD(g[i * gcs]), xh = (LD(x[i * xcs]) - mu) * rs;                                                \
            dx[i] = ST(rs * (gi * (w ? LD(w[i * wcs]) : (T)1) - a - xh * c));                                      \
            if (dw) dw[i] += gi * xh;                                                                              \
            if (db) db[i] += gi;                                                                                   \
        }                                                                                                          \
    }

#define NORM_ID(v) (v)
NORM_REF(f32, float, float, NORM_ID, NORM_ID, sqrtf, 0)
NORM_REF(f64, double, double, NORM_ID, NORM_ID, sqrt, 1)
NORM_REF(bf16, uint16_t, float, opf_bf16_to_f32, opf_f32_to_bf16, sqrtf, 0)
NORM_REF(f16, uint16_t, float, opf_f16_to_f32, opf_f32_to_f16, sqrtf, 0)

#define NORM_TABLE(fn) \
    { [OPF_F32] = fn##_f32, [OPF_F64] = fn##_f64, [OPF_BF16] = fn##_bf16, [OPF_F16] = fn##_f16 }

const norm_kernels norm_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .rms_fwd = NORM_TABLE(rms_fwd),
    .rms_bwd = NORM_TABLE(rms_bwd),
    .ln_fwd = NORM_TABLE(ln_fwd),
    .ln_bwd = NORM_TABLE(ln_bwd),
};

/* The ISA files are left out of builds for other architectures: weak references
 * resolve to NULL there and the choice falls back. */
extern const norm_kernels norm_kernels_avx2 __attribute__((weak));
extern const norm_kernels norm_kernels_avx512 __attribute__((weak));

const opf_variants norm_variants = OPF_VARIANTS("norm", &norm_kernels_ref, &norm_kernels_avx2, &norm_kernels_avx512);

const norm_kernels *norm_kernels_for(opf_isa isa) { return opf_variant_pick(&norm_variants, isa); }

/* ---- drivers ------------------------------------------------------------------------ */

/* Element offset of row r of an operand with leading strides rs. */
static inline int64_t row_off(const norm_shape *sh, const int64_t *rs, int64_t r) {
    if (sh->nlead == 1) return r * rs[0];
    int64_t off = 0;
    for (int d = sh->nlead - 1; d >= 0; d--) {
        off += (r % sh->lead[d]) * rs[d];
        r /= sh->lead[d];
    }
    return off;
}

static inline const void *row_ptr(const norm_shape *sh, const norm_mat *m, int64_t r, size_t es) {
    return m && m->data ? (const char *)m->data + row_off(sh, m->rs, r) * (int64_t)es : NULL;
}

static inline int64_t cs_of(const norm_mat *m) { return m && m->data ? m->cs : 0; }

static inline const void *vec(const norm_mat *m) { return m && m->data ? m->data : NULL; }

typedef struct norm_job {
    const norm_kernels *k;
    const norm_shape *sh;
    size_t es, acc; /* element size; accumulator size (4, or 8 for float64) */
    char *y, *s;    /* row outputs: y and s (forward), dx and dres (backward) */
    void *dw, *db;  /* H-vectors of the backward, NULL where absent */
    float *mean, *rstd;
    const float *cmean, *crstd;
    const norm_mat *x, *res, *g, *gs, *w, *b;
    int layer; /* layer_norm's backward, else RMS */
    char *ws;  /* block slots: [block][H] for dw, then [block][H] for db */
    int64_t block, nblocks;
} norm_job;

static void rms_fwd_range(int64_t begin, int64_t end, void *ctx) {
    const norm_job *j = ctx;
    const norm_shape *sh = j->sh;
    const int64_t h = sh->hidden, es = (int64_t)j->es;
    norm_rms_fwd_fn fn = j->k->rms_fwd[sh->dt] ? j->k->rms_fwd[sh->dt] : norm_kernels_ref.rms_fwd[sh->dt];
    for (int64_t r = begin; r < end; r++)
        fn(j->y + r * h * es, j->s ? j->s + r * h * es : NULL, j->rstd + r, row_ptr(sh, j->x, r, j->es), j->x->cs,
           row_ptr(sh, j->res, r, j->es), cs_of(j->res), vec(j->w), cs_of(j->w), h, sh->eps, sh->offset);
}

static void ln_fwd_range(int64_t begin, int64_t end, void *ctx) {
    const norm_job *j = ctx;
    const norm_shape *sh = j->sh;
    const int64_t h = sh->hidden, es = (int64_t)j->es;
    norm_ln_fwd_fn fn = j->k->ln_fwd[sh->dt] ? j->k->ln_fwd[sh->dt] : norm_kernels_ref.ln_fwd[sh->dt];
    for (int64_t r = begin; r < end; r++)
        fn(j->y + r * h * es, j->mean + r, j->rstd + r, row_ptr(sh, j->x, r, j->es), j->x->cs, vec(j->w), cs_of(j->w),
           vec(j->b), cs_of(j->b), h, sh->eps);
}

/* The table a job runs: its pick, or the reference where the pick would hand every row to it (reported
 * for the log, once per call): float64 (the pick has no entry for the dtype: has_dt 0) or a hidden stride
 * other than 1 in an operand. */
static const norm_kernels *runs(const norm_job *j, int has_dt) {
    const norm_mat *const ops[] = {j->x, j->res, j->g, j->gs, j->w, j->b};
    const char *why = has_dt ? NULL : "float64";
    for (size_t i = 0; i < sizeof ops / sizeof ops[0] && !why; i++)
        if (ops[i] && ops[i]->data && ops[i]->cs != 1) why = "hidden stride != 1";
    return opf_variant_or_ref(&norm_variants, j->k, why);
}

static int64_t fwd_grain(const norm_shape *sh) {
    return sh->hidden > 0 && sh->hidden < NORM_GRAIN ? NORM_GRAIN / sh->hidden : 1;
}

void norm_rms_fwd(const norm_kernels *k, const norm_shape *sh, void *y, void *s, float *rstd, const norm_mat *x,
                  const norm_mat *res, const norm_mat *w) {
    norm_job j = {
        .k = k, .sh = sh, .es = opf_dtype_size(sh->dt), .y = y, .s = s, .rstd = rstd, .x = x, .res = res, .w = w};
    j.k = runs(&j, k->rms_fwd[sh->dt] != NULL);
    opf_parallel_for(0, sh->rows, fwd_grain(sh), rms_fwd_range, &j);
}

void norm_ln_fwd(const norm_kernels *k, const norm_shape *sh, void *y, float *mean, float *rstd, const norm_mat *x,
                 const norm_mat *w, const norm_mat *b) {
    norm_job j = {
        .k = k, .sh = sh, .es = opf_dtype_size(sh->dt), .y = y, .mean = mean, .rstd = rstd, .x = x, .w = w, .b = b};
    j.k = runs(&j, k->ln_fwd[sh->dt] != NULL);
    opf_parallel_for(0, sh->rows, fwd_grain(sh), ln_fwd_range, &j);
}

int64_t norm_bwd_block_rows(int64_t rows) {
    int64_t b = (rows + NORM_MAX_BLOCKS - 1) / NORM_MAX_BLOCKS;
    return b < NORM_BLOCK_MIN ? NORM_BLOCK_MIN : b;
}

static int64_t nblocks_of(int64_t rows) {
    int64_t b = norm_bwd_block_rows(rows);
    return (rows + b - 1) / b;
}

int64_t norm_bwd_workspace(const norm_shape *sh, int has_dw, int has_db) {
    int64_t per = sh->dt == OPF_F64 ? 2 : 1;
    return (int64_t)(has_dw + has_db) * nblocks_of(sh->rows) * sh->hidden * per;
}

/* Block blk's slot of accumulators for dw (which 0) or db (which 1). */
static char *slot(const norm_job *j, int which, int64_t blk) {
    int64_t slot_bytes = j->sh->hidden * (int64_t)j->acc;
    return j->ws + ((which && j->dw ? j->nblocks : 0) + blk) * slot_bytes;
}

/* Tasks are whole blocks of rows: each block's partial weight / bias gradients stay in its own slot. */
static void bwd_blocks(int64_t begin, int64_t end, void *ctx) {
    const norm_job *j = ctx;
    const norm_shape *sh = j->sh;
    const int64_t h = sh->hidden, es = (int64_t)j->es;
    norm_rms_bwd_fn rms = j->k->rms_bwd[sh->dt] ? j->k->rms_bwd[sh->dt] : norm_kernels_ref.rms_bwd[sh->dt];
    norm_ln_bwd_fn ln = j->k->ln_bwd[sh->dt] ? j->k->ln_bwd[sh->dt] : norm_kernels_ref.ln_bwd[sh->dt];
    for (int64_t blk = begin; blk < end; blk++) {
        char *dw = j->dw ? slot(j, 0, blk) : NULL, *db = j->db ? slot(j, 1, blk) : NULL;
        if (dw) memset(dw, 0, (size_t)(h * (int64_t)j->acc));
        if (db) memset(db, 0, (size_t)(h * (int64_t)j->acc));
        int64_t r0 = blk * j->block, r1 = r0 + j->block < sh->rows ? r0 + j->block : sh->rows;
        for (int64_t r = r0; r < r1; r++) {
            const void *g = row_ptr(sh, j->g, r, j->es), *x = row_ptr(sh, j->x, r, j->es);
            if (j->layer)
                ln(j->y + r * h * es, dw, db, g, j->g->cs, x, j->x->cs, j->cmean[r], j->crstd[r], vec(j->w),
                   cs_of(j->w), h, sh->eps);
            else
                rms(j->y + r * h * es, j->s ? j->s + r * h * es : NULL, dw, g, j->g->cs, row_ptr(sh, j->gs, r, j->es),
                    cs_of(j->gs), x, j->x->cs, j->crstd[r], vec(j->w), cs_of(j->w), h, sh->eps, sh->offset);
        }
    }
}

#define REDUCE_CHUNK 256

/* dw[c] (db[c]) = the sum over blocks, in block order, of the slots' column c, rounded once. */
static void reduce_cols(int64_t begin, int64_t end, void *ctx) {
    const norm_job *j = ctx;
    for (int which = 0; which < 2; which++) {
        void *out = which ? j->db : j->dw;
        if (!out) continue;
        if (j->sh->dt == OPF_F64) {
            for (int64_t c = begin; c < end; c++) {
                double t = 0;
                for (int64_t blk = 0; blk < j->nblocks; blk++) t += ((const double *)slot(j, which, blk))[c];
                ((double *)out)[c] = t;
            }
            continue;
        }
        /* columns in chunks, blocks outer: each column's sum in block order, the column loop vectorised */
        for (int64_t c0 = begin; c0 < end; c0 += REDUCE_CHUNK) {
            const int64_t nc = end - c0 < REDUCE_CHUNK ? end - c0 : REDUCE_CHUNK;
            float t[REDUCE_CHUNK] = {0};
            for (int64_t blk = 0; blk < j->nblocks; blk++) {
                const float *sl = (const float *)slot(j, which, blk) + c0;
                for (int64_t c = 0; c < nc; c++) t[c] += sl[c];
            }
            for (int64_t c = 0; c < nc; c++) opf_store_elem(out, c0 + c, j->sh->dt, t[c]);
        }
    }
}

static void run_bwd(norm_job *j) {
    const norm_shape *sh = j->sh;
    j->k = runs(j, j->layer ? j->k->ln_bwd[sh->dt] != NULL : j->k->rms_bwd[sh->dt] != NULL);
    j->es = opf_dtype_size(sh->dt);
    j->acc = sh->dt == OPF_F64 ? 8 : 4;
    if (j->dw || j->db) {
        j->block = norm_bwd_block_rows(sh->rows);
        j->nblocks = nblocks_of(sh->rows);
    } else { /* no slots: any split of the rows gives the same bits */
        j->block = fwd_grain(sh);
        j->nblocks = (sh->rows + j->block - 1) / j->block;
    }
    /* blocks per task: as many as make NORM_GRAIN elements (a small tensor runs on the calling thread) */
    int64_t per_block = j->block * (sh->hidden > 0 ? sh->hidden : 1);
    opf_parallel_for(0, j->nblocks, per_block < NORM_GRAIN ? NORM_GRAIN / per_block : 1, bwd_blocks, j);
    if (j->dw || j->db) opf_parallel_for(0, sh->hidden, 4096, reduce_cols, j);
}

void norm_rms_bwd(const norm_kernels *k, const norm_shape *sh, void *dx, void *dres, void *dw, const norm_mat *g,
                  const norm_mat *gs, const norm_mat *x, const float *rstd, const norm_mat *w, float *ws) {
    norm_job j = {.k = k,
                  .sh = sh,
                  .y = dx,
                  .s = dres,
                  .dw = dw,
                  .crstd = rstd,
                  .x = x,
                  .g = g,
                  .gs = gs,
                  .w = w,
                  .ws = (char *)ws};
    run_bwd(&j);
}

void norm_ln_bwd(const norm_kernels *k, const norm_shape *sh, void *dx, void *dw, void *db, const norm_mat *g,
                 const norm_mat *x, const float *mean, const float *rstd, const norm_mat *w, float *ws) {
    norm_job j = {.k = k,
                  .sh = sh,
                  .y = dx,
                  .dw = dw,
                  .db = db,
                  .cmean = mean,
                  .crstd = rstd,
                  .x = x,
                  .g = g,
                  .w = w,
                  .layer = 1,
                  .ws = (char *)ws};
    run_bwd(&j);
}
