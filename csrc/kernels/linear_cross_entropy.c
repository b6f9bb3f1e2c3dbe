/*
 * Fused LM head + cross-entropy: the block plan, the workspace layout, both
 * sweeps, the scalar row code and the float64 reference. See
 * linear_cross_entropy.h.
 */
#include "linear_cross_entropy.h"

#include <math.h>
#include <string.h>

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx2 __attribute__((weak));
extern const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx512 __attribute__((weak));

const opf_variants linear_cross_entropy_variants =
    OPF_VARIANTS("linear_cross_entropy", &linear_cross_entropy_kernels_ref, &linear_cross_entropy_kernels_avx2,
                 &linear_cross_entropy_kernels_avx512);

/* Not noted for the log here: float64 runs the reference whatever the table, so linear_cross_entropy_run notes what runs. */
const linear_cross_entropy_kernels *linear_cross_entropy_kernels_for(opf_isa isa) {
    return opf_variant_best(&linear_cross_entropy_variants, isa);
}

static const void *at(const void *p, int64_t i, opf_dtype dt) {
    return (const char *)p + i * (int64_t)opf_dtype_size(dt);
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- scalar row code ---------------------------------------------------------------------------- */

static inline float capped(float u, float cap) { return cap > 0.0f ? cap * tanhf(u / cap) : u; }

/* Online log-sum-exp: the block's own max m and sum of exp(z - m), then merged
 * into the running pair so that neither sum ever sees a positive exponent. */
static void lse_update_ref(const float *u, int64_t n, float cap, float *max, float *sum, float *zsum) {
    float m = -INFINITY, zs = 0.0f, s = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        float z = capped(u[j], cap);
        m = fmaxf(m, z);
        zs += z;
    }
    *zsum += zs;
    if (m == -INFINITY) return; /* no finite logit: nothing to add */
    for (int64_t j = 0; j < n; j++) s += expf(capped(u[j], cap) - m);
    if (m > *max) {
        *sum = *sum * expf(*max - m) + s;
        *max = m;
    } else {
        *sum += s * expf(m - *max);
    }
}

static void grad_ref(float *u, int64_t n, float cap, float lse, float scale, float eps_v) {
    for (int64_t j = 0; j < n; j++) {
        float z = capped(u[j], cap), g = scale * (expf(z - lse) - eps_v);
        u[j] = cap > 0.0f ? g * (1.0f - (z / cap) * (z / cap)) : g;
    }
}

static float capped_ref(const float *u, int64_t n, int64_t j, float cap) {
    (void)n;
    return capped(u[j], cap);
}

const linear_cross_entropy_kernels linear_cross_entropy_kernels_ref = {
    .name = "ref", .isa = OPF_ISA_REF, .lse_update = lse_update_ref, .grad = grad_ref, .capped = capped_ref};

/* ---- plan and workspace --------------------------------------------------------------------------- */

int64_t linear_cross_entropy_bad_target(const linear_cross_entropy_problem *p) {
    for (int64_t t = 0; t < p->t; t++) {
        int64_t y = p->target[t * p->target_stride];
        if (y != p->ignore_index && (y < 0 || y >= p->v)) return t;
    }
    return -1;
}

static int wants_grad(const linear_cross_entropy_problem *p) { return p->dhidden || p->dweight || p->dbias; }

/* The logits block: vb vocabulary columns by tc tokens within budget floats; the whole vocabulary
 * where a chunk of LINEAR_CROSS_ENTROPY_CHUNK_TOKENS tokens (or all, if fewer) fits with it. */
static void block_shape(int64_t t, int64_t v, int64_t budget, int64_t *tc, int64_t *vb) {
    if (min64(max64(t, 1), LINEAR_CROSS_ENTROPY_CHUNK_TOKENS) * max64(v, 1) <= budget) {
        *vb = max64(v, 1);
        *tc = min64(max64(t, 1), budget / *vb);
        return;
    }
    *vb = min64(max64(v, 1), max64(16, budget / max64(1, min64(t, 2048))));
    *tc = min64(max64(t, 1), max64(1, budget / *vb));
}

/* a float32 forward that makes the gradients (LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX) */
static int f32_forward_grads(const linear_cross_entropy_problem *p) {
    return p->dt == OPF_F32 && !p->lse_given && !p->dlogits && wants_grad(p);
}

/* p->block_floats, or the default budget; a float32 forward that makes the gradients takes blocks up to the
 * weight's size (LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX) */
static int64_t block_budget(const linear_cross_entropy_problem *p) {
    if (p->block_floats > 0) return p->block_floats;
    if (f32_forward_grads(p))
        return max64(LINEAR_CROSS_ENTROPY_BLOCK_FLOATS, min64(p->v * p->h, LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX));
    return LINEAR_CROSS_ENTROPY_BLOCK_FLOATS;
}

int linear_cross_entropy_vocab_in_one_block(int64_t t, int64_t v) {
    int64_t tc, vb;
    block_shape(t, v, LINEAR_CROSS_ENTROPY_BLOCK_FLOATS, &tc, &vb);
    return vb >= v;
}

static void plan_layout(linear_cross_entropy_plan *l, const linear_cross_entropy_problem *p);

linear_cross_entropy_plan linear_cross_entropy_plan_make(const gemm_kernels *gemm,
                                                         const linear_cross_entropy_problem *p, int64_t threads) {
    linear_cross_entropy_plan l = {.gemm = gemm};
    if (p->dt == OPF_F64) { /* the reference: one row of doubles */
        l.floats = 2 * max64(p->v, 1);
        return l;
    }
    const int64_t budget = block_budget(p);
    const int grads = wants_grad(p);
    /* bfloat16 operands: the logits block is bfloat16 (the GEMM's result rounded once, as eager's
     * bfloat16 logits under autocast), and so is du, written over it by the row code, which both gradient
     * GEMMs read as it is (they would each round a float32 du to bfloat16 on the way in) */
    const int b16 = p->dt == OPF_BF16;
    const opf_dtype du_dt = b16 ? OPF_BF16 : OPF_F32;
    const int kept_bwd = p->dlogits && p->lse_given;
    block_shape(p->t, p->v, budget, &l.tc, &l.vb);
    /* a float32 forward that makes the gradients, its blocks spanning the vocabulary: a chunk of tokens as
     * deep as the GEMM's K slice, no deeper. Each chunk's dweight product adds into the sum over chunks, one
     * pass over dweight a chunk, and the GEMM makes one such pass a slice whatever the chunk; deeper chunks
     * only hold a larger block (vocabulary 32000 x hidden 2048: 250 MiB at 2048 tokens, 125 at 1024) */
    if (f32_forward_grads(p) && l.vb >= p->v)
        l.tc = min64(l.tc, max64(LINEAR_CROSS_ENTROPY_CHUNK_TOKENS, gemm_slice_depth(gemm, OPF_F32, OPF_F32)));
    if (kept_bwd) { /* du is all there: each gradient one whole product (the classes a provider claims) */
        l.tc = max64(p->t, 1);
        l.vb = max64(p->v, 1);
    }
    /* the GEMMs of the full and the last block each way: logits (tc, vb, H), dhidden (tc, H, vb), dweight (vb,
     * H, tc); a GEMM's workspace is not monotonic in the rows */
    for (int lt = 0; lt < 2; lt++) {
        const int64_t rows = lt ? p->t % l.tc : l.tc;
        for (int lv = 0; lv < 2; lv++) {
            const int64_t cols = lv ? p->v % l.vb : l.vb;
            l.logits[lt][lv] = gemm_plan_make(gemm, rows, cols, p->h, p->dt, p->dt, threads);
            l.dhidden[lt][lv] = gemm_plan_make(gemm, rows, p->h, cols, du_dt, p->dt, threads);
            l.dweight[lt][lv] = gemm_plan_make(gemm, cols, p->h, rows, du_dt, p->dt, threads);
            if (rows == 0 || rows > p->t || cols == 0 || cols > p->v) continue; /* no such block */
            int64_t need[3] = {gemm_workspace(&l.logits[lt][lv]), grads ? gemm_workspace(&l.dhidden[lt][lv]) : 0,
                               grads ? gemm_workspace(&l.dweight[lt][lv]) : 0};
            for (int g = 0; g < 3; g++) l.gemm_floats = max64(l.gemm_floats, need[g]);
        }
    }
    plan_layout(&l, p);
    return l;
}

/* The workspace after the GEMMs' packing (l->gemm_floats): the logits block, sweep 1's per-token sums,
 * the float32 bias and the 16-bit gradients' float32 scratch (none that a claimed plan's products write
 * themselves) */
static void plan_layout(linear_cross_entropy_plan *l, const linear_cross_entropy_problem *p) {
    const gemm_kernels *gemm = l->gemm;
    const int half = p->grads_dt == OPF_BF16 || p->grads_dt == OPF_F16, b16 = p->dt == OPF_BF16;
    const opf_dtype du_dt = b16 ? OPF_BF16 : OPF_F32;
    const int kept_bwd = p->dlogits && p->lse_given;
    l->block = l->gemm_floats;
    /* float32 logits; with a bfloat16 block, the GEMM's partial sums only where H spans several K slices;
     * none where float32 logits go straight into a kept du, or a backward reads the kept du (no block) */
    const int64_t c32 = kept_bwd || (p->dlogits && !b16)                      ? 0
                        : !b16 || p->h > gemm_slice_depth(gemm, p->dt, p->dt) ? l->tc * l->vb
                                                                              : 0;
    l->max = l->block + c32;
    l->sum = l->max + p->t;
    l->zsum = l->sum + p->t;
    l->zy = l->zsum + p->t;
    l->bias = l->zy + p->t;
    l->dh = l->bias + (p->bias ? p->v : 0);
    /* dhidden: the float32 sum over vocab blocks, or with one block (run_f32's dh_direct) the GEMM's partial
     * sums where the vocabulary spans several K slices */
    l->dh_direct = half && l->vb >= p->v && p->v > 0;
    const int64_t depth = gemm_slice_depth(gemm, du_dt, p->dt); /* of both gradient GEMMs (du, operands) */
    l->dw = l->dh + (half && p->dhidden && !l->claimed && !(l->dh_direct && p->v <= depth) ? p->t * p->h : 0);
    /* a float32 dweight block: the sum over token chunks, or with one chunk (run_f32's dw_direct) the GEMM's
     * partial sums where the tokens span several K slices; none where they fit one */
    l->dw_direct = half && l->tc >= p->t && p->t > 0;
    l->db = l->dw + (half && p->dweight && !l->claimed && !(l->dw_direct && p->t <= depth) ? l->vb * p->h : 0);
    l->block16 = l->db + (half && p->dbias ? p->v : 0);
    l->floats = l->block16 + (b16 && !kept_bwd ? (l->tc * l->vb + 1) / 2 : 0); /* 2-byte elements */
}

/* any non-NULL pointer: a claim reads which of the epilogue's pointers are set, never their data */
static const float claim_mark;

void linear_cross_entropy_plan_claim(linear_cross_entropy_plan *l, const linear_cross_entropy_problem *p) {
    if (!p->dlogits || !p->lse_given || p->dt == OPF_F64 || p->t <= 0 || p->v <= 0 || p->h <= 0) return;
    const int half = p->grads_dt == OPF_BF16 || p->grads_dt == OPF_F16;
    /* as run_f32 runs them: du (T, V) row-major, 16-bit results rounded straight into the gradients */
    const gemm_epilogue ep = {.out16 = half ? (void *)&claim_mark : NULL, .out_dt = p->grads_dt};
    if (p->dhidden &&
        !gemm_provider_claims(&l->dhidden[0][0], p->v, 1, p->weight_strides[0], p->weight_strides[1], &ep))
        return;
    if (p->dweight &&
        !gemm_provider_claims(&l->dweight[0][0], 1, p->v, p->hidden_strides[0], p->hidden_strides[1], &ep))
        return;
    l->claimed = 1;
    l->gemm_floats = 0;
    plan_layout(l, p);
}

int64_t linear_cross_entropy_workspace(const linear_cross_entropy_plan *plan) { return plan->floats; }

/* ---- the sweeps --------------------------------------------------------------------------------- */

typedef struct linear_cross_entropy_job {
    const linear_cross_entropy_kernels *kern;
    const linear_cross_entropy_problem *p;
    const linear_cross_entropy_plan *l;
    float *ws, *block;          /* block: float32 logits, or (with block16) the GEMM's partial sums or NULL */
    uint16_t *block16;          /* bfloat16 operands: the logits (rows, cols), then du over them; else NULL */
    int64_t t0, v0, rows, cols; /* the block: tokens [t0, t0 + rows), vocab [v0, v0 + cols) */
    int64_t rs;                 /* the block's row stride: cols, or V where it lies in the kept du */
    uint16_t *kept16;           /* bfloat16 logits kept: the block's place in dlogits (row stride V), or NULL */
    double base;                /* the gradient of each token's loss before grad: 1/N (mean) or 1 */
    float cap, eps_v, one_eps;
} linear_cross_entropy_job;

static int ignored(const linear_cross_entropy_problem *p, int64_t t) {
    return p->target[t * p->target_stride] == p->ignore_index;
}

/* a bfloat16 block's rows are taken a segment at a time through float32 on the stack */
enum { SEGMENT = 1024 };

/* sweep 1, rows [r0, r1) of the block */
static void lse_rows(int64_t r0, int64_t r1, void *ctx) {
    const linear_cross_entropy_job *job = ctx;
    const linear_cross_entropy_problem *p = job->p;
    float *mx = job->ws + job->l->max, *sm = job->ws + job->l->sum, *zs = job->ws + job->l->zsum;
    float *zy = job->ws + job->l->zy;
    float seg[SEGMENT];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = job->t0 + r;
        const int64_t y = ignored(p, t) ? -1 : p->target[t * p->target_stride] - job->v0;
        if (!job->block16) {
            const float *u = job->block + r * job->rs;
            job->kern->lse_update(u, job->cols, job->cap, mx + t, sm + t, zs + t);
            if (y >= 0 && y < job->cols) zy[t] = job->kern->capped(u, job->cols, y, job->cap);
            continue;
        }
        for (int64_t s0 = 0; s0 < job->cols; s0 += SEGMENT) { /* the online update folds a row in pieces */
            const int64_t n = min64(SEGMENT, job->cols - s0);
            job->l->gemm->cvt->to_f32(seg, job->block16 + r * job->cols + s0, OPF_BF16, n);
            job->kern->lse_update(seg, n, job->cap, mx + t, sm + t, zs + t);
            if (y >= s0 && y < s0 + n) zy[t] = job->kern->capped(seg, n, y - s0, job->cap);
        }
        if (job->kept16) memcpy(job->kept16 + r * p->v, job->block16 + r * job->cols, (size_t)job->cols * 2);
    }
}

/* the gradient of token t's loss */
static double token_scale(const linear_cross_entropy_job *job, int64_t t) {
    const linear_cross_entropy_problem *p = job->p;
    if (ignored(p, t)) return 0.0;
    if (!p->grad) return job->base;
    return job->base *
           opf_load_elem(p->grad, p->reduction == LINEAR_CROSS_ENTROPY_NONE ? t * p->grad_stride : 0, p->loss_dt);
}

/* sweep 2, rows [r0, r1) of the block: logits -> du in place */
static void grad_rows(int64_t r0, int64_t r1, void *ctx) {
    const linear_cross_entropy_job *job = ctx;
    const linear_cross_entropy_problem *p = job->p;
    const convert_kernels *cvt = job->l->gemm->cvt;
    float seg[SEGMENT];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = job->t0 + r;
        float *u = job->block16 ? NULL : job->block + r * job->rs;
        uint16_t *u16 = job->block16 ? job->block16 + r * job->rs : NULL;
        const float scale = (float)token_scale(job, t);
        if (scale == 0.0f) { /* ignored (or a zero gradient): no contribution, whatever the logits */
            if (u) memset(u, 0, (size_t)job->cols * sizeof(float));
            if (u16) memset(u16, 0, (size_t)job->cols * sizeof(uint16_t));
            continue;
        }
        int64_t y = p->target[t * p->target_stride] - job->v0;
        float dy = 0.0f; /* the target's -(1 - eps) term, times the cap's derivative at its logit */
        if (y >= 0 && y < job->cols) {
            const float uy = u16 ? opf_bf16_to_f32(u16[y]) : 0.0f;
            float z = u ? job->kern->capped(u, job->cols, y, job->cap) : job->kern->capped(&uy, 1, 0, job->cap);
            dy = scale * job->one_eps * (job->cap > 0.0f ? 1.0f - (z / job->cap) * (z / job->cap) : 1.0f);
        }
        if (u) {
            job->kern->grad(u, job->cols, job->cap, p->lse[t], scale, job->eps_v);
            if (y >= 0 && y < job->cols) u[y] -= dy;
            continue;
        }
        for (int64_t s0 = 0; s0 < job->cols; s0 += SEGMENT) {
            const int64_t n = min64(SEGMENT, job->cols - s0);
            cvt->to_f32(seg, u16 + s0, OPF_BF16, n);
            job->kern->grad(seg, n, job->cap, p->lse[t], scale, job->eps_v);
            if (y >= s0 && y < s0 + n) seg[y - s0] -= dy;
            cvt->from_f32(u16 + s0, seg, OPF_BF16, n);
        }
    }
}

/* rows per parallel task: a few thousand logits each */
static int64_t row_grain(int64_t cols) { return max64(1, 4096 / max64(cols, 1)); }

/* the logits block (rows, cols) = hidden[t0..] . weight[v0..]^T + bias, into job->block */
static int logits_block(const linear_cross_entropy_job *job, float *ws) {
    const linear_cross_entropy_problem *p = job->p;
    const opf_dtype dt = p->dt;
    gemm_epilogue ep = {.bias = p->bias ? ws + job->l->bias + job->v0 : NULL,
                        .bias_kind = p->bias ? GEMM_BIAS_ROW : GEMM_BIAS_NONE,
                        .out16 = job->block16,
                        .out_dt = OPF_BF16};
    return gemm_run(&job->l->logits[job->rows < job->l->tc][job->cols < job->l->vb],
                    at(p->hidden, job->t0 * p->hidden_strides[0], dt), p->hidden_strides[0], p->hidden_strides[1],
                    at(p->weight, job->v0 * p->weight_strides[0], dt), p->weight_strides[1], p->weight_strides[0],
                    job->block, job->rs, &ep, ws, job->l->gemm_floats);
}

/* A gradient GEMM: the provider's with no workspace where the plan is claimed (declined after all:
 * LINEAR_CROSS_ENTROPY_ERR_DECLINED, the caller runs the problem again unclaimed), else gemm_run */
static int grad_gemm(const linear_cross_entropy_plan *l, const gemm_plan *g, const void *a, int64_t rsa, int64_t csa,
                     const void *b, int64_t rsb, int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep,
                     float *ws) {
    if (l->claimed)
        return gemm_run_claimed(g, a, rsa, csa, b, rsb, csb, c, rsc, ep, 0) == 0 ? 0
                                                                                 : LINEAR_CROSS_ENTROPY_ERR_DECLINED;
    return gemm_run(g, a, rsa, csa, b, rsb, csb, c, rsc, ep, ws, l->gemm_floats) == 0
               ? 0
               : LINEAR_CROSS_ENTROPY_ERR_WORKSPACE;
}

#define TRY(call)                                                   \
    do {                                                            \
        if ((call) != 0) return LINEAR_CROSS_ENTROPY_ERR_WORKSPACE; \
    } while (0)

/* lse of token t from sweep 1's running max and sum: the one formula store_loss and chunk_lse use */
static double token_lse(const linear_cross_entropy_job *job, int64_t t) {
    return (double)job->ws[job->l->max + t] + log((double)job->ws[job->l->sum + t]);
}

/* The lse of the job's chunk of tokens, for sweep 2 in the same pass (store_loss writes the same values) */
static void chunk_lse(const linear_cross_entropy_problem *p, const linear_cross_entropy_job *job) {
    for (int64_t t = job->t0; t < job->t0 + job->rows; t++) p->lse[t] = (float)token_lse(job, t);
}

static void store_loss(const linear_cross_entropy_problem *p, const linear_cross_entropy_job *job) {
    const float *zs = job->ws + job->l->zsum, *zy = job->ws + job->l->zy;
    const double eps = p->label_smoothing;
    double total = 0.0; /* in token order: the same sum at any thread count */
    int64_t count = 0;
    for (int64_t t = 0; t < p->t; t++) {
        double lse = token_lse(job, t);
        p->lse[t] = (float)lse;
        double loss = 0.0;
        if (!ignored(p, t)) { /* torch's form, term by term (linear_cross_entropy.h) */
            loss = (1.0 - eps) * (lse - zy[t]);
            if (eps > 0.0) loss += eps * (lse - zs[t] / (double)p->v);
            count++;
        }
        if (p->reduction == LINEAR_CROSS_ENTROPY_NONE)
            opf_store_elem(p->loss, t, p->loss_dt, loss);
        else
            total += loss;
    }
    if (p->reduction == LINEAR_CROSS_ENTROPY_SUM) opf_store_elem(p->loss, 0, p->loss_dt, total);
    if (p->reduction == LINEAR_CROSS_ENTROPY_MEAN)
        opf_store_elem(p->loss, 0, p->loss_dt, total / (double)count); /* 0/0: NaN, as torch */
}

static int64_t valid_tokens(const linear_cross_entropy_problem *p) {
    int64_t count = 0;
    for (int64_t t = 0; t < p->t; t++) count += !ignored(p, t);
    return count;
}

static int run_f32(const linear_cross_entropy_kernels *kern, const linear_cross_entropy_plan *l,
                   const linear_cross_entropy_problem *p, float *ws) {
    const gemm_kernels *gemm = l->gemm;
    const opf_dtype dt = p->dt, gdt = p->grads_dt;
    const int half = gdt != OPF_F32; /* the gradients accumulate in float32 scratch */
    linear_cross_entropy_job job = {.kern = kern,
                                    .p = p,
                                    .l = l,
                                    .ws = ws,
                                    .block = l->max > l->block ? ws + l->block : NULL,
                                    .block16 = l->floats > l->block16 ? (uint16_t *)(ws + l->block16) : NULL,
                                    .cap = (float)p->softcap,
                                    .eps_v = p->v > 0 ? (float)(p->label_smoothing / (double)p->v) : 0.0f,
                                    .one_eps = (float)(1.0 - p->label_smoothing)};
    if (p->bias) convert_load_f32(gemm->cvt, ws + l->bias, p->bias, dt, p->v, p->bias_stride);
    const int64_t ntc = (p->t + l->tc - 1) / l->tc, nvb = (p->v + l->vb - 1) / l->vb;
    /* du kept: made here (forward) or read (backward); of dt's element size (float32 or bfloat16) */
    const int kept_fwd = p->dlogits && !p->lse_given, kept_bwd = p->dlogits && p->lse_given;
    const opf_dtype du_dt = dt == OPF_BF16 ? OPF_BF16 : OPF_F32;
    /* blocks that span the vocabulary, in a forward asked for the gradients: both sweeps a chunk at a time */
    const int fused = !p->lse_given && wants_grad(p) && nvb == 1;
    if (!p->lse_given) { /* sweep 1: lse and the loss */
        for (int64_t t = 0; t < p->t; t++) ws[l->max + t] = -INFINITY, ws[l->sum + t] = 0.0f;
        memset(ws + l->zsum, 0, (size_t)(2 * p->t) * sizeof(float));
    }
    if (!p->lse_given && !fused) {
        for (int64_t b = 0; b < ntc * nvb; b++) {
            job.t0 = b / nvb * l->tc, job.v0 = b % nvb * l->vb;
            job.rows = min64(l->tc, p->t - job.t0), job.cols = min64(l->vb, p->v - job.v0), job.rs = job.cols;
            if (kept_fwd && job.block16) /* lse_rows copies each bfloat16 row there */
                job.kept16 = (uint16_t *)p->dlogits + job.t0 * p->v + job.v0;
            else if (kept_fwd) /* float32 logits straight into their place */
                job.block = (float *)p->dlogits + job.t0 * p->v + job.v0, job.rs = p->v;
            TRY(logits_block(&job, ws));
            opf_parallel_for(0, job.rows, row_grain(job.cols), lse_rows, &job);
        }
        job.kept16 = NULL;
        store_loss(p, &job);
    }
    if (kept_fwd) { /* every lse final: du of the whole (T, V) in place, for a loss gradient of 1 */
        job.base = p->reduction == LINEAR_CROSS_ENTROPY_MEAN ? 1.0 / (double)valid_tokens(p) : 1.0;
        job.t0 = job.v0 = 0, job.rows = p->t, job.cols = job.rs = p->v;
        job.block = du_dt == OPF_F32 ? p->dlogits : NULL;
        job.block16 = du_dt == OPF_BF16 ? p->dlogits : NULL;
        opf_parallel_for(0, p->t, row_grain(p->v), grad_rows, &job);
        return 0;
    }
    if (!wants_grad(p)) return 0;
    /* sweep 2: the gradients, vocab blocks outer, token chunks inner */
    job.base = p->reduction == LINEAR_CROSS_ENTROPY_MEAN ? 1.0 / (double)valid_tokens(p) : 1.0;
    /* dhidden's float32 C: the result, or the scratch sum (NULL where dh_direct needs none) */
    const int dh_direct = l->dh_direct;
    float *dh32 = !p->dhidden ? NULL : !half ? p->dhidden : l->dw > l->dh ? ws + l->dh : NULL;
    float *dw32 = !p->dweight ? NULL
                  : half      ? ws + l->dw
                              : NULL,
          *db32 = !p->dbias ? NULL
                  : half    ? ws + l->db
                            : p->dbias;
    /* 16-bit gradients of one token chunk (plan_make's dw_direct): each dweight block is one product (no
     * sum over chunks), which the GEMM rounds once straight into the result (the float32 scratch then holds
     * at most the partial sums of earlier K slices): no float32 block written, read back and converted, and
     * on torch's GEMM a bfloat16 product (oneDNN's AMX tiles) where the float32 one went through a rounded
     * copy */
    const int dw_direct = l->dw_direct;
    /* with du kept, each product times the scalar gradient (du is made for 1): the GEMM's alpha */
    const float g = kept_bwd && p->grad ? (float)opf_load_elem(p->grad, 0, p->loss_dt) : 1.0f;
    const float *alpha = g != 1.0f ? &g : NULL;
    for (int64_t vbi = 0; vbi < nvb; vbi++) {
        job.v0 = vbi * l->vb, job.cols = min64(l->vb, p->v - job.v0);
        float *dwb = !p->dweight ? NULL : half ? dw32 : (float *)p->dweight + job.v0 * p->h;
        float *dw_c = dw_direct && l->db == l->dw ? NULL : dwb; /* the GEMM's C: NULL with no scratch block */
        for (int64_t tci = 0; tci < ntc; tci++) {
            job.t0 = tci * l->tc, job.rows = min64(l->tc, p->t - job.t0), job.rs = job.cols;
            const void *du; /* the GEMMs' A: du (rows, cols), row stride rs */
            if (kept_bwd) {
                du = (const char *)p->dlogits + (job.t0 * p->v + job.v0) * (int64_t)opf_dtype_size(du_dt);
                job.rs = p->v;
            } else {
                TRY(logits_block(&job, ws));
                if (fused) { /* the chunk's sweep 1 on its one block: its lse is final */
                    opf_parallel_for(0, job.rows, row_grain(job.cols), lse_rows, &job);
                    chunk_lse(p, &job);
                }
                opf_parallel_for(0, job.rows, row_grain(job.cols), grad_rows, &job);
                du = job.block16 ? (const void *)job.block16 : job.block;
            }
            if (p->dhidden) { /* dhidden rows (rows, H) (+)= du (rows, cols) . weight rows (cols, H) */
                gemm_epilogue ep = {.beta = vbi ? 1.0f : 0.0f, .alpha = alpha};
                if (dh_direct) { /* one vocab block: the chunk's rows are one product, rounded once */
                    ep.out16 = (char *)p->dhidden + job.t0 * p->h * 2;
                    ep.out_dt = gdt;
                }
                const int rc = grad_gemm(l, &l->dhidden[job.rows < l->tc][job.cols < l->vb], du, job.rs, 1,
                                         at(p->weight, job.v0 * p->weight_strides[0], dt), p->weight_strides[0],
                                         p->weight_strides[1], dh32 ? dh32 + job.t0 * p->h : NULL, p->h, &ep, ws);
                if (rc) return rc;
            }
            if (dwb) { /* dweight rows (cols, H) (+)= du^T (cols, rows) . hidden rows (rows, H) */
                gemm_epilogue ep = {.beta = tci ? 1.0f : 0.0f, .alpha = alpha};
                if (dw_direct) { /* one chunk: the product is the block's sum, rounded once into the result */
                    ep.out16 = (char *)p->dweight + job.v0 * p->h * 2;
                    ep.out_dt = gdt;
                }
                const int rc = grad_gemm(l, &l->dweight[job.rows < l->tc][job.cols < l->vb], du, 1, job.rs,
                                         at(p->hidden, job.t0 * p->hidden_strides[0], dt), p->hidden_strides[0],
                                         p->hidden_strides[1], dw_c, p->h, &ep, ws);
                if (rc) return rc;
            }
            if (db32) colsum_f32(gemm->cvt, db32 + job.v0, du, du_dt, job.rs, job.rows, job.cols, tci > 0);
        }
        if (ntc == 0) { /* no tokens: zero gradients of weight and bias */
            for (int64_t e = 0; dwb && e < job.cols * p->h; e++) dwb[e] = 0.0f;
            for (int64_t e = 0; db32 && e < job.cols; e++) db32[job.v0 + e] = 0.0f;
        }
        if (dwb && half && !dw_direct)
            convert_store_f32(gemm->cvt, (char *)p->dweight + job.v0 * p->h * 2, gdt, dwb, job.cols * p->h);
    }
    if (fused) store_loss(p, &job);
    for (int64_t e = 0; alpha && db32 && e < p->v; e++) db32[e] *= g;             /* the column sums of du made for 1 */
    if (nvb == 0 && dh32) memset(dh32, 0, (size_t)(p->t * p->h) * sizeof(float)); /* no vocab: zero dhidden */
    if (half && dh32 && !dh_direct) convert_store_f32(gemm->cvt, p->dhidden, gdt, dh32, p->t * p->h);
    if (half && db32) convert_store_f32(gemm->cvt, p->dbias, gdt, db32, p->v);
    return 0;
}

int linear_cross_entropy_run(const linear_cross_entropy_kernels *kern, const linear_cross_entropy_plan *plan,
                             const linear_cross_entropy_problem *p, float *ws, int64_t ws_floats) {
    const int f64 = p->dt == OPF_F64, log = opf_log_enabled(OPF_LOG_INFO);
    if (log)
        opf_log_note_pick(linear_cross_entropy_variants.family, f64 ? "ref_f64" : kern->name,
                          f64 ? OPF_ISA_REF : kern->isa);
    if (ws_floats < plan->floats) return LINEAR_CROSS_ENTROPY_ERR_WORKSPACE;
    if (f64) {
        linear_cross_entropy_ref_f64(p, (double *)ws);
        return 0;
    }
    return run_f32(kern, plan, p, ws);
}

/* ---- the backward of mean / sum over precomputed gradients --------------------------------------- */

typedef struct scale_job {
    const convert_kernels *cvt;
    opf_dtype dt, src_dt;
    void *dst;
    const void *src;
    double g;
} scale_job;

enum { SCALE_RUN = 1024 };

static void scale_range(int64_t begin, int64_t end, void *ctx) {
    const scale_job *job = ctx;
    if (job->src_dt == OPF_F64) {
        for (int64_t i = begin; i < end; i++) ((double *)job->dst)[i] = ((const double *)job->src)[i] * job->g;
        return;
    }
    const float g = (float)job->g, *src = job->src;
    if (job->dt == OPF_F32) {
        for (int64_t i = begin; i < end; i++) ((float *)job->dst)[i] = src[i] * g;
        return;
    }
    float buf[SCALE_RUN];
    for (int64_t i = begin; i < end; i += SCALE_RUN) {
        int64_t n = min64(SCALE_RUN, end - i);
        for (int64_t e = 0; e < n; e++) buf[e] = src[i + e] * g;
        job->cvt->from_f32((uint16_t *)job->dst + i, buf, job->dt, n);
    }
}

void linear_cross_entropy_scale(const convert_kernels *cvt, opf_dtype dt, void *dst, opf_dtype src_dt, const void *src,
                                int64_t n, const void *grad) {
    scale_job job = {
        .cvt = cvt, .dt = dt, .src_dt = src_dt, .dst = dst, .src = src, .g = opf_load_elem(grad, 0, src_dt)};
    opf_parallel_for(0, n, 65536, scale_range, &job);
}

/* ---- float64 reference ---------------------------------------------------------------------------- */

static double ld(const void *p, int64_t i) { return ((const double *)p)[i]; }

/* one row of capped logits of token t, in double */
static void ref_row(const linear_cross_entropy_problem *p, int64_t t, double *z) {
    for (int64_t v = 0; v < p->v; v++) {
        double u = p->bias ? ld(p->bias, v * p->bias_stride) : 0.0;
        for (int64_t k = 0; k < p->h; k++)
            u += ld(p->hidden, t * p->hidden_strides[0] + k * p->hidden_strides[1]) *
                 ld(p->weight, v * p->weight_strides[0] + k * p->weight_strides[1]);
        if (p->logits_bf16) u = opf_bf16_to_f32(opf_f32_to_bf16((float)u)); /* the kernel's bfloat16 block */
        z[v] = p->softcap > 0.0 ? p->softcap * tanh(u / p->softcap) : u;
    }
}

static double ref_lse(const double *z, int64_t n) {
    double m = -INFINITY, s = 0.0;
    for (int64_t v = 0; v < n; v++) m = fmax(m, z[v]);
    if (m == -INFINITY) return m;
    for (int64_t v = 0; v < n; v++) s += exp(z[v] - m);
    return m + log(s);
}

void linear_cross_entropy_ref_f64(const linear_cross_entropy_problem *p, double *z) {
    const double eps = p->label_smoothing;
    double total = 0.0;
    int64_t count = 0;
    for (int64_t t = 0; t < p->t; t++) {
        ref_row(p, t, z);
        double lse = p->lse_given ? (double)p->lse[t] : ref_lse(z, p->v), loss = 0.0, zsum = 0.0;
        if (!p->lse_given) p->lse[t] = (float)lse;
        int64_t y = p->target[t * p->target_stride];
        if (y != p->ignore_index) {
            loss = (1.0 - eps) * (lse - z[y]);
            if (eps > 0.0) {
                for (int64_t v = 0; v < p->v; v++) zsum += z[v];
                loss += eps * (lse - zsum / (double)p->v);
            }
            count++;
        }
        if (p->lse_given) continue;
        if (p->reduction == LINEAR_CROSS_ENTROPY_NONE)
            ((double *)p->loss)[t] = loss;
        else
            total += loss;
    }
    if (!p->lse_given && p->reduction != LINEAR_CROSS_ENTROPY_NONE)
        ((double *)p->loss)[0] = p->reduction == LINEAR_CROSS_ENTROPY_SUM ? total : total / count;
    if (!wants_grad(p)) return;
    double *dh = p->dhidden, *dw = p->dweight, *db = p->dbias;
    if (dh) memset(dh, 0, (size_t)(p->t * p->h) * sizeof(double));
    if (dw) memset(dw, 0, (size_t)(p->v * p->h) * sizeof(double));
    if (db) memset(db, 0, (size_t)p->v * sizeof(double));
    const double base = p->reduction == LINEAR_CROSS_ENTROPY_MEAN ? 1.0 / (double)count : 1.0;
    for (int64_t t = 0; t < p->t; t++) {
        int64_t y = p->target[t * p->target_stride];
        if (y == p->ignore_index) continue;
        double scale =
            base * (p->grad ? ld(p->grad, p->reduction == LINEAR_CROSS_ENTROPY_NONE ? t * p->grad_stride : 0) : 1.0);
        ref_row(p, t, z);
        double lse = ref_lse(z, p->v); /* in double, not the float32 lse a backward is given: gradcheck's */
        for (int64_t v = 0; v < p->v; v++) {
            double g = scale * (exp(z[v] - lse) - (v == y ? 1.0 - eps : 0.0) - eps / (double)p->v);
            if (p->softcap > 0.0) g *= 1.0 - (z[v] / p->softcap) * (z[v] / p->softcap);
            for (int64_t k = 0; k < p->h; k++) {
                double hk = ld(p->hidden, t * p->hidden_strides[0] + k * p->hidden_strides[1]);
                if (dh) dh[t * p->h + k] += g * ld(p->weight, v * p->weight_strides[0] + k * p->weight_strides[1]);
                if (dw) dw[v * p->h + k] += g * hk;
            }
            if (db) db[v] += g;
        }
    }
}
