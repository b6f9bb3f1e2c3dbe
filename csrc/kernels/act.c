/*
 * Activations: the scalar and float64 definitions, the reference table and
 * the threaded gradient rows and column sums. Formulas in act.h.
 */
#include <math.h>

#include "act.h"

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_C 0.044715f

float act_f32(act_kind act, float x) {
    switch (act) {
    case ACT_RELU: return x < 0.0f ? 0.0f : x; /* NaN passes, as torch.relu */
    case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_C * x * x * x)));
    case ACT_SILU: return x / (1.0f + expf(-x));
    default: return x;
    }
}

float act_grad_f32(act_kind act, float x) {
    switch (act) {
    case ACT_RELU: return x <= 0.0f ? 0.0f : 1.0f; /* NaN passes the gradient, as torch's threshold_backward */
    case ACT_GELU: {
        float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        float pdf = expf(-0.5f * x * x) * 0.3989422804014327f;
        return cdf + x * pdf;
    }
    case ACT_GELU_TANH: {
        float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
    }
    case ACT_SILU: {
        float s = 1.0f / (1.0f + expf(-x));
        return s * (1.0f + x * (1.0f - s));
    }
    default: return 1.0f;
    }
}

double act_f64(act_kind act, double x) {
    switch (act) {
    case ACT_RELU: return x < 0.0 ? 0.0 : x;
    case ACT_GELU: return 0.5 * x * (1.0 + erf(x * 0.70710678118654752));
    case ACT_GELU_TANH: return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case ACT_SILU: return x / (1.0 + exp(-x));
    default: return x;
    }
}

double act_grad_f64(act_kind act, double x) {
    switch (act) {
    case ACT_RELU: return x <= 0.0 ? 0.0 : 1.0;
    case ACT_GELU: return 0.5 * (1.0 + erf(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.3989422804014327;
    case ACT_GELU_TANH: {
        double k = 0.7978845608028654, t = tanh(k * (x + 0.044715 * x * x * x));
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case ACT_SILU: {
        double s = 1.0 / (1.0 + exp(-x));
        return s * (1.0 + x * (1.0 - s));
    }
    default: return 1.0;
    }
}

static void act_grad_ref(float *out, const float *g, const float *pre, int64_t n, act_kind act) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] * act_grad_f32(act, pre[i]);
}

const act_kernels act_kernels_ref = {.name = "ref", .isa = OPF_ISA_REF, .grad = act_grad_ref};

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const act_kernels act_kernels_avx2 __attribute__((weak));

const opf_variants act_variants = OPF_VARIANTS("act", &act_kernels_ref, &act_kernels_avx2);

const act_kernels *act_kernels_for(opf_isa isa) { return opf_variant_pick(&act_variants, isa); }

/* ---- gradient rows and column sums ---------------------------------------------------------- */

typedef struct rows_job {
    const act_kernels *kern;
    const convert_kernels *cvt;
    opf_dtype dt;
    void *out;
    const void *g, *pre;
    int64_t rso, rsg, rsp, n;
    act_kind act;
    float *db;
    int beta;
    int64_t m;
} rows_job;

enum { BLOCK16 = 256 }; /* 16-bit rows are converted this many elements at a time */

/* rows [i0, i1) x columns [c0, c1) of g' = g * act'(pre); with job->db also
 * db[c] = sum over the rows of g' as stored (16-bit: the rounded values), in
 * row order as colsum_f32 sums */
static void act_grad_block(const rows_job *job, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const int64_t es = opf_dtype_size(job->dt);
    float *db = job->db;
    for (int64_t c = c0; db && c < c1; c++) db[c] = 0.0f;
    for (int64_t i = i0; i < i1; i++) {
        const char *g = (const char *)job->g + i * job->rsg * es, *pre = (const char *)job->pre + i * job->rsp * es;
        char *out = (char *)job->out + i * job->rso * es;
        if (job->dt == OPF_F32) {
            float *o = (float *)out;
            job->kern->grad(o + c0, (const float *)g + c0, (const float *)pre + c0, c1 - c0, job->act);
            for (int64_t c = c0; db && c < c1; c++) db[c] += o[c];
            continue;
        }
        float gb[BLOCK16], pb[BLOCK16];
        for (int64_t c = c0; c < c1; c += BLOCK16) {
            int64_t len = c1 - c < BLOCK16 ? c1 - c : BLOCK16;
            job->cvt->to_f32(gb, (const uint16_t *)g + c, job->dt, len);
            job->cvt->to_f32(pb, (const uint16_t *)pre + c, job->dt, len);
            job->kern->grad(gb, gb, pb, len, job->act);
            job->cvt->from_f32((uint16_t *)out + c, gb, job->dt, len);
            if (!db) continue;
            job->cvt->to_f32(gb, (const uint16_t *)out + c, job->dt, len);
            for (int64_t e = 0; e < len; e++) db[c + e] += gb[e];
        }
    }
}

static void act_grad_rows_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *job = ctx;
    act_grad_block(job, begin, end, 0, job->n);
}

static void act_grad_cols_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *job = ctx;
    act_grad_block(job, 0, job->m, begin, end);
}

void act_grad_rows(const act_kernels *kern, const convert_kernels *cvt, opf_dtype dt, void *out, int64_t rso,
                   const void *g, int64_t rsg, const void *pre, int64_t rsp, int64_t m, int64_t n, act_kind act,
                   float *db, int64_t threads) {
    rows_job job = {.kern = kern,
                    .cvt = cvt,
                    .dt = dt,
                    .out = out,
                    .g = g,
                    .pre = pre,
                    .rso = rso,
                    .rsg = rsg,
                    .rsp = rsp,
                    .n = n,
                    .act = act,
                    .db = db,
                    .m = m};
    if (db && n >= 256 * threads) { /* threads split the columns: each sums its own */
        opf_parallel_for(0, n, 256, act_grad_cols_range, &job);
        return;
    }
    job.db = NULL; /* too few columns for every thread: rows, then the sums */
    opf_parallel_for(0, m, n > 0 ? 1 + 32768 / n : 1, act_grad_rows_range, &job);
    if (db) colsum_f32(cvt, db, out, dt, rso, m, n, 0);
}

static void colsum_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *job = ctx;
    for (int64_t c = begin; c < end; c++) job->db[c] = job->beta ? job->db[c] : 0.0f;
    if (job->dt == OPF_F32) {
        const float *g = job->g;
        for (int64_t i = 0; i < job->m; i++) /* row by row: unit-stride reads of g */
            for (int64_t c = begin; c < end; c++) job->db[c] += g[i * job->rsg + c];
        return;
    }
    float row[BLOCK16];
    for (int64_t c0 = begin; c0 < end; c0 += BLOCK16) {
        int64_t len = end - c0 < BLOCK16 ? end - c0 : BLOCK16;
        for (int64_t i = 0; i < job->m; i++) {
            job->cvt->to_f32(row, (const uint16_t *)job->g + i * job->rsg + c0, job->dt, len);
            for (int64_t c = 0; c < len; c++) job->db[c0 + c] += row[c];
        }
    }
}

void colsum_f32(const convert_kernels *cvt, float *db, const void *g, opf_dtype dt, int64_t rsg, int64_t m, int64_t n,
                int beta) {
    rows_job job = {.cvt = cvt, .dt = dt, .g = g, .rsg = rsg, .m = m, .n = n, .db = db, .beta = beta};
    opf_parallel_for(0, n, 256, colsum_range, &job);
}
