/*
 * KV-cache decoding attention (flash-decoding), forward only:
 *     out[b, h, i] = sum_{j < lim(b, i)} softmax_j(scale * q[b, h, i] . k[b, h / g, j]) v[b, h / g, j]
 * q (B, H, N, Dqk): N = 1..16 new tokens per sequence; k (B, Hkv, S_max, Dqk) and v (B, Hkv, S_max, Dv):
 * views of a preallocated cache, any element strides; out (B, H, N, Dv) any strides; g = H / Hkv
 * (grouped-query attention, K/V never repeated). seq_lens (B,) int32 or int64: the keys j < seq_lens[b]
 * of row b are valid, the rest of the cache is never read (a padded cache needs no mask).
 *     lim(b, i) = seq_lens[b]                     without causal
 *     lim(b, i) = seq_lens[b] - N + 1 + i         causal, bottom-right aligned: the N new tokens are
 *                                                 already appended to the cache, query i is the token at
 *                                                 position seq_lens[b] - N + i and sees itself and what
 *                                                 precedes it.
 * A query with no key (seq_lens[b] = 0, or lim <= 0) gives zeros, as a fully masked row of attention.
 *
 * The attention op runs its few-query shapes (decoding without a cache object, cross-attention of a
 * few rows) through the same driver, so it also takes what attention means: no seq_lens (every row
 * has s_max keys), top-left causal (lim(b, i) = min(i + 1, len)), an explicit mask (bool: keep where
 * true; or added to the scores), and the rows' log-sum-exp for the backward.
 *
 * Plan (flash-decoding): the keys of each (batch row, kv head) are cut into chunks of attention_decode_chunk()
 * keys, a function of the shapes and of max(seq_lens) alone, never of the thread count. A task is one
 * (b, kv head, chunk): it reads the chunk's K and V once (16-bit types converted to float32 in registers,
 * or, for a cache with a non-unit element stride, into a buffer a block of ATTENTION_DECODE_BK keys at a time)
 * for all g x N query rows of the group -- the cache is where the bytes
 * are -- and leaves each row's partial softmax state (max m, sum l, unnormalised acc; scores in base 2,
 * or natural under an added mask: u = 1 or log2 e) in the workspace. Tasks are pulled from an atomic
 * counter; the worker that completes a group's last chunk combines each of the group's query rows over
 * its chunks, in chunk order, in float32:
 *     M = max_c m_c,  L = sum_c l_c 2^((m_c - M) u),  out = sum_c acc_c 2^((m_c - M) u) / L
 * so the result is bitwise the same on any thread count.
 */
#ifndef OPFORGE_KERNELS_ATTENTION_DECODE_H
#define OPFORGE_KERNELS_ATTENTION_DECODE_H

#include <stdint.h>

#include "convert.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

/* keys per block inside a task: the scores of a block (rows x ATTENTION_DECODE_BK) and its converted K/V stay in L1/L2 */
#define ATTENTION_DECODE_BK 64
/* Keys ahead whose K (V) rows the scores (P V) kernels prefetch while working on the current ones. A
 * task streams its chunk's K and V from memory, block by block, alternating between the two: the
 * hardware prefetchers alone left a single thread at 40% of the bandwidth a plain read reaches. */
#define ATTENTION_DECODE_PF 24

/* The ISA files instantiate their scores and P V loops once per cache element type, a constant in each:
 * ATTENTION_DECODE_BY_TYPE(dt, fn, args...) calls fn(ATTENTION_DECODE_T_F32 | ATTENTION_DECODE_T_BF16 | ATTENTION_DECODE_T_F16, args...). */
enum { ATTENTION_DECODE_T_F32, ATTENTION_DECODE_T_BF16, ATTENTION_DECODE_T_F16 };
#define ATTENTION_DECODE_BY_TYPE(dt, fn, ...)         \
    do {                                              \
        if ((dt) == OPF_F32)                          \
            fn(ATTENTION_DECODE_T_F32, __VA_ARGS__);  \
        else if ((dt) == OPF_BF16)                    \
            fn(ATTENTION_DECODE_T_BF16, __VA_ARGS__); \
        else                                          \
            fn(ATTENTION_DECODE_T_F16, __VA_ARGS__);  \
    } while (0)

/* the cache lines of n elements of type kt from element `at` of p, into L1 (prefetches never fault) */
static inline __attribute__((always_inline)) void attention_decode_prefetch(const int kt, const void *p, int64_t at,
                                                                            int64_t n) {
    const int64_t size = kt == ATTENTION_DECODE_T_F32 ? 4 : 2;
    const char *c = (const char *)p + at * size;
    for (int64_t b = 0; b < n * size; b += 64) __builtin_prefetch(c + b, 0, 3);
}

/* attention_decode_problem.causal */
enum {
    ATTENTION_DECODE_CAUSAL_NONE = 0,
    ATTENTION_DECODE_CAUSAL_BOTTOM_RIGHT = 1,
    ATTENTION_DECODE_CAUSAL_TOP_LEFT = 2
};
/* attention_decode_problem.mask_kind (the values of attention_mask_kind) */
enum { ATTENTION_DECODE_MASK_NONE = 0, ATTENTION_DECODE_MASK_BOOL = 1, ATTENTION_DECODE_MASK_ADD = 2 };

typedef struct attention_decode_problem {
    int64_t b, h, hkv, n, s_max, d_qk, d_v; /* batch, heads, kv heads, new tokens, cache length, head dims */
    opf_dtype dt;                           /* of q, k, v, out */
    const void *q, *k, *v;
    int64_t qs[4], ks[4], vs[4]; /* element strides (b, h, n|s, d) */
    const void *lens;            /* seq_lens (b,), every value in [0, s_max] (the caller checks); NULL: s_max */
    int lens_i64;                /* 1: int64, 0: int32 */
    int64_t lens_stride;         /* in elements */
    int causal;                  /* ATTENTION_DECODE_CAUSAL_* */
    double scale;                /* exact for the float64 oracle; the float32 kernels round it once */
    const void *mask;            /* NULL, or element (b, h, i, j) at ms (0 where broadcast) */
    int mask_kind;               /* ATTENTION_DECODE_MASK_*: bool (uint8, keep where nonzero) or added (mask_dt) */
    opf_dtype mask_dt;
    int64_t ms[4];
    void *out;
    int64_t os[4];
    float *lse; /* NULL, or (b, h, n) contiguous: each row's log-sum-exp (natural log), -inf with no key */
} attention_decode_problem;

typedef struct attention_decode_kernels {
    OPF_VARIANT_HEAD;
    const convert_kernels *cvt; /* 16-bit rows to and from float32 */
    /* s(i, j) = q_i . k_j for r rows of q (float32, r x d, row stride d) and bk rows of k (row stride ldk
     * elements, unit stride within a row) of type kdt (OPF_F32, OPF_BF16 or OPF_F16: a 16-bit cache is
     * read in place, converted in registers); s is r x bk with row stride lds. Rows up to ATTENTION_DECODE_PF past
     * the block are prefetched: the next block's, read next. */
    void (*scores)(float *s, int64_t lds, const float *q, int64_t r, int64_t d, const void *k, int64_t ldk, int64_t bk,
                   opf_dtype kdt);
    /* One row's online softmax step over x[0..bk), of which x[j < keys] are valid (0 <= keys <= bk), the
     * scores in units where exp = 2^(x unit) (unit 1: base 2, the scale's log2(e) folded into the queries;
     * log2(e): natural, with an added mask, whose float32 lowest would overflow in base 2):
     * m' = max(m, max x); x = 2^((x - m') unit) (0 beyond keys); l = l alpha + sum x; m = m'. Returns
     * alpha = 2^((m - m') unit). While m' is -inf (no key yet) x becomes 0 and alpha 1. */
    float (*softmax_row)(float *x, int64_t bk, int64_t keys, float *m, float *l, float unit);
    /* o (r x dv, row stride dv) = o alpha_i + p v, p r x bk (row stride ldp), v bk x dv (row stride ldv
     * elements, unit stride within a row) of type vdt as for scores; rows up to ATTENTION_DECODE_PF past the block
     * are prefetched */
    void (*pv)(float *o, const float *alpha, const float *p, int64_t ldp, int64_t r, int64_t bk, const void *v,
               int64_t ldv, int64_t dv, opf_dtype vdt);
} attention_decode_kernels;

extern const attention_decode_kernels attention_decode_kernels_ref;
extern const attention_decode_kernels attention_decode_kernels_avx2;   /* attention_decode_avx2.c */
extern const attention_decode_kernels attention_decode_kernels_avx512; /* attention_decode_avx512.c: masked tails */
extern const opf_variants attention_decode_variants;

/* The table for isa (not noted for the log: attention_decode_fwd notes what runs). */
const attention_decode_kernels *attention_decode_kernels_for(opf_isa isa);

static inline int64_t attention_decode_len(const attention_decode_problem *p, int64_t b) {
    if (!p->lens) return p->s_max;
    return p->lens_i64 ? ((const int64_t *)p->lens)[b * p->lens_stride]
                       : (int64_t)((const int32_t *)p->lens)[b * p->lens_stride];
}

/* The keys j < lim of query i of a row with len keys */
static inline int64_t attention_decode_lim(const attention_decode_problem *p, int64_t len, int64_t i) {
    if (p->causal == ATTENTION_DECODE_CAUSAL_BOTTOM_RIGHT) return len - p->n + 1 + i;
    if (p->causal == ATTENTION_DECODE_CAUSAL_TOP_LEFT) return i + 1 < len ? i + 1 : len;
    return len;
}

/* Keys per chunk (a multiple of ATTENTION_DECODE_BK), from the shapes and max(seq_lens) only. */
int64_t attention_decode_chunk(const attention_decode_problem *p);

/* The plan, made once per call at the caller's thread count: the chunks, the tasks and the workers, and
 * the workspace as offsets: the partial (m, l, acc) of every task's rows, an atomic counter per group,
 * then one slice per worker; the one statement of it (attention_decode_workspace sizes with it, attention_decode_fwd carves
 * with it). float64 (ref) runs the oracle on a scratch of doubles in the workspace. */
typedef struct attention_decode_plan {
    int ref;
    int64_t chunk, chunks, tasks, workers, part_floats; /* part_floats: one task's rows, rows x (2 + dv), padded */
    int64_t parts, done, per_worker, slices, floats;    /* offsets of the partials, the groups' counters and
                                                         * the slices; total floats */
    int64_t q32, kbuf, vbuf, s, o, m, l, alpha;         /* offsets within a slice */
} attention_decode_plan;

attention_decode_plan attention_decode_plan_make(const attention_decode_problem *p, int64_t threads);
/* Floats of workspace for attention_decode_fwd under the plan. */
int64_t attention_decode_workspace(const attention_decode_plan *plan);
void attention_decode_fwd(const attention_decode_kernels *k, const attention_decode_plan *plan,
                          const attention_decode_problem *p, float *workspace);

/* The oracle, row by row in double (and the float64 path of the op); any dtype incl. OPF_F64. Its
 * scratch: attention_decode_ref_doubles doubles. */
int64_t attention_decode_ref_doubles(const attention_decode_problem *p);
void attention_decode_ref_fwd(const attention_decode_problem *p, double *scratch);

#endif
