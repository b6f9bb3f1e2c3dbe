/*
 * adamw: the scalar reference (the oracle, kept forever), the ISA table and the driver over a list
 * of tensors. Formulas in the header.
 */
#include <math.h>
#include <stddef.h>

#include "adamw.h"

adamw_coef adamw_coefs(const adamw_hparams *h, double t) {
    /* double, then float32 once: torch's fused kernel computes and rounds them so */
    const double lerp = 1.0 - h->beta1;
    const float w = (float)lerp;
    const int from_grad = !(fabsf(w) < 0.5f);
    return (adamw_coef){
        .sign = h->maximize ? -1.0f : 1.0f,
        .decay = (float)(1.0 - h->lr * h->weight_decay),
        .lerp_coeff = from_grad ? w - 1.0f : w,
        .lerp_from_grad = from_grad,
        .beta2 = (float)h->beta2,
        .c2 = (float)(1.0 - h->beta2),
        .bc2_sqrt = (float)sqrt(1.0 - pow(h->beta2, t)),
        .eps = (float)h->eps,
        .neg_step_size = (float)(-(h->lr / (1.0 - pow(h->beta1, t)))),
    };
}

/* One element; p and g already float32. Returns the new parameter. */
static inline float adamw_elem(float p, float *m, float *v, float g, const adamw_coef *c) {
    g = g * c->sign;
    p = p * c->decay;
    const float m0 = *m;
    const float mn = fmaf(c->lerp_coeff, g - m0, c->lerp_from_grad ? g : m0);
    const float vn = fmaf(c->c2 * g, g, *v * c->beta2);
    *m = mn;
    *v = vn;
    return p + c->neg_step_size * mn / (sqrtf(vn) / c->bc2_sqrt + c->eps);
}

static void adamw_step_f32(void *param_, float *m, float *v, const void *grad_, int64_t n, const adamw_coef *c) {
    float *p = param_;
    const float *g = grad_;
    for (int64_t i = 0; i < n; i++) p[i] = adamw_elem(p[i], m + i, v + i, g[i], c);
}

static void adamw_step_bf16(void *param_, float *m, float *v, const void *grad_, int64_t n, const adamw_coef *c) {
    uint16_t *p = param_;
    const uint16_t *g = grad_;
    for (int64_t i = 0; i < n; i++)
        p[i] = opf_f32_to_bf16(adamw_elem(opf_bf16_to_f32(p[i]), m + i, v + i, opf_bf16_to_f32(g[i]), c));
}

const adamw_kernels adamw_kernels_ref = {
    .name = "ref",
    .isa = OPF_ISA_REF,
    .step = {[OPF_F32] = adamw_step_f32, [OPF_BF16] = adamw_step_bf16},
};

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL
 * there and the choice falls back. */
extern const adamw_kernels adamw_kernels_avx2 __attribute__((weak));
extern const adamw_kernels adamw_kernels_avx512 __attribute__((weak));

const opf_variants adamw_variants =
    OPF_VARIANTS("adamw", &adamw_kernels_ref, &adamw_kernels_avx2, &adamw_kernels_avx512);

const adamw_kernels *adamw_kernels_for(opf_isa isa) { return opf_variant_pick(&adamw_variants, isa); }

/* ---- driver ------------------------------------------------------------------------------------ */

typedef struct adamw_job {
    const adamw_kernels *k;
    const adamw_tensor *t;
    int64_t n;
    const adamw_hparams *h;
} adamw_job;

static double step_count(const adamw_tensor *t) {
    return t->step_dt == OPF_F64 ? *(const double *)t->step : (double)*(const float *)t->step;
}

/* Elements [begin, end) of the tensors laid end to end. A task finds its first tensor by walking the
 * list: a few hundred additions, once per task. */
static void adamw_range(int64_t begin, int64_t end, void *ctx) {
    const adamw_job *j = ctx;
    int64_t at = 0; /* where tensor i starts */
    for (int64_t i = 0; i < j->n && at < end; at += j->t[i].numel, i++) {
        const adamw_tensor *t = &j->t[i];
        const int64_t lo = begin > at ? begin - at : 0, hi = end - at < t->numel ? end - at : t->numel;
        if (lo >= hi) continue;
        const adamw_coef c = adamw_coefs(j->h, step_count(t));
        const size_t es = opf_dtype_size(t->dt);
        j->k->step[t->dt]((char *)t->param + lo * es, t->exp_avg + lo, t->exp_avg_sq + lo,
                          (const char *)t->grad + lo * es, hi - lo, &c);
    }
}

void adamw_step(const adamw_kernels *k, const adamw_tensor *tensors, int64_t n, const adamw_hparams *h) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        const adamw_tensor *t = &tensors[i];
        if (t->step_dt == OPF_F64)
            *(double *)t->step += 1.0;
        else
            *(float *)t->step += 1.0f;
        total += t->numel;
    }
    adamw_job j = {.k = k, .t = tensors, .n = n, .h = h};
    opf_parallel_for(0, total, ADAMW_GRAIN, adamw_range, &j);
}
