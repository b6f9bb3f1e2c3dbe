/*
 * Scaled dot-product attention, flash style, float32 compute:
 *     out = softmax(scale * q k^T + mask) v        per (batch, head)
 * q (B, H, N, Dqk), k (B, Hkv, S, Dqk), v (B, Hkv, S, Dv), any element strides;
 * query head h reads key/value head h / (H / Hkv) (grouped-query attention,
 * K/V never repeated). out (B, H, N, Dv) any strides, lse (B, H, N) float32
 * contiguous: the log-sum-exp of each row, saved for the backward.
 *
 * Forward: each task is one block of BQ queries of one head. Q^T of the block
 * is made once; K/V are streamed in blocks of BK keys: the score tile S^T =
 * K Q^T (keys x queries) is formed by the ISA's matmul, the online softmax
 * runs down its columns (one query per vector lane), and O += P V. Masked
 * tiles are only those on the causal diagonal or under an explicit mask;
 * tiles above the diagonal are never computed. Tasks are pulled from an
 * atomic counter, most expensive first, so cores stay busy for any B x H.
 * With fewer query blocks than a fixed minimum of tasks (one head of up to 64
 * queries: decoding, cross-attention) each block's keys are split into chunks
 * of whole key blocks, one task each, leaving (O, max, sum) in a slot; the task
 * finishing a block's last chunk merges them in chunk order (split-K). The
 * split depends on the shape only: the same bits on any thread count. A few
 * queries (N <= 4) run the flash-decoding driver of attention_decode.c
 * instead: its tasks read a chunk of one key/value head's keys once for all
 * the query rows of the heads sharing it (attention.c: FWD_DECODE_MAX_N).
 *
 * Backward (FlashAttention-2): each task is one block of BK keys of one
 * key/value head, looping over the query blocks of every query head that
 * reads it: P is recomputed from lse, dS = P * (dP - delta) with delta =
 * rowsum(dO * out) computed once, dK and dV accumulate in the task, and dQ takes dS K of
 * each key block in key-block order whatever the threads (bitwise the same on
 * any thread count): straight into dQ, or through a ring of per-task slots
 * added in task order. With enough key/value heads for every thread a task is
 * a whole head group and walks its key blocks itself.
 *
 * Semantics match torch.nn.functional.scaled_dot_product_attention: causal is
 * top-left aligned (query i sees keys j <= i), a boolean mask keeps the keys
 * where it is true, a float mask is added to the scores, and a row with no
 * key left gives zeros (and zero gradients), lse = -inf. A row whose every
 * key a float mask sets to float32's lowest gets uniform weights, as in torch;
 * its lse rounds to that lowest value, so the backward, which recomputes P
 * from lse, gives it P = 1 rather than 1 / S (as torch's flash kernels do).
 */
#ifndef OPFORGE_KERNELS_ATTENTION_H
#define OPFORGE_KERNELS_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

typedef enum attn_mask_kind { ATTN_MASK_NONE = 0, ATTN_MASK_BOOL, ATTN_MASK_ADD } attn_mask_kind;

typedef struct attn_problem {
    int64_t b, h, hkv, n, s, d_qk, d_v; /* batch, heads, key/value heads, query and key length, head dims */
    opf_dtype dt;                       /* of q, k, v, out, dout, dq, dk, dv */
    const void *q, *k, *v;
    int64_t qs[4], ks[4], vs[4]; /* element strides (b, h, n|s, d) */
    const void *mask;            /* NULL, or (b, h, n, s) via ms (0 where broadcast) */
    attn_mask_kind mask_kind;
    opf_dtype mask_dt; /* ATTN_MASK_ADD: the mask's float type */
    int64_t ms[4];
    int causal;
    double scale; /* exact for the float64 oracle; the float32 kernels round it once */
    void *out;
    int64_t os[4];
    float *lse; /* (b, h, n) contiguous */
    /* backward: dout like out; the gradients dq, dk, dv like q, k, v */
    const void *dout;
    int64_t dos[4];
    void *dq, *dk, *dv;
    int64_t dqs[4], dks[4], dvs[4];
} attn_problem;

typedef void (*attn_mm_fn)(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                           int64_t ldb, float *c, int64_t ldc, int acc);

typedef struct attn_kernels {
    OPF_VARIANT_HEAD;
    const cvt_kernels *cvt; /* 16-bit rows to and from float32 */
    /* C (m x n, row stride ldc) = (acc ? C : 0) + A B with A(i, p) = a[i*rsa + p*csa]
     * and B(p, j) = b[p*ldb + j] */
    attn_mm_fn mm;
    /* mm on operands rounded to bfloat16 (to nearest even), float32 sums: used
     * for bfloat16 inputs, where Q, K, V and dO round exactly and P and dS
     * once, as flash kernels do; NULL where the ISA has no bfloat16 product */
    attn_mm_fn mm_bf16;
    /* online softmax down the columns of st (bk keys x bq queries, row stride ld):
     * x = scale * st; m' = max(m, max_j x); st = exp(x - m'); alpha = exp(m - m');
     * l = l * alpha + sum_j st; m = m'. A column with m' = -inf gets zeros.
     * Causal diagonal: key j is masked out (x = -inf) for query i when
     * j > i + diag; diag >= bk masks nothing. */
    void (*softmax_cols)(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l, float *alpha,
                         int64_t diag);
    /* scores (bq x bk, row stride ld) = exp(scale * scores - lse[i]), 0 for keys
     * j > i + diag; rows with lse = -inf get zeros */
    void (*probs)(float *scores, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse, int64_t diag);
    /* dp = p * (dp - delta[i]) * scale (the gradient of the scaled scores) */
    void (*dscores)(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *delta, float scale);
} attn_kernels;

extern const attn_kernels attn_kernels_ref;
extern const attn_kernels attn_kernels_avx2;        /* attention_avx2.c */
extern const attn_kernels attn_kernels_avx512;      /* attention_avx512.c */
extern const attn_kernels attn_kernels_avx512_bf16; /* attention_avx512.c */
extern const opf_variants attn_variants;

const attn_kernels *attn_kernels_for(opf_isa isa);

/* The product the driver uses for p's dtype: mm_bf16 for bfloat16 where the table has one */
static inline attn_mm_fn attn_mm_for(const attn_kernels *k, const attn_problem *p) {
    return p->dt == OPF_BF16 && k->mm_bf16 ? k->mm_bf16 : k->mm;
}

/* ---- element access, shared by the driver and the oracle ---- */

/* element (b, h, i, d) of a 4-d array of strides st */
static inline int64_t off4(const int64_t *st, int64_t b, int64_t h, int64_t i, int64_t d) {
    return b * st[0] + h * st[1] + i * st[2] + d * st[3];
}

/* The mask's verdict on query i, key j: -inf (masked out), or what to add. */
static inline float mask_bias(const attn_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (p->causal && j > i) return -INFINITY;
    if (p->mask_kind == ATTN_MASK_NONE) return 0.0f;
    int64_t o = off4(p->ms, b, h, i, j);
    if (p->mask_kind == ATTN_MASK_BOOL) return ((const uint8_t *)p->mask)[o] ? 0.0f : -INFINITY;
    return (float)opf_load_elem(p->mask, o, p->mask_dt);
}

/* Floats of workspace for attn_fwd / attn_bwd (float32, bfloat16, float16). */
int64_t attn_fwd_workspace(const attn_problem *p);
int64_t attn_bwd_workspace(const attn_problem *p);
void attn_fwd(const attn_kernels *k, const attn_problem *p, float *workspace);
/* Needs p->out and p->lse from attn_fwd, p->dout; writes dq, dk, dv. */
void attn_bwd(const attn_kernels *k, const attn_problem *p, float *workspace);

/* The oracle, row by row in double (and the float64 path of the op); any dtype
 * incl. OPF_F64. The backward allocates its own double accumulators. Returns
 * 0, or -1 when out of memory. */
int attn_ref_fwd(const attn_problem *p);
int attn_ref_bwd(const attn_problem *p);

#endif
