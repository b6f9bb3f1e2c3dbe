/*
 * Scaled dot-product attention, flash style, float32 compute:
 *     out = softmax(scale * q k^T + mask) v        per (batch, head)
 * q (B, H, N, Dqk), k (B, Hkv, S, Dqk), v (B, Hkv, S, Dv), any element strides;
 * query head h reads key/value head h / (H / Hkv) (grouped-query attention,
 * K/V never repeated). out (B, H, N, Dv) any strides, lse (B, H, N) float32
 * contiguous: the log-sum-exp of each row, saved for the backward.
 *
 * Forward: each task is one block of BQ queries of one head. Q^T of the block
 * is made once (transposed by the table); K/V are streamed in blocks of keys
 * (the table's: BK = 64, 128 or 256, attention.c: fwd_bk): the score tile S^T =
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
 * any thread count): straight into dQ, or into a float32 copy of it, each
 * query block's rows taking the key blocks' turns. Tasks are pulled key block
 * by key block across the head groups: under a causal mask the first blocks,
 * the most work, start first. With enough key/value heads for every thread a
 * task is a whole head group and walks its key blocks itself.
 *
 * bfloat16 inputs multiply bfloat16 pairs where the table has the product
 * (mm_bf16). With unit-stride rows of Q, K and V and head dims up to 256 the
 * operands are packed into pairs straight from their 16-bit rows (no float32
 * copy; dO's rows, where they are not unit-stride, copied into 16-bit rows per
 * query block first), each once where it is reused -- Q^T per forward task,
 * K^T, V^T and K per backward task -- and P and dS from the float32 tiles (packing below): the
 * same sums as the staged products, so the same bits (a NaN input keeps its
 * payload into the sums, where staging makes it the one quiet NaN).
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

#include "attention_decode.h"
#include "attention_rows.h"
#include "convert.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

typedef enum attention_mask_kind {
    ATTENTION_MASK_NONE = 0,
    ATTENTION_MASK_BOOL,
    ATTENTION_MASK_ADD
} attention_mask_kind;

typedef struct attention_problem {
    int64_t b, h, hkv, n, s, d_qk, d_v; /* batch, heads, key/value heads, query and key length, head dims */
    opf_dtype dt;                       /* of q, k, v, out, dout, dq, dk, dv */
    const void *q, *k, *v;
    int64_t qs[4], ks[4], vs[4]; /* element strides (b, h, n|s, d) */
    const void *mask;            /* NULL, or (b, h, n, s) via ms (0 where broadcast) */
    attention_mask_kind mask_kind;
    opf_dtype mask_dt; /* ATTENTION_MASK_ADD: the mask's float type */
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
} attention_problem;

typedef void (*attention_mm_fn)(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa,
                                const float *b, int64_t ldb, float *c, int64_t ldc, int acc);

/* Block products of bfloat16 inputs on operands packed into bfloat16 pairs once and reused: Q, K, V
 * and dO are packed from their own 16-bit rows (no float32 copy), K and V once per block for every
 * product that reads them, and P and dS from the float32 tiles. The sums are the mm_bf16 ones, term
 * for term (one chunk of K: head dims <= 2 * ATTENTION_PACK_KP), so the results are the same bits
 * (NaN inputs aside: a packed NaN keeps its payload).
 * A packed A (m x k) holds its rows along K -- row r's pair q (A(r, 2q), A(r, 2q + 1)) at
 * ap[r * ATTENTION_PACK_KP + q] -- or its columns -- at ap[q * ATTENTION_PACK_MC + r], m <= that; a
 * packed B (k x n) is 32-column slivers, sliver s at bp + s * ((k + 1) / 2) * 32 with pair q of its
 * column j at [q * 32 + j], zeros past n and past an odd k. */
enum { ATTENTION_PACK_KP = 128, ATTENTION_PACK_MC = 64 };

/* A table may pad K with zero pairs to whole tiles of 16 (AMX's: its tiles read 16 pairs at a time), so
 * the buffers hold this many pairs of K: along A's columns (ATTENTION_PACK_MC rows of them, for a table
 * that keeps that form in rows) and in each of B's slivers. */
static inline int64_t attention_packed_pairs(int64_t k) { return ((k + 1) / 2 + 15) / 16 * 16; }

typedef struct attention_bf16_packing {
    /* A (rows x k) along its rows, from 16-bit rows a[r * rs + p] or float32 rows (rounded) */
    void (*a_rows16)(uint32_t *ap, const uint16_t *a, int64_t rs, int64_t rows, int64_t k);
    void (*a_rows32)(uint32_t *ap, const float *a, int64_t rs, int64_t rows, int64_t k);
    /* A(r, p) = a[r + p * cs], float32 (rounded), along its columns */
    void (*a_cols32)(uint32_t *ap, const float *a, int64_t cs, int64_t rows, int64_t k);
    /* B (k x n): B(p, j) = b[p * rs + j], or b[j * rs + p] (bt16: 16-bit rows as B's columns) */
    void (*b16)(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n);
    void (*bt16)(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n);
    /* C (m x n, row stride ldc) = (acc ? C : 0) + A B, A packed along its rows (a_rows) or columns */
    void (*mm)(int64_t m, int64_t n, int64_t k, const uint32_t *ap, int a_rows, const uint32_t *bp, float *c,
               int64_t ldc, int acc);
} attention_bf16_packing;

typedef struct attention_kernels {
    OPF_VARIANT_HEAD;
    const convert_kernels *cvt; /* 16-bit rows to and from float32 */
    /* C (m x n, row stride ldc) = (acc ? C : 0) + A B with A(i, p) = a[i*rsa + p*csa]
     * and B(p, j) = b[p*ldb + j] */
    attention_mm_fn mm;
    /* mm on operands rounded to bfloat16 (to nearest even), float32 sums: used
     * for bfloat16 inputs, where Q, K, V and dO round exactly and P and dS
     * once, as flash kernels do; NULL where the ISA has no bfloat16 product */
    attention_mm_fn mm_bf16;
    /* the same products on operands packed once (see above); NULL where the table has none */
    const attention_bf16_packing *packing;
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
    /* dst (cols x rows, row stride ldd) = src (rows x cols, row stride lds) transposed: a forward block's Q^T */
    void (*transpose)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);
    /* row i of dst (rows x cols, row stride ldd) = row i of src (row stride lds) times f[i]; dst may be src:
     * the forward's rescale of O by alpha and its normalisation by 1 / l */
    void (*scale_rows)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols,
                       const float *f);
    /* keys per block of the forward's bfloat16 products (mm_bf16 and packing: the same blocks, the same
     * bits), and of its float32 ones (mm: float32 inputs, and any the table has no bfloat16 product for):
     * 0 for the driver's 64; more keys rescale O less often and take fewer, larger products */
    int64_t fwd_bk, fwd_bk_plain;
} attention_kernels;

extern const attention_kernels attention_kernels_ref;
extern const attention_kernels attention_kernels_avx2;        /* attention_avx2.c */
extern const attention_kernels attention_kernels_avx512;      /* attention_avx512.c */
extern const attention_kernels attention_kernels_avx512_bf16; /* attention_avx512.c */
extern const attention_kernels attention_kernels_amx;         /* attention_amx.c: bfloat16 products on AMX tiles */
extern const opf_variants attention_variants;

/* The table for isa (not noted for the log: attention_fwd and attention_bwd note what runs). */
const attention_kernels *attention_kernels_for(opf_isa isa);

/* The product the driver uses for p's dtype: mm_bf16 for bfloat16 where the table has one */
static inline attention_mm_fn attention_mm_for(const attention_kernels *k, const attention_problem *p) {
    return p->dt == OPF_BF16 && k->mm_bf16 ? k->mm_bf16 : k->mm;
}

/* ---- element access, shared by the driver and the oracle (off4: attention_rows.h) ---- */

/* The mask's verdict on query i, key j: -inf (masked out), or what to add. */
static inline float mask_bias(const attention_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (p->causal && j > i) return -INFINITY;
    if (p->mask_kind == ATTENTION_MASK_NONE) return 0.0f;
    int64_t o = off4(p->ms, b, h, i, j);
    if (p->mask_kind == ATTENTION_MASK_BOOL) return ((const uint8_t *)p->mask)[o] ? 0.0f : -INFINITY;
    return (float)opf_load_elem(p->mask, o, p->mask_dt);
}

/* ---- plans: made once per call, at the caller's thread count ---- */

/* float64 runs the oracle on a scratch of doubles in the workspace; a few
 * queries run the flash-decoding driver (attention.c: FWD_DECODE_MAX_N);
 * the rest query blocks of the flash kernels */
typedef enum attention_path { ATTENTION_PATH_BLOCKS = 0, ATTENTION_PATH_DECODE, ATTENTION_PATH_REF } attention_path;

/* The forward's tasks and workspace. Blocks: the chunk slots (split only;
 * per query block and chunk: O (rows x d_v), m (rows), l (rows)), a count of
 * finished chunks per query block (int64), then one slice per worker, as
 * offsets: the one statement of it (attention_fwd_workspace sizes with it,
 * attention_fwd carves with it). */
typedef struct attention_fwd_plan {
    attention_path path;
    attention_decode_plan decode; /* ATTENTION_PATH_DECODE */
    int64_t qrows;                /* queries per block: 64, fewer where the blocks leave threads idle */
    int64_t nqb, blocks;          /* query blocks per head, of all heads */
    int64_t bk;                   /* keys per block (the table's fwd_bk or fwd_bk_plain) */
    int64_t chunks;               /* the most chunks of a query block: 1 unless split */
    int64_t span;                 /* keys per chunk, a multiple of the key block when split */
    int64_t tasks, rows, slot_floats, per_worker, workers;
    int64_t kv_words;   /* words of one key block's K and V packed up front (0: packed per task) */
    int64_t tail_heads; /* the last heads (b, h), whose tasks are pulled query block by query block across
                           them; the heads before them head by head (FWD_BY_BLOCK_TASKS) */
    int64_t slots, counts, slices, packed_kv, floats;
} attention_fwd_plan;

/* The backward's tasks and workspace: a task is a whole head group when there
 * are enough groups for every thread, else one chunk of a key block of a group
 * (span of its (head, query block) pairs: all of them unless the shape has too
 * few key-block tasks, attention.c); then delta = rowsum(dO * out) (b, h, n), a
 * float32 dQ (b, h, n, d_qk) unless accumulated in place (dq32 < 0), the query
 * blocks' turns and the cut key blocks' turns (atomic int64), the cut key
 * blocks' float32 dK and dV sums (chunk tasks, unless kept in float32 dK and
 * dV themselves), and one slice per worker, as offsets. */
typedef struct attention_bwd_plan {
    attention_path path; /* ATTENTION_PATH_REF or ATTENTION_PATH_BLOCKS */
    int whole;           /* a task is a whole head group */
    int cut;             /* some key block's pairs are cut into chunks (span < its pairs) */
    int64_t span;        /* (head, query block) pairs per chunk of a key block */
    int64_t tasks, key_blocks, turns, kv_turns, workers, per_worker; /* kv_turns: the cut key blocks' (chunk tasks) */
    int64_t delta, dq32, turns_at, kv_turns_at, kv_sums, slices, floats;
} attention_bwd_plan;

/* The forward's plan is made for the table that runs it (its key block sets the workspace and the sums). */
attention_fwd_plan attention_fwd_plan_make(const attention_kernels *k, const attention_problem *p, int64_t threads);
attention_bwd_plan attention_bwd_plan_make(const attention_problem *p, int64_t threads);
/* Floats of workspace for attention_fwd / attention_bwd under the plan (float64: the oracle's doubles). */
int64_t attention_fwd_workspace(const attention_fwd_plan *plan);
int64_t attention_bwd_workspace(const attention_bwd_plan *plan);
/* The work of a blocks plan's task t (0 <= t < tasks, in the order the workers pull them), in query-key
 * pairs computed: the plan tables' idle shares (benchmarks/plan_table.py) schedule them as the workers
 * do. 0 for another path. */
int64_t attention_fwd_task_cost(const attention_fwd_plan *pl, const attention_problem *p, int64_t t);
int64_t attention_bwd_task_cost(const attention_bwd_plan *pl, const attention_problem *p, int64_t t);
void attention_fwd(const attention_kernels *k, const attention_fwd_plan *plan, const attention_problem *p,
                   float *workspace);
/* Needs p->out and p->lse from attention_fwd, p->dout; writes dq, dk, dv. */
void attention_bwd(const attention_kernels *k, const attention_bwd_plan *plan, const attention_problem *p,
                   float *workspace);

/* The oracle, row by row in double (and the float64 path of the op); any dtype
 * incl. OPF_F64. Its scratch: attention_ref_fwd_doubles / attention_ref_bwd_doubles
 * doubles (the backward's double accumulators of dK and dV among them). */
int64_t attention_ref_fwd_doubles(const attention_problem *p);
int64_t attention_ref_bwd_doubles(const attention_problem *p);
void attention_ref_fwd(const attention_problem *p, double *scratch);
void attention_ref_bwd(const attention_problem *p, double *scratch);

#endif
