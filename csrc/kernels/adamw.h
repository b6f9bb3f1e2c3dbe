/*
 * adamw: one step of torch.optim.AdamW (amsgrad=False) over a list of tensors, in place, in one pass
 * over memory. Per tensor, from its step count t (incremented first, as torch does) in double:
 *   step_size = lr / (1 - beta1^t),  bc2_sqrt = sqrt(1 - beta2^t),  decay = 1 - lr * weight_decay
 * then per element, in float32 and in exactly the order of torch's fused CPU kernel (so that float32
 * parameters get its bits):
 *   g = grad * sign                                  sign = -1 with maximize, else 1
 *   p = param * decay                                decoupled weight decay
 *   m = fma(coeff, g - m, base)                      torch's lerp m + (1 - beta1) (g - m):
 *                                                    coeff = 1 - beta1, base = m when 1 - beta1 < 0.5,
 *                                                    else coeff = -beta1, base = g
 *   v = v * beta2 + ((1 - beta2) * g) * g
 *   param = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)
 * Every scalar coefficient is rounded to float32 once, from double, as torch rounds it.
 *
 * Parameters and gradients are float32 or bfloat16 (a bfloat16 parameter is widened, updated in
 * float32 and rounded once to nearest even); exp_avg (m) and exp_avg_sq (v) are always float32:
 * torch keeps them in the parameter's dtype, where bfloat16's 8-bit mantissa cannot hold
 * v * 0.999 != v (1 - 0.999 is below half an ulp), so the second moment would never decay.
 *
 * Kernel contract (every ISA): n contiguous elements of each array; pure, no allocation, no threads.
 * Every variant rounds exactly as the reference does (the lerp is one fused multiply-add everywhere,
 * fmaf in the reference; nothing else is fused), so the C tests compare bit for bit, and any split
 * of the work over threads gives the same bits.
 */
#ifndef OPFORGE_KERNELS_ADAMW_H
#define OPFORGE_KERNELS_ADAMW_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

/* One tensor's coefficients, float32 as the kernels use them. */
typedef struct adamw_coef {
    float sign;          /* -1 with maximize, else 1 */
    float decay;         /* 1 - lr * weight_decay */
    float lerp_coeff;    /* 1 - beta1, or -beta1 where 1 - beta1 >= 0.5 */
    int lerp_from_grad;  /* 1 - beta1 >= 0.5: the lerp starts from g, not m */
    float beta2, c2;     /* v * beta2 + (c2 * g) * g, c2 = 1 - beta2 */
    float bc2_sqrt, eps; /* sqrt(1 - beta2^t), eps */
    float neg_step_size; /* -lr / (1 - beta1^t) */
} adamw_coef;

/* param, exp_avg, exp_avg_sq and grad are n elements each; param and grad of the table's dtype. */
typedef void (*adamw_fn)(void *param, float *exp_avg, float *exp_avg_sq, const void *grad, int64_t n,
                         const adamw_coef *c);

typedef struct adamw_kernels {
    OPF_VARIANT_HEAD;
    adamw_fn step[OPF_DTYPE_COUNT]; /* per parameter dtype: float32 and bfloat16 */
} adamw_kernels;

extern const adamw_kernels adamw_kernels_ref;
extern const adamw_kernels adamw_kernels_avx2;   /* adamw_avx2.c: 8 lanes, tails by the reference */
extern const adamw_kernels adamw_kernels_avx512; /* adamw_avx512.c: 16 lanes, masked tails */
extern const opf_variants adamw_variants;

const adamw_kernels *adamw_kernels_for(opf_isa isa);

typedef struct adamw_hparams {
    double lr, beta1, beta2, eps, weight_decay;
    int maximize;
} adamw_hparams;

/* One tensor of a step: param and grad numel elements of dt (OPF_F32 or OPF_BF16), exp_avg and
 * exp_avg_sq numel float32, all of the same layout; step one float32 or float64 (step_dt), the
 * count of steps taken, incremented by the step. */
typedef struct adamw_tensor {
    void *param;
    float *exp_avg, *exp_avg_sq;
    const void *grad;
    void *step;
    int64_t numel;
    opf_dtype dt, step_dt;
} adamw_tensor;

/* The coefficients of a tensor at step count t (the count after the increment). */
adamw_coef adamw_coefs(const adamw_hparams *h, double t);

/* Elements per parallel task: a task moves >= 28 bytes per element (float32 parameters), so
 * 32K elements outlast the pool hand-off many times over. */
#define ADAMW_GRAIN 32768

/* The step of n tensors: increments each step count, then updates every element of every
 * tensor, the tensors laid end to end and split over opf_parallel_for (a task may span several
 * tensors, so a list of small tensors is one parallel region, not one per tensor). */
void adamw_step(const adamw_kernels *k, const adamw_tensor *tensors, int64_t n, const adamw_hparams *h);

#endif
