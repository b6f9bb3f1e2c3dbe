/*
 * Fused LM head + cross-entropy, forward and backward, without the (T, V)
 * logits:
 *     u = hidden (T,H) . weight (V,H)^T + bias (V)          logits, per block
 *     z = c tanh(u / c)   (softcap c > 0; z = u without)    Gemma-2 soft-capping
 *     lse_t = log sum_v exp z_tv
 *     loss_t = (1 - eps) (lse_t - z_{t,y_t}) + eps (lse_t - (1/V) sum_v z_tv)   (label smoothing eps)
 *            = 0 where y_t == ignore_index
 *   torch's form, term by term: each difference is exactly 0 for V = 1 (lse = z), where lse - (1 - eps) z
 *   - eps z left rounding of either sign; and the smoothing term is left out at eps = 0, as torch computes
 *   none: with a -inf logit (a class masked by a -inf bias) it is +inf, and 0 x inf would make the loss
 *   NaN where torch's is finite (with eps > 0 the loss is +inf, as torch's)
 *     reduction: none (loss_t), sum, mean (sum / the count of tokens not ignored)
 *     dz_tv = s_t (exp(z_tv - lse_t) - (1 - eps) [v == y_t] - eps / V),  du = dz (1 - (z/c)^2)
 *     dhidden = du . weight     dweight = du^T . hidden     dbias = sum_t du
 * with s_t the gradient of loss_t: 1/N or 1 times the scalar gradient of the
 * reduced loss, or the per-token gradient for reduction none; 0 when ignored.
 *
 * Block plan: the logits exist a (tc tokens x vb vocab) block at a time, in a
 * float32 scratch of about LINEAR_CROSS_ENTROPY_BLOCK_FLOATS. Sweep 1 runs every block through
 * the GEMM and folds it into an online (max, sum exp) per token: lse. Sweep 2
 * (when gradients are asked for) runs the vocab blocks in order, and within
 * each the token chunks in order: recompute the block, turn it into du row by
 * row, then dhidden[chunk] += du . weight[block] and dweight[block] += du^T .
 * hidden[chunk] on the GEMM, dbias[block] += column sums. Where a chunk of
 * LINEAR_CROSS_ENTROPY_CHUNK_TOKENS tokens (or all of them, if fewer) and the
 * whole vocabulary fit the budget, a block spans the vocabulary (vb = V):
 * a chunk's log-sum-exp is final once its one block has run, so a forward
 * asked for the gradients runs both sweeps chunk by chunk on the block still
 * in the scratch -- three GEMMs per block where recomputing takes four. Every sum over
 * blocks runs in this fixed order and the GEMM splits no sum across threads:
 * the same bits at any thread count.
 *
 * Kept du (dlogits): a forward given a (T, V) dlogits writes each block's
 * logits into it during sweep 1 and, its log-sum-exps final, turns it into du
 * (for a loss gradient of 1) row by row; no gradient GEMM runs. The backward
 * given it runs sweep 2's two GEMMs per block on its blocks, each product
 * times the scalar gradient (the GEMM's alpha), with no recompute: eager's
 * three GEMMs, holding T x V elements where the forward's gradients hold
 * V x H + T x H (so the Python layer keeps du only for T <= H). du is the
 * block's dtype: bfloat16 for bfloat16 operands, else float32 (the glue keeps
 * it for float32 and bfloat16 operands, as a tensor of hidden's dtype).
 *
 * float32 accumulates dhidden, dweight and dbias in the outputs; bfloat16 and
 * float16 operands go through the GEMM's 16-bit paths (float32 accumulation)
 * and the gradients accumulate in float32 scratch (dhidden (T,H), one vocab
 * block of dweight, dbias) and are rounded once (with one token chunk a
 * dweight block is one product, which the GEMM rounds straight into the
 * 16-bit result: the scratch block is not written). For bfloat16 operands the
 * logits block is bfloat16, as eager's logits are under autocast: the GEMM
 * rounds its float32 sums once into it, the row code reads it a segment at a
 * time through float32 (the log-sum-exp and du are float32 as before) and
 * writes du over it rounded to bfloat16, the operand both gradient GEMMs take
 * (a float32 du was rounded so on its way into them, by each). Half the
 * block's bytes, and none of the float32 block's passes (the result's
 * conversion, the row code's float32 reads and writes, the GEMMs' rounding);
 * the loss is that of the bfloat16 logits (torch's provider gave those
 * already). float64 runs the reference
 * (linear_cross_entropy_ref_f64): the C tests' oracle and the op's path for gradcheck.
 *
 * dtypes: the loss and its gradient are promote(operands, float32)
 * (linear_cross_entropy_loss_dtype): the log-sum-exp is float32 whatever the
 * operands, as torch's autocast computes F.cross_entropy(F.linear(...)) in
 * float32 from 16-bit logits; a float16 loss would also overflow GradScaler's
 * scaled gradient (65536 is past float16's range). Gradients made in the
 * forward (for a unit loss gradient, scaled in the backward) are in that
 * dtype too: rounded to float16 before the scale they would underflow where
 * torch's scaled ones do not; the backward's gradients are the operands'.
 *
 * Kernels never allocate: the workspace comes in, sized by linear_cross_entropy_workspace from
 * the plan made once per call (linear_cross_entropy_plan_make: the blocks, the GEMM plans of
 * each block shape at the caller's thread count, the workspace layout) that
 * linear_cross_entropy_run then runs. Entry points return 0, or LINEAR_CROSS_ENTROPY_ERR_WORKSPACE for a
 * workspace smaller than the plan (a caller that sized for another problem).
 */
#ifndef OPFORGE_KERNELS_LINEAR_CROSS_ENTROPY_H
#define OPFORGE_KERNELS_LINEAR_CROSS_ENTROPY_H

#include <stdint.h>

#include "gemm.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

enum { LINEAR_CROSS_ENTROPY_ERR_WORKSPACE = -1, LINEAR_CROSS_ENTROPY_ERR_DECLINED = -2 };
typedef enum linear_cross_entropy_reduction {
    LINEAR_CROSS_ENTROPY_NONE = 0,
    LINEAR_CROSS_ENTROPY_MEAN = 1,
    LINEAR_CROSS_ENTROPY_SUM = 2
} linear_cross_entropy_reduction;

/* Floats of the logits block scratch by default: 16 MiB, e.g. 2048 tokens x
 * 2048 vocab rows, large enough that every GEMM of sweep 2 has K >= 2048. */
#define LINEAR_CROSS_ENTROPY_BLOCK_FLOATS ((int64_t)4 << 20)

/* The block budget of a float32 forward that makes the gradients: the weight's size (V x H floats), at
 * least LINEAR_CROSS_ENTROPY_BLOCK_FLOATS and at most this (256 MiB), so that the blocks span the
 * vocabulary with chunks of many tokens: three GEMMs where a recomputing backward runs four (0.86-0.91x
 * eager at 4096 tokens x 2048 -> 32000 on the AMX Xeon). A chunk is at most as deep as the GEMM's K slice
 * (1024 tokens with AVX-512, 384 with AVX2; at least LINEAR_CROSS_ENTROPY_CHUNK_TOKENS): each chunk's
 * dweight product then adds into the sum over chunks no more often than one product over all the tokens
 * would, slice by slice (linear_cross_entropy_plan_make). The call holds the block during the forward and
 * the float32 gradients (dweight: the weight's size) from forward to backward, less than eager's three
 * T x V logits-sized tensors whenever T > H. bfloat16 keeps the default budget (its large heads recompute:
 * FORWARD_GRADS_BF16_MAX in the Python layer), and so does float16. */
#define LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX ((int64_t)64 << 20)

/* promote(dt, float32): float32 for float32 and 16-bit operands, float64 for float64. */
static inline opf_dtype linear_cross_entropy_loss_dtype(opf_dtype dt) { return dt == OPF_F64 ? OPF_F64 : OPF_F32; }

/* Tokens per chunk at least, where a block spans the vocabulary: the dweight
 * GEMM sums over a chunk's tokens (its K), which a few dozen would starve. */
#define LINEAR_CROSS_ENTROPY_CHUNK_TOKENS ((int64_t)256)

/* 1 when the blocks of t tokens by a vocabulary of v span the vocabulary (the
 * default budget): the forward can then make the gradients on the way at no
 * extra GEMM, and the backward only scales them. The same as
 * min(max(t, 1), LINEAR_CROSS_ENTROPY_CHUNK_TOKENS) * max(v, 1) <= LINEAR_CROSS_ENTROPY_BLOCK_FLOATS,
 * the form the Python layer evaluates on (possibly symbolic) sizes. */
int linear_cross_entropy_vocab_in_one_block(int64_t t, int64_t v);

typedef struct linear_cross_entropy_problem {
    int64_t t, h, v;    /* tokens, hidden size, vocab size */
    opf_dtype dt;       /* of hidden, weight and bias */
    opf_dtype loss_dt;  /* of loss and grad: linear_cross_entropy_loss_dtype(dt) */
    opf_dtype grads_dt; /* of dhidden, dweight and dbias: dt, or loss_dt (gradients made in the forward) */
    const void *hidden; /* (T,H): hidden[t * hidden_strides[0] + k * hidden_strides[1]] */
    int64_t hidden_strides[2];
    const void *weight; /* (V,H) likewise */
    int64_t weight_strides[2];
    const int64_t *target; /* (T) via target_stride */
    int64_t target_stride;
    const void *bias; /* (V) via bias_stride, or NULL */
    int64_t bias_stride;
    int64_t ignore_index;
    double label_smoothing; /* in [0, 1] */
    double softcap;         /* > 0, or 0: none */
    int reduction;          /* linear_cross_entropy_reduction */
    int64_t block_floats;   /* the logits block's floats; 0: LINEAR_CROSS_ENTROPY_BLOCK_FLOATS */
    int logits_bf16;        /* the float64 reference only: each logit rounded to bfloat16 (after the bias, before
                             * the softcap), as the kernels' block holds them for bfloat16 operands */
    /* forward: loss (T) for reduction none, else one element; lse (T) float32.
     * lse_given: the backward's lse from the forward (sweep 1 is skipped). */
    void *loss;
    float *lse;
    int lse_given;
    /* gradients, contiguous; NULL: not wanted (dbias also NULL without bias) */
    void *dhidden, *dweight, *dbias;
    /* gradient of the loss: NULL is 1; reduction none: (T) via grad_stride, else one element */
    const void *grad;
    int64_t grad_stride;
    /* du kept (T, V), contiguous, bfloat16 for bfloat16 operands and float32 for the others (float64: the
     * reference, which keeps none), or NULL: made by a forward (not lse_given; the gradients then NULL), read
     * by a backward (lse_given, reduction mean / sum) */
    void *dlogits;
} linear_cross_entropy_problem;

/* Row code of the two sweeps on one row of a float32 logits block (n raw
 * logits u; cap = c, or 0 without softcap):
 *   lse_update: folds the row into the running (*max, *sum of exp(z - *max))
 *     and adds sum z to *zsum
 *   grad: u[j] <- scale (exp(z_j - lse) - eps_v) (1 - (z_j / c)^2), in place
 *   capped: z_j, the very number the other two make of u[j] (a vector tanh's
 *     lane or the scalar tail's tanhf): the caller's target logit, so that
 *     lse - z_y >= 0, and = 0 for one class, as torch's log-softmax gives
 * (the target's -(1 - eps) term is the caller's, one element). */
typedef struct linear_cross_entropy_kernels {
    OPF_VARIANT_HEAD;
    void (*lse_update)(const float *u, int64_t n, float cap, float *max, float *sum, float *zsum);
    void (*grad)(float *u, int64_t n, float cap, float lse, float scale, float eps_v);
    float (*capped)(const float *u, int64_t n, int64_t j, float cap);
} linear_cross_entropy_kernels;

extern const linear_cross_entropy_kernels linear_cross_entropy_kernels_ref;
extern const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx2;   /* linear_cross_entropy_avx2.c */
extern const linear_cross_entropy_kernels linear_cross_entropy_kernels_avx512; /* linear_cross_entropy_avx512.c */
extern const opf_variants linear_cross_entropy_variants;

/* The table for isa, not noted for the log: linear_cross_entropy_run notes the row code that
 * runs (the table, or "ref_f64" for float64), as gemm_run notes its GEMM. */
const linear_cross_entropy_kernels *linear_cross_entropy_kernels_for(opf_isa isa);

/* The first t with a target outside [0, V) other than ignore_index, or -1. */
int64_t linear_cross_entropy_bad_target(const linear_cross_entropy_problem *p);

/* Blocks of tc tokens x vb vocab rows, the GEMMs of the full and the last
 * block each way ([last token chunk][last vocab block]: logits (rows, cols,
 * H), dhidden (rows, H, cols), dweight (cols, H, rows)), and the workspace:
 * the GEMMs' packing, the logits block, the per-token running max, sum and
 * sum of z and the target's z (sweep 1), a float32 bias, and for 16-bit
 * types the float32 gradients (dhidden (T,H), dweight of one vocab block,
 * dbias (V)), and for bfloat16 operands du rounded to bfloat16 (one block),
 * which both gradient GEMMs read (they would each round the float32 du so).
 * With du kept, no float32 logits block (the GEMM writes float32 logits into
 * du itself), and a backward reading it has no block at all.
 * float64: one row of V doubles. */
typedef struct linear_cross_entropy_plan {
    const gemm_kernels *gemm;
    int64_t tc, vb;
    gemm_plan logits[2][2], dhidden[2][2], dweight[2][2];
    int64_t gemm_floats;
    int64_t block, max, sum, zsum, zy, bias, dh, dw, db, block16, floats;
    int dw_direct; /* 16-bit gradients of one token chunk: dweight rounded by the GEMM into the result */
    int dh_direct; /* 16-bit gradients of one vocab block: dhidden likewise */
    int claimed;   /* linear_cross_entropy_plan_claim's: the gradient products on the provider, no workspace */
} linear_cross_entropy_plan;

linear_cross_entropy_plan linear_cross_entropy_plan_make(const gemm_kernels *gemm,
                                                         const linear_cross_entropy_problem *p, int64_t threads);
/* A backward reading kept du runs each gradient as one whole product (tc = T, vb = V). Where the GEMM
 * provider claims those products (gemm_provider_claims: classes settled on its own GEMM, which writes
 * the results itself), the plan is remade to run them with no workspace: no packing, no float32
 * scratch of 16-bit gradients (the provider rounds them straight into the results). A claimed product
 * the provider then declines after all (its mode changed since, or its GEMM failed) makes
 * linear_cross_entropy_run return LINEAR_CROSS_ENTROPY_ERR_DECLINED, the gradients unfinished: the
 * caller runs it again under the unclaimed plan. Any other problem: the plan is left as it is. */
void linear_cross_entropy_plan_claim(linear_cross_entropy_plan *plan, const linear_cross_entropy_problem *p);
/* Floats of workspace linear_cross_entropy_run needs under the plan. */
int64_t linear_cross_entropy_workspace(const linear_cross_entropy_plan *plan);
/* Sweep 1 (loss, lse) unless lse_given, then sweep 2 when a gradient pointer
 * is set. The backward of reduction none (and of a forward that made no
 * gradients) is this with lse_given and grad. With dlogits: a forward makes
 * du there after sweep 1 (no gradients), a backward (lse_given) runs sweep
 * 2's GEMMs on it, times *grad. */
int linear_cross_entropy_run(const linear_cross_entropy_kernels *kern, const linear_cross_entropy_plan *plan,
                             const linear_cross_entropy_problem *p, float *ws, int64_t ws_floats);

/* dst[i] = src[i] * g for n elements, dst of dt (float32, float64, bfloat16,
 * float16), src and g (the one element of grad) of src_dt (float32 or
 * float64; the loss's, linear_cross_entropy_loss_dtype(dt)): the backward of
 * mean / sum when the forward made the gradients, rounded once. Threaded. */
void linear_cross_entropy_scale(const convert_kernels *cvt, opf_dtype dt, void *dst, opf_dtype src_dt, const void *src,
                                int64_t n, const void *grad);

/* float64 reference of linear_cross_entropy_run (double inputs and outputs, lse float32);
 * ws: linear_cross_entropy_workspace's floats (one row of V doubles). */
void linear_cross_entropy_ref_f64(const linear_cross_entropy_problem *p, double *row);

#endif
