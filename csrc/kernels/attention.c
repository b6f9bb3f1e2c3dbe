/*
 * Attention driver (blocking, masking, threads, dtype conversion). The scalar
 * reference kernels and the double-precision oracle are attention_ref.c.
 * See attention.h. One file past the usual length on purpose: the forward and
 * backward drivers share the block sizes, the workspace carving, the masking
 * of a tile and the packing predicate, and the two layouts are the one
 * statement of the workspace their plans size; the plans' task costs (for the
 * plan tables) read the same task orders the workers pull, so they sit here too,
 * with the backward's cut of key blocks into chunks (its span, its tasks' order,
 * the turns that sum a block's chunks). Moving the backward to a file of its own
 * would need a private header of those shared statics (about 100 lines).
 */
#include "attention.h"

#include "attention_decode.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Query and key blocks (with Dqk = Dv = 64 a block's Q^T, K, V, S^T and O are 16 KiB each: L2-resident).
 * Blocks of 96 measured faster on 2 cores (Zen 4, fwd+bwd against SDPA over twelve shapes, float32 and
 * bfloat16: geomean 1.60x against 1.53x at 64 and 1.51x at 128, bfloat16 gaining most), but they cut
 * the tasks: at 64 threads the default GPT's backward (16 head groups, N = 256) has 48 key-block tasks
 * instead of 64, and one head of N = 1024 across 8 heads 88 instead of 128 (two rounds, 31% idle).
 * The block size sets the sums, so it may depend on the shape but never on the thread count: a
 * per-shape size is left for later, and 64 kept. */
enum { BQ = 64, BK = 64 };

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const attention_kernels attention_kernels_avx2 __attribute__((weak));
extern const attention_kernels attention_kernels_avx512 __attribute__((weak));
extern const attention_kernels attention_kernels_avx512_bf16 __attribute__((weak));
extern const attention_kernels attention_kernels_amx __attribute__((weak));

const opf_variants attention_variants =
    OPF_VARIANTS("attention", &attention_kernels_ref, &attention_kernels_avx2, &attention_kernels_avx512,
                 &attention_kernels_avx512_bf16, &attention_kernels_amx);

/* Not noted for the log here: attention_fwd / attention_bwd note what runs (this table, the oracle for float64, or the
 * decoding driver's table for a few queries). */
const attention_kernels *attention_kernels_for(opf_isa isa) { return opf_variant_best(&attention_variants, isa); }

static void note_pick(const char *name, opf_isa isa) {
    if (opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick(attention_variants.family, name, isa);
}

/* Tile element (i, j) at t[i*ti + j*tj] (queries i0.., keys j0..) becomes
 * scale * t + bias under an explicit mask (and the causal one with it). */
static void apply_mask(const attention_problem *p, float *t, int64_t ti, int64_t tj, int64_t b, int64_t h, int64_t i0,
                       int64_t bq, int64_t j0, int64_t bk) {
    const float scale = (float)p->scale;
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < bk; j++) {
            float *x = &t[i * ti + j * tj];
            float bias = mask_bias(p, b, h, i0 + i, j0 + j);
            *x = bias == -INFINITY ? -INFINITY : *x * scale + bias;
        }
}

/* How the ISA kernels mask a tile: returns the diag argument (keys j > i +
 * diag masked), after applying an explicit mask to the tile (then *scale = 1). */
static inline int64_t tile_diag(const attention_problem *p, float *t, int64_t ti, int64_t tj, int64_t b, int64_t h,
                                int64_t i0, int64_t bq, int64_t j0, int64_t bk, float *scale) {
    *scale = (float)p->scale;
    if (p->mask_kind != ATTENTION_MASK_NONE) {
        apply_mask(p, t, ti, tj, b, h, i0, bq, j0, bk);
        *scale = 1.0f;
        return bk;
    }
    return p->causal && j0 + bk - 1 > i0 ? i0 - j0 : bk; /* only tiles crossing the diagonal */
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round16(int64_t n) { return cdiv(n, 16) * 16; } /* keeps workspace slices 64-byte aligned */

/* The next n floats of a workspace being laid out from offset *at: their offset */
static int64_t carve(int64_t *at, int64_t n) {
    const int64_t offset = *at;
    *at += n;
    return offset;
}

/* workers for a number of tasks at the plan's thread count */
static int64_t workers_for(int64_t tasks, int64_t threads) {
    int64_t w = threads;
    if (w > tasks) w = tasks;
    return w > 0 ? w : 1;
}

/* bfloat16 inputs whose rows are unit-stride, with head dims of one K chunk: the products run on
 * operands packed once (attention_bf16_packing, attention.h) where the table has the packing */
static int packs_shape(const attention_problem *p) {
    return p->dt == OPF_BF16 && p->qs[3] == 1 && p->ks[3] == 1 && p->vs[3] == 1 && p->d_qk <= 2 * ATTENTION_PACK_KP &&
           p->d_v <= 2 * ATTENTION_PACK_KP;
}

_Static_assert((int)BQ <= (int)ATTENTION_PACK_MC && (int)BK <= (int)ATTENTION_PACK_MC,
               "P and dS are packed along their columns");

static const attention_bf16_packing *packing_for(const attention_kernels *k, const attention_problem *p) {
    return packs_shape(p) ? k->packing : NULL;
}

/* words of a packed A along its rows (rows x any k of one chunk), along its columns (k x
 * ATTENTION_PACK_MC), and of a packed B (k x n), K padded as a table may (attention_packed_pairs) */
static int64_t packed_a_rows(int64_t rows) { return rows * ATTENTION_PACK_KP; }
static int64_t packed_a_cols(int64_t k) { return attention_packed_pairs(k) * ATTENTION_PACK_MC; }
static int64_t packed_b(int64_t k, int64_t n) { return cdiv(n, 32) * attention_packed_pairs(k) * 32; }

/* Rows i0 .. i0 + rows of head (b, h) of x (strides st), cols elements of each from element d0, in float32:
 * where they are (float32, unit-stride rows), else staged in buf (rows x cols); *ld is their row stride */
static const float *rows_f32(const attention_kernels *k, float *buf, const void *x, const int64_t *st, opf_dtype dt,
                             int64_t b, int64_t h, int64_t i0, int64_t d0, int64_t rows, int64_t cols, int64_t *ld) {
    if (dt == OPF_F32 && st[3] == 1) {
        *ld = st[2];
        return (const float *)x + off4(st, b, h, i0, d0);
    }
    for (int64_t i = 0; i < rows; i++) load_row(k->cvt, buf + i * cols, x, off4(st, b, h, i0 + i, d0), st[3], cols, dt);
    *ld = cols;
    return buf;
}

/* ---- forward ------------------------------------------------------------------------------- */

/* Split-K. A task is one query block of one head while there are enough of
 * them; with fewer than FWD_MIN_TASKS (one head of a single query block against
 * many keys, say) each query block's keys (under a causal mask: those it sees)
 * are cut into chunks of whole key blocks, as many as bring the tasks up to
 * FWD_MIN_TASKS. A chunk's task leaves its unnormalised O, running max m and
 * sum l in a slot; the task that completes a query block's last chunk merges
 * its chunks in chunk order, 0, 1, 2, ..., in float32. Whether and how finely
 * to split depends on the shape alone, never on the thread count: the same
 * sums, so the same bits, on any number of threads.
 * FWD_MIN_TASKS = 2, measured on 2 cores (AVX2): a lone query block of 64
 * queries against 512-4096 keys runs 1.4-1.7x faster in 2 chunks, while
 * cutting shapes that already have 2 or 4 tasks into more chunks than there
 * are cores costs 6-25% (a chunk re-reads Q^T, and its slot is written and
 * merged: ~2.5 us against ~14 us per 64 x 64 key block, D = 64), so a larger
 * minimum pays only on machines with more cores. (Under a causal mask a lone
 * query block sees at most BQ keys: at 2, only shapes without it split.) */
/* Fewer query blocks (of all heads, times their key chunks) than threads: the blocks are cut to 32 rows,
 * then to FWD_MIN_QROWS, while that leaves threads idle and adds blocks. Unlike the key split this may
 * depend on the thread count: a query's row of S, its softmax and its row of P V are computed over the
 * same key blocks whatever block holds the query (under a causal mask a shorter block's last key block
 * ends at its diagonal: the keys left off are masked ones, whose zero terms add nothing), so the bits
 * are the same on any thread count (test_attention, test_sweep and test_thread_sweep compare them).
 * Measured on the Xeon with AMX (2 threads, float32): one head of N = 64, D = 64 ran on one thread in
 * 16.1 us against F.scaled_dot_product_attention's 12.4 us (its blocks of 32 queries on both threads). */
enum { FWD_MIN_QROWS = 16 };

/* Up to this many tasks per thread, the forward's tasks are pulled query block by query block across
 * the heads (the most work first under a causal mask, all of the heads' last blocks before any head's
 * first), else head by head but for the last `threads` heads, which are pulled block by block across
 * them. Head by head, each head's few blocks of unequal work leave threads idle at the end: the default
 * GPT's causal forward (4 blocks a head) left 17% of 64 threads idle, and 5% of 16 with 16 tasks a
 * thread; the tail of heads block by block evens the threads out (0% in both, by the plan table's
 * pulling). With many tasks per thread the heads' order keeps each head's K and V in cache across its
 * blocks: block by block throughout ran 0.83-0.94x as fast on 2 threads at B4 H8 N1024 and B1 H8 N4096. */
enum { FWD_BY_BLOCK_TASKS = 8 };

#ifndef ATTENTION_FWD_MIN_TASKS /* the C tests also build with a larger one, to split (almost) every shape */
#define ATTENTION_FWD_MIN_TASKS 2
#endif
enum { FWD_MIN_TASKS = ATTENTION_FWD_MIN_TASKS };

/* Packed bf16 operands: each key block's K (as A rows) and V (as B) are packed once, up front, in a
 * prologue shared by all threads, where a block is read by more than one task (several query blocks, or
 * the query heads of a group) and all of them take at most FWD_PACKED_KV_MAX words (64 MiB; a key's K
 * row takes ATTENTION_PACK_KP words whatever D, its V row about its bfloat16 size); a task then packs
 * only a block it cuts short (a causal diagonal). The same packing calls on the same rows, so the same
 * words and bits as packing per task. On the Xeon with AMX (2 threads, bf16 forward, both in one
 * process): 1.08-1.33x without a causal mask (most at D = 128, and with grouped heads), 1.03-1.19x
 * causal; the AVX512-BF16 table (its own key blocks of 64) 0.98-1.04x, within noise. */
enum { FWD_PACKED_KV_MAX = 1 << 24 };

/* The keys query block i0.. (bq queries) sees: 0 .. kend */
static int64_t fwd_kend(const attention_problem *p, int64_t i0, int64_t bq) {
    return p->causal ? (p->s < i0 + bq ? p->s : i0 + bq) : p->s;
}

/* A forward worker's slice of the workspace, as offsets: the one statement of
 * it (blocks_plan sizes with it, fwd_task carves with it) */
typedef struct fwd_layout {
    int64_t qt, kbuf, vbuf, st, o, m, l, alpha;
    int64_t pq, pk, pp, pv; /* packed (packs_shape): Q^T as B, the K block as A, P as A, the V block as B */
    int64_t floats;
} fwd_layout;

static fwd_layout fwd_layout_for(const attention_problem *p, int64_t bk) {
    const int64_t d_qk = p->d_qk, d_v = p->d_v;
    fwd_layout lay;
    int64_t at = 0;
    lay.qt = carve(&at, d_qk * BQ);   /* Q^T of the block */
    lay.kbuf = carve(&at, bk * d_qk); /* K (first Q) and V rows in float32, when not read in place */
    lay.vbuf = carve(&at, bk * d_v);
    lay.st = carve(&at, bk * BQ); /* S^T, then P^T */
    lay.o = carve(&at, BQ * d_v); /* O, unnormalised (split: the merged chunks) */
    lay.m = carve(&at, BQ);       /* the online softmax's running max, sum and rescale */
    lay.l = carve(&at, BQ);
    lay.alpha = carve(&at, BQ);
    const int packed = packs_shape(p); /* uint32 words, a float's size each */
    lay.pq = carve(&at, packed ? round16(packed_b(d_qk, BQ)) : 0);
    lay.pk = carve(&at, packed ? round16(packed_a_rows(bk)) : 0);
    lay.pp = carve(&at, packed ? round16(packed_a_cols(bk)) : 0);
    lay.pv = carve(&at, packed ? round16(packed_b(bk, d_v)) : 0);
    lay.floats = round16(at);
    return lay;
}

/* Keys per block: the table's for its products (attention.h: fwd_bk, fwd_bk_plain), but float32 products
 * keep BK where the keys are split into chunks (fewer query blocks than FWD_MIN_TASKS): a chunk is whole
 * key blocks, and blocks of 64 even the chunks out (S = 300 in two chunks: 192 and 108 keys, where blocks
 * of 256 would give 256 and 44). By the shape alone, as the split. */
static int64_t fwd_bk(const attention_kernels *k, const attention_problem *p) {
    if (attention_mm_for(k, p) != k->mm) return k->fwd_bk ? k->fwd_bk : BK;
    if (p->b * p->h * cdiv(p->n, BQ) < FWD_MIN_TASKS) return BK;
    return k->fwd_bk_plain ? k->fwd_bk_plain : BK;
}

/* The query blocks' plan (attention_fwd_plan in attention.h) */
static attention_fwd_plan blocks_plan(const attention_kernels *k, const attention_problem *p, int64_t threads) {
    attention_fwd_plan pl = {.path = ATTENTION_PATH_BLOCKS,
                             .qrows = BQ,
                             .nqb = cdiv(p->n, BQ),
                             .bk = fwd_bk(k, p),
                             .chunks = 1,
                             .span = p->s};
    pl.blocks = p->b * p->h * pl.nqb;
    const int64_t kb = cdiv(p->causal && p->n < p->s ? p->n : p->s, pl.bk); /* key blocks of the last query block */
    if (pl.blocks > 0 && pl.blocks < FWD_MIN_TASKS && kb >= 2) {
        const int64_t want = cdiv(FWD_MIN_TASKS, pl.blocks), per = cdiv(kb, want < kb ? want : kb);
        pl.span = per * pl.bk;
        pl.chunks = cdiv(kb, per);
    }
    /* fewer tasks than threads: query blocks of 32, then 16 rows, each size taken if it adds blocks */
    for (int64_t qr = BQ / 2; qr >= FWD_MIN_QROWS && pl.blocks > 0 && pl.blocks * pl.chunks < threads; qr /= 2)
        if (cdiv(p->n, qr) > pl.nqb) {
            pl.qrows = qr;
            pl.nqb = cdiv(p->n, qr);
            pl.blocks = p->b * p->h * pl.nqb;
        }
    pl.tasks = pl.blocks * pl.chunks;
    const int64_t heads = p->b * p->h;
    pl.tail_heads = pl.tasks <= FWD_BY_BLOCK_TASKS * threads || heads < threads ? heads : threads;
    const int split = pl.chunks > 1;
    pl.rows = p->n < pl.qrows ? p->n : pl.qrows;
    pl.slot_floats = split ? round16(pl.rows * (p->d_v + 2)) : 0;
    pl.per_worker = fwd_layout_for(p, pl.bk).floats;
    const int64_t kv_blocks = p->b * p->hkv * cdiv(p->s, pl.bk);
    if (packing_for(k, p) && (p->n > BQ || p->h > p->hkv)) { /* a block of K and V is read by several tasks */
        const int64_t words = round16(packed_a_rows(pl.bk)) + round16(packed_b(pl.bk, p->d_v));
        if (kv_blocks * words <= FWD_PACKED_KV_MAX) pl.kv_words = words;
    }
    int64_t at = 0;
    pl.slots = carve(&at, pl.tasks * pl.slot_floats);
    pl.counts = carve(&at, split ? round16(2 * pl.blocks) : 0);
    pl.workers = workers_for(pl.tasks, threads);
    pl.slices = carve(&at, pl.workers * pl.per_worker);
    pl.packed_kv = carve(&at, kv_blocks * pl.kv_words);
    pl.floats = at;
    return pl;
}

/* Few queries (N <= FWD_DECODE_MAX_N: decoding a token or a few against the keys so far, with no cache
 * object; cross-attention of a few rows) run through the flash-decoding driver of attention_decode.c:
 * its task is a chunk of one key/value head's keys for all H / Hkv x N query rows that read it, where
 * a query block here would hold N of its 64 rows and each query head would re-read the same K and V.
 * Measured on 2 cores (AVX2), float32, against this file's blocks: N = 1 1.1-6.7x, N = 2 1.3-3.9x,
 * N = 4 1.2-4.1x faster (B = 1-4, H = 8-32, Hkv = 8, D = 64-128, S = 16-4096); at N = 8 between 0.66x
 * and 1.44x, at N = 16 mostly slower (0.54-1.18x), where the blocks' register tiles fill.
 * The decode driver takes attention's meaning: all S keys, top-left causal, the explicit mask, lse. */
enum { FWD_DECODE_MAX_N = 4 };

static int fwd_as_decode(const attention_problem *p) {
    return p->n >= 1 && p->n <= FWD_DECODE_MAX_N && p->s > 0 && p->b > 0 && p->h > 0 && p->d_qk > 0 && p->d_v > 0;
}

static attention_decode_problem attention_decode_for(const attention_problem *p) {
    attention_decode_problem d = {.b = p->b,
                                  .h = p->h,
                                  .hkv = p->hkv,
                                  .n = p->n,
                                  .s_max = p->s,
                                  .d_qk = p->d_qk,
                                  .d_v = p->d_v,
                                  .dt = p->dt,
                                  .q = p->q,
                                  .k = p->k,
                                  .v = p->v,
                                  .lens = NULL,
                                  .causal = p->causal ? ATTENTION_DECODE_CAUSAL_TOP_LEFT : ATTENTION_DECODE_CAUSAL_NONE,
                                  .scale = p->scale,
                                  .mask = p->mask_kind == ATTENTION_MASK_NONE ? NULL : p->mask,
                                  .mask_kind = p->mask_kind == ATTENTION_MASK_BOOL  ? ATTENTION_DECODE_MASK_BOOL
                                               : p->mask_kind == ATTENTION_MASK_ADD ? ATTENTION_DECODE_MASK_ADD
                                                                                    : ATTENTION_DECODE_MASK_NONE,
                                  .mask_dt = p->mask_dt,
                                  .out = p->out,
                                  .lse = p->lse};
    for (int i = 0; i < 4; i++) d.qs[i] = p->qs[i], d.ks[i] = p->ks[i], d.vs[i] = p->vs[i], d.ms[i] = p->ms[i];
    for (int i = 0; i < 4; i++) d.os[i] = p->os[i];
    return d;
}

attention_fwd_plan attention_fwd_plan_make(const attention_kernels *k, const attention_problem *p, int64_t threads) {
    if (p->dt == OPF_F64)
        return (attention_fwd_plan){.path = ATTENTION_PATH_REF, .floats = 2 * attention_ref_fwd_doubles(p)};
    if (fwd_as_decode(p)) {
        const attention_decode_problem d = attention_decode_for(p);
        attention_fwd_plan pl = {.path = ATTENTION_PATH_DECODE, .decode = attention_decode_plan_make(&d, threads)};
        pl.floats = attention_decode_workspace(&pl.decode);
        return pl;
    }
    return blocks_plan(k, p, threads);
}

int64_t attention_fwd_workspace(const attention_fwd_plan *plan) { return plan->floats; }

typedef struct fwd_ctx {
    const attention_kernels *k;
    const attention_problem *p;
    attention_fwd_plan pl;
    float *ws, *slots;
    uint32_t *packed_kv;  /* pl.kv_words per key block, blocks of (b, key/value head) in order */
    atomic_llong *counts; /* chunks of each query block finished */
    atomic_llong next;
} fwd_ctx;

/* Query block qb of head bh: merge its nch chunk slots, in chunk order, into out and lse. */
static void fwd_merge(const fwd_ctx *c, int64_t bh, int64_t qb, int64_t nch, float *ws) {
    const attention_problem *p = c->p;
    const int64_t d_v = p->d_v, rows = c->pl.rows, b = bh / p->h, h = bh % p->h, qr = c->pl.qrows;
    const int64_t i0 = qb * qr, bq = p->n - i0 < qr ? p->n - i0 : qr;
    const float *slot0 = c->slots + (bh * c->pl.nqb + qb) * c->pl.chunks * c->pl.slot_floats;
    float *restrict o = ws + fwd_layout_for(p, c->pl.bk).o;
    for (int64_t i = 0; i < bq; i++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t ch = 0; ch < nch; ch++) mx = fmaxf(mx, slot0[ch * c->pl.slot_floats + rows * d_v + i]);
        for (int64_t d = 0; d < d_v; d++) o[d] = 0.0f;
        for (int64_t ch = 0; ch < nch; ch++) {
            const float *restrict slot = slot0 + ch * c->pl.slot_floats, *restrict oc = slot + i * d_v;
            const float m = slot[rows * d_v + i], l = slot[rows * d_v + rows + i];
            const float f = m == -INFINITY ? 0.0f : expf(m - mx); /* a chunk with no key for the row: 0 */
            sum += f * l;
            for (int64_t d = 0; d < d_v; d++) o[d] += f * oc[d];
        }
        const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
        for (int64_t d = 0; d < d_v; d++) o[d] *= inv;
        store_row(c->k->cvt, p->out, off4(p->os, b, h, i0 + i, 0), p->os[3], o, d_v, p->dt);
        p->lse[bh * p->n + i0 + i] = sum == 0.0f ? -INFINITY : mx + logf(sum);
    }
}

/* Key block kb of key/value head bkv (b * hkv + head): its packed K, then its packed V */
static uint32_t *packed_kv_at(const fwd_ctx *c, int64_t bkv, int64_t kb) {
    return c->packed_kv + (bkv * cdiv(c->p->s, c->pl.bk) + kb) * c->pl.kv_words;
}

static int64_t packed_v_offset(const fwd_ctx *c) { return round16(packed_a_rows(c->pl.bk)); }

/* The prologue: key blocks [t0, t1) of all (b, key/value head), each as long as the keys left */
static void fwd_pack_kv(int64_t t0, int64_t t1, void *arg) {
    const fwd_ctx *c = arg;
    const attention_problem *p = c->p;
    const attention_bf16_packing *pk = c->k->packing;
    const int64_t nkb = cdiv(p->s, c->pl.bk);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t bkv = t / nkb, kb = t % nkb, b = bkv / p->hkv, kvh = bkv % p->hkv, j0 = kb * c->pl.bk;
        const int64_t bk = p->s - j0 < c->pl.bk ? p->s - j0 : c->pl.bk;
        uint32_t *at = packed_kv_at(c, bkv, kb);
        pk->a_rows16(at, (const uint16_t *)p->k + off4(p->ks, b, kvh, j0, 0), p->ks[2], bk, p->d_qk);
        pk->b16(at + packed_v_offset(c), (const uint16_t *)p->v + off4(p->vs, b, kvh, j0, 0), p->vs[2], bk, p->d_v);
    }
}

/* Query block qb of head bh, chunk ch of its keys (the whole block unless split) */
static void fwd_task(const fwd_ctx *c, int64_t bh, int64_t qb, int64_t ch, float *ws) {
    const attention_kernels *k = c->k;
    const attention_problem *p = c->p;
    const attention_mm_fn mm = attention_mm_for(k, p);
    const int64_t d_qk = p->d_qk, d_v = p->d_v, b = bh / p->h, h = bh % p->h, kvh = h / (p->h / p->hkv);
    const int64_t qr = c->pl.qrows, i0 = qb * qr, bq = p->n - i0 < qr ? p->n - i0 : qr, kend = fwd_kend(p, i0, bq);
    const int64_t jbeg = ch * c->pl.span, jend = kend - jbeg < c->pl.span ? kend : jbeg + c->pl.span;
    if (ch > 0 && jbeg >= kend) return; /* this block sees fewer keys than the most */
    const int split = c->pl.chunks > 1;
    const fwd_layout lay = fwd_layout_for(p, c->pl.bk);
    float *qt = ws + lay.qt, *kbuf = ws + lay.kbuf, *vbuf = ws + lay.vbuf, *st = ws + lay.st, *o = ws + lay.o;
    float *m = ws + lay.m, *l = ws + lay.l, *alpha = ws + lay.alpha;
    if (split) { /* O, m and l in the chunk's slot */
        o = c->slots + ((bh * c->pl.nqb + qb) * c->pl.chunks + ch) * c->pl.slot_floats;
        m = o + c->pl.rows * d_v;
        l = m + c->pl.rows;
    }
    const attention_bf16_packing *pk = packing_for(k, p);
    uint32_t *pq = (uint32_t *)(ws + lay.pq), *pkb = (uint32_t *)(ws + lay.pk), *pp = (uint32_t *)(ws + lay.pp),
             *pv = (uint32_t *)(ws + lay.pv);
    const int f32 = p->dt == OPF_F32;
    if (pk) { /* Q^T of the block as packed pairs, once for all its key blocks */
        pk->bt16(pq, (const uint16_t *)p->q + off4(p->qs, b, h, i0, 0), p->qs[2], d_qk, bq);
    } else { /* Q^T of the block in float32, from Q's rows (staged in kbuf where they must be) */
        int64_t ldq;
        const float *qrows = rows_f32(k, kbuf, p->q, p->qs, p->dt, b, h, i0, 0, bq, d_qk, &ldq);
        k->transpose(qt, BQ, qrows, ldq, bq, d_qk);
    }
    for (int64_t i = 0; i < bq; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(o, 0, sizeof(float) * (size_t)(bq * d_v));
    for (int64_t j0 = jbeg; j0 < jend; j0 += c->pl.bk) {
        const int64_t bk = jend - j0 < c->pl.bk ? jend - j0 : c->pl.bk;
        /* S^T (bk x bq) = K_block Q^T: K rows are read in place in float32 */
        const float *ka = kbuf;
        int64_t rsk = d_qk, csk = 1;
        /* the block packed up front, unless this task cuts it short */
        const uint32_t *kvp = c->pl.kv_words && (bk == c->pl.bk || j0 + bk == p->s)
                                  ? packed_kv_at(c, b * p->hkv + kvh, j0 / c->pl.bk)
                                  : NULL;
        if (pk) {
            if (!kvp) pk->a_rows16(pkb, (const uint16_t *)p->k + off4(p->ks, b, kvh, j0, 0), p->ks[2], bk, d_qk);
            pk->mm(bk, bq, d_qk, kvp ? kvp : pkb, 1, pq, st, BQ, 0);
        } else {
            if (f32) {
                ka = (const float *)p->k + off4(p->ks, b, kvh, j0, 0);
                rsk = p->ks[2], csk = p->ks[3];
            } else {
                for (int64_t j = 0; j < bk; j++)
                    load_row(k->cvt, kbuf + j * d_qk, p->k, off4(p->ks, b, kvh, j0 + j, 0), p->ks[3], d_qk, p->dt);
            }
            mm(bk, bq, d_qk, ka, rsk, csk, qt, BQ, st, BQ, 0);
        }
        float scale;
        const int64_t diag = tile_diag(p, st, 1, BQ, b, h, i0, bq, j0, bk, &scale);
        k->softmax_cols(st, BQ, bk, bq, scale, m, l, alpha, diag);
        if (j0 > jbeg) k->scale_rows(o, d_v, o, d_v, bq, d_v, alpha); /* O is still zero on the first */
        /* O (bq x Dv) += P V_block, P(i, j) = st[j*BQ + i] */
        if (pk) {
            pk->a_cols32(pp, st, BQ, bq, bk);
            if (!kvp) pk->b16(pv, (const uint16_t *)p->v + off4(p->vs, b, kvh, j0, 0), p->vs[2], bk, d_v);
            pk->mm(bq, d_v, bk, pp, 0, kvp ? kvp + packed_v_offset(c) : pv, o, d_v, 1);
            continue;
        }
        int64_t ldv;
        const float *vb = rows_f32(k, vbuf, p->v, p->vs, p->dt, b, kvh, j0, 0, bk, d_v, &ldv);
        mm(bq, d_v, bk, st, 1, BQ, vb, ldv, o, d_v, 1);
    }
    if (split) { /* the last chunk of the block to finish merges them (the atomic orders the slots' writes) */
        const int64_t nch = cdiv(kend, c->pl.span);
        if (atomic_fetch_add(&c->counts[bh * c->pl.nqb + qb], 1) == nch - 1) fwd_merge(c, bh, qb, nch, ws);
        return;
    }
    for (int64_t i = 0; i < bq; i++) {
        alpha[i] = l[i] == 0.0f ? 0.0f : 1.0f / l[i]; /* a NaN score keeps the row NaN */
        p->lse[bh * p->n + i0 + i] = l[i] == 0.0f ? -INFINITY : m[i] + logf(l[i]);
    }
    if (f32 && p->os[3] == 1) { /* normalised straight into out's rows */
        k->scale_rows((float *)p->out + off4(p->os, b, h, i0, 0), p->os[2], o, d_v, bq, d_v, alpha);
        return;
    }
    k->scale_rows(o, d_v, o, d_v, bq, d_v, alpha);
    for (int64_t i = 0; i < bq; i++)
        store_row(k->cvt, p->out, off4(p->os, b, h, i0 + i, 0), p->os[3], o + i * d_v, d_v, p->dt);
}

/* The forward's task t, in the order the workers pull them: head by head, so that a head's K and V stay
 * in cache across its query blocks; within a head the last blocks first: under a causal mask they are
 * the most work, and the cheap ones at the end even out the threads; a block's chunks in order. The last
 * plan.tail_heads heads (all of them with a few tasks per thread) go block by block across them, their
 * last blocks first (FWD_BY_BLOCK_TASKS). */
static void fwd_task_at(const attention_fwd_plan *pl, int64_t t, int64_t *bh, int64_t *qb, int64_t *ch) {
    const int64_t per_head = pl->nqb * pl->chunks, first_tail = pl->blocks / pl->nqb - pl->tail_heads;
    if (t < first_tail * per_head) {
        const int64_t r = t % per_head;
        *bh = t / per_head, *qb = pl->nqb - 1 - r / pl->chunks, *ch = r % pl->chunks;
        return;
    }
    t -= first_tail * per_head;
    const int64_t per_block = pl->tail_heads * pl->chunks, r = t % per_block;
    *qb = pl->nqb - 1 - t / per_block, *bh = first_tail + r / pl->chunks, *ch = r % pl->chunks;
}

static void fwd_worker(int64_t w0, int64_t w1, void *arg) {
    fwd_ctx *c = arg;
    for (int64_t w = w0; w < w1; w++) {
        float *ws = c->ws + w * c->pl.per_worker;
        for (;;) {
            int64_t t = atomic_fetch_add(&c->next, 1), bh, qb, ch;
            if (t >= c->pl.tasks) break;
            fwd_task_at(&c->pl, t, &bh, &qb, &ch);
            fwd_task(c, bh, qb, ch, ws);
        }
    }
}

int64_t attention_fwd_task_cost(const attention_fwd_plan *pl, const attention_problem *p, int64_t t) {
    if (pl->path != ATTENTION_PATH_BLOCKS || t < 0 || t >= pl->tasks) return 0;
    int64_t bh, qb, ch;
    fwd_task_at(pl, t, &bh, &qb, &ch);
    const int64_t i0 = qb * pl->qrows, bq = p->n - i0 < pl->qrows ? p->n - i0 : pl->qrows, kend = fwd_kend(p, i0, bq);
    const int64_t jbeg = ch * pl->span, jend = kend - jbeg < pl->span ? kend : jbeg + pl->span;
    return jend > jbeg ? bq * (jend - jbeg) : 0;
}

void attention_fwd(const attention_kernels *k, const attention_fwd_plan *plan, const attention_problem *p,
                   float *workspace) {
    if (plan->path == ATTENTION_PATH_REF) {
        note_pick("ref_f64", OPF_ISA_REF);
        attention_ref_fwd(p, (double *)(void *)workspace);
        return;
    }
    if (plan->path == ATTENTION_PATH_DECODE) {
        const attention_decode_problem d = attention_decode_for(p);
        attention_decode_fwd(attention_decode_kernels_for(k->isa), &plan->decode, &d, workspace);
        return;
    }
    note_pick(k->name, k->isa);
    fwd_ctx c = {.k = k, .p = p, .pl = *plan};
    if (c.pl.tasks == 0) return;
    c.ws = workspace + c.pl.slices;
    c.slots = workspace + c.pl.slots;
    c.counts = (atomic_llong *)(workspace + c.pl.counts);
    c.packed_kv = (uint32_t *)(workspace + c.pl.packed_kv);
    if (c.pl.chunks > 1)
        for (int64_t i = 0; i < c.pl.blocks; i++) atomic_init(&c.counts[i], 0);
    atomic_init(&c.next, 0);
    if (c.pl.kv_words) opf_parallel_for(0, p->b * p->hkv * cdiv(p->s, c.pl.bk), 1, fwd_pack_kv, &c);
    opf_parallel_for(0, c.pl.workers, 1, fwd_worker, &c);
}

/* ---- backward ------------------------------------------------------------------------------ */

/* dQ takes dS K of each key block in key-block order, whatever the thread
 * count, so it is bitwise the same run to run and on any number of threads.
 * With enough head groups for every thread a task is a whole group: its
 * worker walks the key blocks in order and accumulates straight into dQ.
 * With fewer (e.g. batch x heads = 1) a task is one key block, tasks are taken
 * in key order, and each query block of each head has a turn: the number of
 * key blocks added into its dQ rows. A task adds its dS K into a query block's
 * rows when the turn is its key block's, then passes the turn on. Workers on
 * neighbouring key blocks thus walk the query blocks one step apart: the one
 * behind waits once, for one block's dQ product, then finds its turns come.
 * No dQ copy is kept per task: a ring of per-task dQ slots (the previous
 * scheme) let a worker run further ahead of a preempted one, but its slots,
 * a head group's whole dQ each, made the backward of one long head take twice
 * the memory of PyTorch's, and the adds ran on one thread at a time. Turns
 * need BQ == BK: key block kb's first query (causal) starts query block kb. */
_Static_assert(BQ == BK, "the backward's per-query-block turns need query and key blocks of one size");

/* A task per head group when there are enough groups for every thread: decided by the plan, once per call */
static int whole_groups(const attention_problem *p, int64_t threads) { return p->b * p->hkv >= 2 * threads; }

/* Too few key-block tasks (the head groups times their key blocks) for 64 threads, or blocks of unequal
 * work (a causal mask: key block kb is seen by the query blocks from kb on), leave threads idle: the default
 * GPT's causal backward (16 groups of 4 key blocks, 4, 3, 2 and 1 query blocks each) left 38% of 64
 * threads idle. Below BWD_MIN_TASKS such tasks, each key block's (head, query block) pairs, in the order
 * its task walks them (head by head, query blocks in order), are cut into chunks of span pairs, the largest
 * span (at least BWD_MIN_SPAN) that makes BWD_MIN_TASKS chunk tasks. A chunk's dK and dV are added into its
 * key block's float32 sums in chunk order: chunk 0 sets them, each next one adds its own, the last one adds
 * them into its own and stores (one float addition each, which commutes), so the block's sums are
 * ((p0 + p1) + p2) + ..., the same bits on any thread count and in a whole group's task, which runs the
 * chunks one after another. By the shape alone, never the thread count. BWD_MIN_SPAN = 2: a chunk task
 * stages its key block's K^T and V^T itself (~1-2 us a block, against ~35 us per pair on a core) and moves
 * its dK and dV through the sums. */
enum { BWD_MIN_TASKS = 256, BWD_MIN_SPAN = 2 };

/* The first query that sees key block kb: under a causal mask, none before its first key. */
static int64_t first_query(const attention_problem *p, int64_t kb) { return p->causal ? kb * BK : 0; }

/* The (head, query block) pairs of key block kb of one head group: its g heads times the query blocks that see it */
static int64_t kb_pairs(const attention_problem *p, int64_t kb) {
    const int64_t q0 = first_query(p, kb);
    return q0 < p->n && p->hkv > 0 ? p->h / p->hkv * cdiv(p->n - q0, BQ) : 0;
}

/* Chunks of key block kb (one where it has no pair) */
static int64_t kb_chunks(const attention_problem *p, int64_t span, int64_t kb) {
    const int64_t pairs = kb_pairs(p, kb);
    return pairs > span ? cdiv(pairs, span) : 1;
}

/* Chunk tasks of one head group */
static int64_t group_chunks(const attention_problem *p, int64_t span, int64_t key_blocks) {
    int64_t n = 0;
    for (int64_t kb = 0; kb < key_blocks; kb++) n += kb_chunks(p, span, kb);
    return n;
}

/* Pairs per chunk: the most a key block has (key block 0's: no cut) with BWD_MIN_TASKS key-block tasks,
 * else as many chunks as the largest span at least BWD_MIN_SPAN that makes BWD_MIN_TASKS chunk tasks (else
 * BWD_MIN_SPAN's), in the smallest span that makes as many: the chunks as even as a span makes them (16
 * pairs in 2 chunks are 8 and 8, not 15 and 1). The chunk tasks fall as the span grows. */
static int64_t bwd_span(const attention_problem *p, int64_t key_blocks) {
    const int64_t groups = p->b * p->hkv;
    if (groups == 0 || key_blocks == 0) return 1;
    const int64_t most = kb_pairs(p, 0) > 1 ? kb_pairs(p, 0) : 1;
    if (groups * key_blocks >= BWD_MIN_TASKS || most <= BWD_MIN_SPAN) return most;
    int64_t lo = BWD_MIN_SPAN, hi = most;
    if (groups * group_chunks(p, lo, key_blocks) < BWD_MIN_TASKS) return lo;
    while (lo < hi) { /* the largest span with BWD_MIN_TASKS chunk tasks */
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (groups * group_chunks(p, mid, key_blocks) >= BWD_MIN_TASKS)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int64_t chunks = group_chunks(p, lo, key_blocks);
    hi = lo, lo = BWD_MIN_SPAN;
    while (lo < hi) { /* the smallest span with no more chunks */
        const int64_t mid = lo + (hi - lo) / 2;
        if (group_chunks(p, mid, key_blocks) <= chunks)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* A backward worker's slice of the workspace, as offsets: the one statement
 * of it (attention_bwd_plan_make sizes with it, bwd_task carves with it) */
typedef struct bwd_worker_layout {
    int64_t kt, vt, kr, dk, dv, qr, dor, scores, dp;
    /* packed (packs_shape): K^T, V^T and K as B (once per key block); Q and dO rows as A, dO and Q as B,
     * P^T or dS^T and dS as A (per query block) */
    int64_t pkt, pvt, pk, pqa, pdoa, pdob, pqb, pcols, pdsa;
    int64_t sums; /* a whole group's task: the float32 dK and dV sums of the key block whose chunks it runs */
    int64_t floats;
} bwd_worker_layout;

static bwd_worker_layout bwd_worker_layout_for(const attention_problem *p, int sums) {
    const int64_t d_qk = p->d_qk, d_v = p->d_v;
    bwd_worker_layout lay;
    int64_t at = 0;
    lay.kt = carve(&at, d_qk * BK); /* K^T, V^T and the K rows (when not read in place) of the key block */
    lay.vt = carve(&at, d_v * BK);
    lay.kr = carve(&at, BK * d_qk);
    lay.dk = carve(&at, BK * d_qk); /* the block's dK and dV, accumulated (dV first stages V's rows) */
    lay.dv = carve(&at, BK * d_v);
    lay.qr = carve(&at, BQ * d_qk);    /* Q and dO rows of a query block, when not read in place */
    lay.dor = carve(&at, BQ * d_v);    /* packed: dO rows in 16 bits where its rows are not unit-stride */
    lay.scores = carve(&at, BQ * BK);  /* S, then P */
    lay.dp = carve(&at, BQ * BK);      /* dP, then dS */
    const int packed = packs_shape(p); /* uint32 words, a float's size each */
    lay.pkt = carve(&at, packed ? round16(packed_b(d_qk, BK)) : 0);
    lay.pvt = carve(&at, packed ? round16(packed_b(d_v, BK)) : 0);
    lay.pk = carve(&at, packed ? round16(packed_b(BK, d_qk)) : 0);
    lay.pqa = carve(&at, packed ? round16(packed_a_rows(BQ)) : 0);
    lay.pdoa = carve(&at, packed ? round16(packed_a_rows(BQ)) : 0);
    lay.pdob = carve(&at, packed ? round16(packed_b(BQ, d_v)) : 0);
    lay.pqb = carve(&at, packed ? round16(packed_b(BQ, d_qk)) : 0);
    lay.pcols = carve(&at, packed ? round16(packed_a_cols(BQ)) : 0);
    lay.pdsa = carve(&at, packed ? round16(packed_a_rows(BQ)) : 0);
    lay.sums = carve(&at, sums ? BK * (d_qk + d_v) : 0);
    lay.floats = round16(at);
    return lay;
}

/* float32 dQ is accumulated in place when its rows are unit-stride (the block matmul's C) */
static int dq_in_place(const attention_problem *p) { return p->dt == OPF_F32 && p->dqs[3] == 1; }

/* and a cut key block's dK and dV sums (chunk tasks) are kept in float32 dK and dV with unit-stride rows */
static int kv_in_place(const attention_problem *p) { return p->dt == OPF_F32 && p->dks[3] == 1 && p->dvs[3] == 1; }

/* The backward's workspace (attention_bwd_plan in attention.h): the one statement
 * of it, attention_bwd_workspace sizes with it, attention_bwd carves with it. The query
 * blocks of all heads have a turn each with chunk tasks, and so do the key blocks of all
 * groups where a key block is cut; their sums are then the plan's (chunk tasks) or the
 * worker's (a whole group's task). */
attention_bwd_plan attention_bwd_plan_make(const attention_problem *p, int64_t threads) {
    if (p->dt == OPF_F64)
        return (attention_bwd_plan){.path = ATTENTION_PATH_REF, .floats = 2 * attention_ref_bwd_doubles(p)};
    attention_bwd_plan pl = {
        .path = ATTENTION_PATH_BLOCKS, .whole = whole_groups(p, threads), .key_blocks = cdiv(p->s, BK)};
    const int64_t groups = p->b * p->hkv;
    pl.span = bwd_span(p, pl.key_blocks);
    pl.cut = groups > 0 && pl.key_blocks > 0 && kb_pairs(p, 0) > pl.span;
    pl.tasks = pl.whole ? groups : groups * group_chunks(p, pl.span, pl.key_blocks);
    pl.turns = pl.whole || pl.tasks == 0 ? 0 : p->b * p->h * cdiv(p->n, BQ);
    pl.kv_turns = pl.cut && !pl.whole ? groups * pl.key_blocks : 0;
    pl.workers = workers_for(pl.tasks, threads);
    pl.per_worker = bwd_worker_layout_for(p, pl.cut && pl.whole).floats;
    int64_t at = 0;
    pl.delta = carve(&at, round16(p->b * p->h * p->n));
    pl.dq32 = dq_in_place(p) ? -1 : carve(&at, round16(p->b * p->h * p->n * p->d_qk));
    pl.turns_at = carve(&at, round16(2 * pl.turns));
    pl.kv_turns_at = carve(&at, round16(2 * pl.kv_turns));
    pl.kv_sums = carve(&at, kv_in_place(p) ? 0 : pl.kv_turns * BK * (p->d_qk + p->d_v));
    pl.slices = carve(&at, pl.workers * pl.per_worker);
    pl.floats = at;
    return pl;
}

int64_t attention_bwd_workspace(const attention_bwd_plan *plan) { return plan->floats; }

typedef struct bwd_ctx {
    const attention_kernels *k;
    const attention_problem *p;
    float *delta, *dq32, *ws;
    float *kv_sums;  /* chunk tasks: per (group, key block), its dK and dV sums over the chunks so far */
    int kv_in_place; /* chunk tasks: those sums kept in dK and dV themselves (float32 rows) */
    int64_t dq32s[4];
    int64_t per_worker, tasks, nkb, span;
    int whole;    /* a task per head group (the plan's) */
    int in_place; /* dQ accumulated in p->dq itself */
    atomic_llong next;
    atomic_llong *turns;    /* per (b, h, query block): key blocks added into its dQ rows */
    atomic_llong *kv_turns; /* chunk tasks: per (group, key block), its chunks added into its sums */
    pthread_mutex_t lock;   /* guards waiting; a worker waiting for a turn sleeps on moved */
    pthread_cond_t moved;
    int64_t waiting;
} bwd_ctx;

/* The backward's chunk task t, in the order the workers pull them: key block by key block, within a key
 * block chunk by chunk, across the head groups. Under a causal mask the first key blocks are the most work
 * (every later query sees them): they start first, and the short ones even out the threads. A task waits
 * only for its group's earlier key blocks (its turns to add into dQ) and its key block's earlier chunks
 * (its turn to add into the block's sums), which start before it, and seldom long: the block before it
 * started alongside the blocks of other groups, not just ahead of it. (Group by group, the default GPT's
 * backward left 17% of 16 threads idle, and one batch of 1-2 key/value heads ran 0-5% slower on 2
 * threads.) */
static void bwd_task_at(const attention_problem *p, int64_t span, int64_t t, int64_t *grp, int64_t *kb, int64_t *ch) {
    const int64_t groups = p->b * p->hkv;
    int64_t k = 0;
    for (int64_t n; t >= (n = groups * kb_chunks(p, span, k));) t -= n, k++;
    *kb = k, *ch = t / groups, *grp = t % groups;
}

/* The pairs of chunk ch of key block kb: e0 .. e1 */
static void chunk_pairs(const attention_problem *p, int64_t span, int64_t kb, int64_t ch, int64_t *e0, int64_t *e1) {
    const int64_t pairs = kb_pairs(p, kb);
    *e0 = pairs > span ? ch * span : 0;
    *e1 = pairs > span && *e0 + span < pairs ? *e0 + span : pairs;
}

/* Query-key pairs of chunk ch of key block kb: the query rows of its (head, query block) pairs times its keys */
static int64_t chunk_cost(const attention_problem *p, int64_t span, int64_t kb, int64_t ch) {
    const int64_t j0 = kb * BK, bk = p->s - j0 < BK ? p->s - j0 : BK, q0 = first_query(p, kb);
    if (q0 >= p->n) return 0;
    const int64_t nq = cdiv(p->n - q0, BQ);
    int64_t e0, e1, rows = 0;
    chunk_pairs(p, span, kb, ch, &e0, &e1);
    for (int64_t e = e0; e < e1; e++) {
        const int64_t i0 = q0 + e % nq * BQ;
        rows += p->n - i0 < BQ ? p->n - i0 : BQ;
    }
    return rows * bk;
}

int64_t attention_bwd_task_cost(const attention_bwd_plan *pl, const attention_problem *p, int64_t t) {
    if (pl->path != ATTENTION_PATH_BLOCKS || t < 0 || t >= pl->tasks) return 0;
    if (!pl->whole) {
        int64_t grp, kb, ch;
        bwd_task_at(p, pl->span, t, &grp, &kb, &ch);
        return chunk_cost(p, pl->span, kb, ch);
    }
    int64_t cost = 0;
    for (int64_t kb = 0; kb < pl->key_blocks; kb++)
        for (int64_t ch = 0; ch < kb_chunks(p, pl->span, kb); ch++) cost += chunk_cost(p, pl->span, kb, ch);
    return cost;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A turn is usually a block product away: spin for about that long before sleeping (waking a
 * sleeping thread costs more than the wait itself on a busy or virtual machine). */
enum { TURN_SPINS = 2000 };

static void wait_turn(bwd_ctx *c, atomic_llong *turn, int64_t kb) {
    for (int i = 0; i < TURN_SPINS; i++) {
        if (atomic_load_explicit(turn, memory_order_acquire) == kb) return;
        cpu_relax();
    }
    pthread_mutex_lock(&c->lock);
    c->waiting++;
    while (atomic_load_explicit(turn, memory_order_acquire) != kb) pthread_cond_wait(&c->moved, &c->lock);
    c->waiting--;
    pthread_mutex_unlock(&c->lock);
}

/* The store is seen by a waiter either before it sleeps (it checks under the lock) or on the broadcast. */
static void pass_turn(bwd_ctx *c, atomic_llong *turn, int64_t kb) {
    atomic_store_explicit(turn, kb + 1, memory_order_release);
    pthread_mutex_lock(&c->lock);
    if (c->waiting) pthread_cond_broadcast(&c->moved);
    pthread_mutex_unlock(&c->lock);
}

/* Query block i0.. (bq queries) of head h against key block kb (j0.., bk keys), on packed operands: the
 * products of the block loop in bwd_task, the same sums in the same order */
static void bwd_packed_block(bwd_ctx *c, const attention_bf16_packing *pk, int64_t b, int64_t h, int64_t i0, int64_t bq,
                             int64_t kb, int64_t j0, int64_t bk, float *ws, const bwd_worker_layout *lay, float *dq,
                             int64_t lddq) {
    const attention_kernels *k = c->k;
    const attention_problem *p = c->p;
    const int64_t d_qk = p->d_qk, d_v = p->d_v, bh = b * p->h + h;
    float *scores = ws + lay->scores, *dp = ws + lay->dp, *dk = ws + lay->dk, *dv = ws + lay->dv;
    uint32_t *pkt = (uint32_t *)(ws + lay->pkt), *pvt = (uint32_t *)(ws + lay->pvt), *pkr = (uint32_t *)(ws + lay->pk);
    uint32_t *pqa = (uint32_t *)(ws + lay->pqa), *pdoa = (uint32_t *)(ws + lay->pdoa);
    uint32_t *pdob = (uint32_t *)(ws + lay->pdob), *pqb = (uint32_t *)(ws + lay->pqb);
    uint32_t *pcols = (uint32_t *)(ws + lay->pcols), *pdsa = (uint32_t *)(ws + lay->pdsa);
    const uint16_t *q = (const uint16_t *)p->q + off4(p->qs, b, h, i0, 0);
    const uint16_t *dout = (const uint16_t *)p->dout + off4(p->dos, b, h, i0, 0);
    int64_t ldo = p->dos[2];
    if (p->dos[3] != 1) { /* a gradient whose rows are not unit-stride (an expanded one): the block's rows copied */
        uint16_t *rows = (uint16_t *)(void *)(ws + lay->dor);
        for (int64_t i = 0; i < bq; i++)
            for (int64_t d = 0; d < d_v; d++) rows[i * d_v + d] = dout[i * p->dos[2] + d * p->dos[3]];
        dout = rows, ldo = d_v;
    }
    pk->a_rows16(pqa, q, p->qs[2], bq, d_qk);
    pk->a_rows16(pdoa, dout, ldo, bq, d_v);
    pk->mm(bq, bk, d_qk, pqa, 1, pkt, scores, BK, 0); /* S = Q K^T */
    float scale;
    const int64_t diag = tile_diag(p, scores, BK, 1, b, h, i0, bq, j0, bk, &scale);
    k->probs(scores, BK, bq, bk, scale, p->lse + bh * p->n + i0, diag);             /* P */
    pk->mm(bq, bk, d_v, pdoa, 1, pvt, dp, BK, 0);                                   /* dP = dO V^T */
    k->dscores(dp, scores, BK, bq, bk, c->delta + bh * p->n + i0, (float)p->scale); /* dS */
    pk->a_cols32(pcols, scores, BK, bk, bq);
    pk->b16(pdob, dout, ldo, bq, d_v);
    pk->mm(bk, d_v, bq, pcols, 0, pdob, dv, d_v, 1); /* dV += P^T dO */
    pk->a_cols32(pcols, dp, BK, bk, bq);
    pk->b16(pqb, q, p->qs[2], bq, d_qk);
    pk->mm(bk, d_qk, bq, pcols, 0, pqb, dk, d_qk, 1); /* dK += dS^T Q */
    pk->a_rows32(pdsa, dp, BK, bq, bk);
    atomic_llong *turn = c->turns ? &c->turns[bh * cdiv(p->n, BQ) + i0 / BQ] : NULL;
    if (turn) wait_turn(c, turn, kb);
    pk->mm(bq, d_qk, bk, pdsa, 1, pkr, dq, lddq, 1); /* dQ += dS K */
    if (turn) pass_turn(c, turn, kb);
}

/* A worker's staged key block: which (group x key blocks + key block) its workspace holds (K^T, V^T,
 * the K rows; packed: their packed pairs), and where its float32 K rows are */
typedef struct bwd_staged {
    int64_t block;
    const float *krow;
    int64_t ldk;
} bwd_staged;

/* rows x cols floats of x (rows ldx apart) into sums (rows lds apart): chunk 0's copied, a middle chunk's
 * added into them, the last chunk's sums added into x (one float addition either way) */
static void add_rows(float *sums, int64_t lds, float *x, int64_t ldx, int64_t rows, int64_t cols, int64_t ch,
                     int64_t nch) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = sums + r * lds, *y = x + r * ldx;
        if (ch == 0)
            memcpy(s, y, sizeof(float) * (size_t)cols);
        else if (ch < nch - 1)
            for (int64_t i = 0; i < cols; i++) s[i] += y[i];
        else
            for (int64_t i = 0; i < cols; i++) y[i] += s[i];
    }
}

/* Chunk ch of nch of cut key block kb (bk keys) of group grp: its dK and dV (dk, dv) into the block's sums,
 * in chunk order (their turn: chunks added; a whole group's task runs the chunks in order and keeps the
 * sums in its slice). Chunk tasks keep them in dK and dV themselves where those are float32 rows (the last
 * chunk overwrites them with the block's values), else in the plan's. The last chunk leaves the block's dK
 * and dV in dk and dv. */
static void add_chunk(bwd_ctx *c, const bwd_worker_layout *lay, float *ws, int64_t grp, int64_t kb, int64_t bk,
                      int64_t ch, int64_t nch, float *dk, float *dv) {
    const attention_problem *p = c->p;
    const int64_t d_qk = p->d_qk, d_v = p->d_v, block = grp * c->nkb + kb, b = grp / p->hkv, kvh = grp % p->hkv;
    float *sk = c->whole ? ws + lay->sums : c->kv_sums + block * BK * (d_qk + d_v), *sv = sk + BK * d_qk;
    int64_t ldk = d_qk, ldv = d_v;
    if (!c->whole && c->kv_in_place) {
        sk = (float *)p->dk + off4(p->dks, b, kvh, kb * BK, 0), ldk = p->dks[2];
        sv = (float *)p->dv + off4(p->dvs, b, kvh, kb * BK, 0), ldv = p->dvs[2];
    }
    atomic_llong *turn = c->whole ? NULL : &c->kv_turns[block];
    if (turn) wait_turn(c, turn, ch);
    add_rows(sk, ldk, dk, d_qk, bk, d_qk, ch, nch);
    add_rows(sv, ldv, dv, d_v, bk, d_v, ch, nch);
    if (turn) pass_turn(c, turn, ch);
}

/* Chunk ch of key block kb of head group grp (the whole block unless cut): dK and dV of its keys over the
 * chunk's (head, query block) pairs, stored by the block's last chunk; dS K into dQ, by turns when c->turns */
static void bwd_task(bwd_ctx *c, int64_t grp, int64_t kb, int64_t ch, float *ws, bwd_staged *st) {
    const attention_kernels *k = c->k;
    const attention_problem *p = c->p;
    const attention_mm_fn mm = attention_mm_for(k, p);
    const int64_t d_qk = p->d_qk, d_v = p->d_v, g = p->h / p->hkv, b = grp / p->hkv, kvh = grp % p->hkv;
    const int64_t j0 = kb * BK, bk = p->s - j0 < BK ? p->s - j0 : BK, nch = kb_chunks(p, c->span, kb);
    const bwd_worker_layout lay = bwd_worker_layout_for(p, c->whole);
    float *kt = ws + lay.kt, *vt = ws + lay.vt, *kr = ws + lay.kr, *dk = ws + lay.dk, *dv = ws + lay.dv;
    float *qr = ws + lay.qr, *dor = ws + lay.dor, *scores = ws + lay.scores, *dp = ws + lay.dp;
    const int64_t qstart = first_query(p, kb), nq = qstart < p->n ? cdiv(p->n - qstart, BQ) : 0;
    int64_t e0, e1;
    chunk_pairs(p, c->span, kb, ch, &e0, &e1);
    const attention_bf16_packing *pk = packing_for(k, p);
    uint32_t *pkt = (uint32_t *)(ws + lay.pkt), *pvt = (uint32_t *)(ws + lay.pvt), *pkr = (uint32_t *)(ws + lay.pk);
    const int64_t block = grp * c->nkb + kb;
    if (e0 < e1 && st->block != block) { /* the block staged once for all its query blocks in this workspace */
        st->block = block, st->krow = kr, st->ldk = d_qk;
        if (pk) { /* K^T, V^T and K of the block as packed pairs */
            const uint16_t *kb16 = (const uint16_t *)p->k + off4(p->ks, b, kvh, j0, 0);
            pk->bt16(pkt, kb16, p->ks[2], d_qk, bk);
            pk->bt16(pvt, (const uint16_t *)p->v + off4(p->vs, b, kvh, j0, 0), p->vs[2], d_v, bk);
            pk->b16(pkr, kb16, p->ks[2], bk, d_qk);
        } else { /* K rows (read in place, or staged in kr), K^T and V^T of the block, float32 (V's rows staged in dv) */
            st->krow = rows_f32(k, kr, p->k, p->ks, p->dt, b, kvh, j0, 0, bk, d_qk, &st->ldk);
            k->transpose(kt, BK, st->krow, st->ldk, bk, d_qk);
            int64_t ldv;
            const float *vrows = rows_f32(k, dv, p->v, p->vs, p->dt, b, kvh, j0, 0, bk, d_v, &ldv);
            k->transpose(vt, BK, vrows, ldv, bk, d_v);
        }
    }
    const float *krow = st->krow;
    const int64_t ldk = st->ldk;
    memset(dk, 0, sizeof(float) * (size_t)(BK * d_qk));
    memset(dv, 0, sizeof(float) * (size_t)(BK * d_v));
    for (int64_t e = e0; e < e1; e++) { /* head by head, query blocks in order */
        const int64_t h = kvh * g + e / nq, bh = b * p->h + h, i0 = qstart + e % nq * BQ;
        float *dqh = c->dq32 + off4(c->dq32s, b, h, 0, 0);
        const int64_t lddq = c->dq32s[2];
        const int64_t bq = p->n - i0 < BQ ? p->n - i0 : BQ;
        if (pk) {
            bwd_packed_block(c, pk, b, h, i0, bq, kb, j0, bk, ws, &lay, dqh + i0 * lddq, lddq);
            continue;
        }
        int64_t ldq, lddo;
        const float *q = rows_f32(k, qr, p->q, p->qs, p->dt, b, h, i0, 0, bq, d_qk, &ldq);
        const float *dout = rows_f32(k, dor, p->dout, p->dos, p->dt, b, h, i0, 0, bq, d_v, &lddo);
        mm(bq, bk, d_qk, q, ldq, 1, kt, BK, scores, BK, 0); /* S = Q K^T */
        float scale;
        const int64_t diag = tile_diag(p, scores, BK, 1, b, h, i0, bq, j0, bk, &scale);
        k->probs(scores, BK, bq, bk, scale, p->lse + bh * p->n + i0, diag);             /* P */
        mm(bq, bk, d_v, dout, lddo, 1, vt, BK, dp, BK, 0);                              /* dP = dO V^T */
        k->dscores(dp, scores, BK, bq, bk, c->delta + bh * p->n + i0, (float)p->scale); /* dS */
        mm(bk, d_v, bq, scores, 1, BK, dout, lddo, dv, d_v, 1);                         /* dV += P^T dO */
        mm(bk, d_qk, bq, dp, 1, BK, q, ldq, dk, d_qk, 1);                               /* dK += dS^T Q */
        atomic_llong *turn = c->turns ? &c->turns[bh * cdiv(p->n, BQ) + i0 / BQ] : NULL;
        if (turn) wait_turn(c, turn, kb);
        mm(bq, d_qk, bk, dp, BK, 1, krow, ldk, dqh + i0 * lddq, lddq, 1); /* dQ += dS K */
        if (turn) pass_turn(c, turn, kb);
    }
    if (nch > 1) {
        add_chunk(c, &lay, ws, grp, kb, bk, ch, nch, dk, dv);
        if (ch < nch - 1) return;
    }
    for (int64_t j = 0; j < bk; j++) {
        store_row(k->cvt, p->dk, off4(p->dks, b, kvh, j0 + j, 0), p->dks[3], dk + j * d_qk, d_qk, p->dt);
        store_row(k->cvt, p->dv, off4(p->dvs, b, kvh, j0 + j, 0), p->dvs[3], dv + j * d_v, d_v, p->dt);
    }
}

/* heads bh0..bh1: zero dQ's float32 accumulator, delta[i] = sum_d dO[i, d] out[i, d]
 * (the rows converted to float32 64 elements at a time, summed in 8 float lanes, then the lanes in order) */
static void rows_in(const bwd_ctx *c, int64_t bh0, int64_t bh1) {
    const attention_problem *p = c->p;
    float dor[64], outr[64];
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / p->h, h = bh % p->h;
        for (int64_t i = 0; i < p->n; i++) {
            float *dq = c->dq32 + off4(c->dq32s, b, h, i, 0);
            if (c->dq32s[3] == 1)
                memset(dq, 0, sizeof(float) * (size_t)p->d_qk);
            else
                for (int64_t d = 0; d < p->d_qk; d++) dq[d * c->dq32s[3]] = 0.0f;
            float lanes[8] = {0};
            for (int64_t e0 = 0; e0 < p->d_v; e0 += 64) {
                const int64_t n = p->d_v - e0 < 64 ? p->d_v - e0 : 64;
                int64_t ld;
                const float *x = rows_f32(c->k, dor, p->dout, p->dos, p->dt, b, h, i, e0, 1, n, &ld);
                const float *y = rows_f32(c->k, outr, p->out, p->os, p->dt, b, h, i, e0, 1, n, &ld);
                int64_t e = 0;
                for (; e + 8 <= n; e += 8)
                    for (int l = 0; l < 8; l++) lanes[l] += x[e + l] * y[e + l];
                for (; e < n; e++) lanes[e % 8] += x[e] * y[e];
            }
            float sum = 0.0f;
            for (int l = 0; l < 8; l++) sum += lanes[l];
            c->delta[bh * p->n + i] = sum;
        }
    }
}

/* heads bh0..bh1: dQ from its float32 accumulator (when not accumulated in place) */
static void rows_out(const bwd_ctx *c, int64_t bh0, int64_t bh1) {
    const attention_problem *p = c->p;
    for (int64_t bh = bh0; bh < bh1; bh++)
        for (int64_t i = 0; i < p->n; i++)
            store_row(c->k->cvt, p->dq, off4(p->dqs, bh / p->h, bh % p->h, i, 0), p->dqs[3],
                      c->dq32 + (bh * p->n + i) * p->d_qk, p->d_qk, p->dt);
}

static void bwd_prologue(int64_t bh0, int64_t bh1, void *arg) { rows_in(arg, bh0, bh1); }
static void bwd_epilogue(int64_t bh0, int64_t bh1, void *arg) { rows_out(arg, bh0, bh1); }

/* A whole group's task also does its heads' rows_in and rows_out (its heads, b x H + kvh x g .. + g,
 * are nobody else's), so the backward is one parallel region: each region waits for every thread. */
static void bwd_worker(int64_t w0, int64_t w1, void *arg) {
    bwd_ctx *c = arg;
    const attention_problem *p = c->p;
    const int64_t g = p->hkv ? p->h / p->hkv : 0;
    for (int64_t w = w0; w < w1; w++) {
        float *ws = c->ws + w * c->per_worker;
        bwd_staged st = {.block = -1};
        for (int64_t t; (t = atomic_fetch_add(&c->next, 1)) < c->tasks;) {
            if (!c->whole) {
                int64_t grp, kb, ch;
                bwd_task_at(p, c->span, t, &grp, &kb, &ch);
                bwd_task(c, grp, kb, ch, ws, &st);
                continue;
            }
            const int64_t bh0 = t / p->hkv * p->h + t % p->hkv * g;
            rows_in(c, bh0, bh0 + g);
            for (int64_t kb = 0; kb < c->nkb; kb++)
                for (int64_t ch = 0; ch < kb_chunks(p, c->span, kb); ch++) bwd_task(c, t, kb, ch, ws, &st);
            if (!c->in_place) rows_out(c, bh0, bh0 + g);
        }
    }
}

void attention_bwd(const attention_kernels *k, const attention_bwd_plan *plan, const attention_problem *p,
                   float *workspace) {
    if (plan->path == ATTENTION_PATH_REF) {
        note_pick("ref_f64", OPF_ISA_REF);
        attention_ref_bwd(p, (double *)(void *)workspace);
        return;
    }
    note_pick(k->name, k->isa);
    bwd_ctx c = {.k = k,
                 .p = p,
                 .per_worker = plan->per_worker,
                 .tasks = plan->tasks,
                 .nkb = plan->key_blocks,
                 .span = plan->span,
                 .whole = plan->whole};
    const int in_place = plan->dq32 < 0;
    c.in_place = in_place;
    c.delta = workspace + plan->delta;
    if (in_place) {
        c.dq32 = p->dq;
        memcpy(c.dq32s, p->dqs, sizeof c.dq32s);
    } else {
        c.dq32 = workspace + plan->dq32;
        int64_t st[4] = {p->h * p->n * p->d_qk, p->n * p->d_qk, p->d_qk, 1};
        memcpy(c.dq32s, st, sizeof st);
    }
    const int64_t turns = plan->turns;
    c.turns = turns ? (atomic_llong *)(void *)(workspace + plan->turns_at) : NULL;
    for (int64_t i = 0; i < turns; i++) atomic_init(&c.turns[i], 0);
    c.kv_turns = plan->kv_turns ? (atomic_llong *)(void *)(workspace + plan->kv_turns_at) : NULL;
    for (int64_t i = 0; i < plan->kv_turns; i++) atomic_init(&c.kv_turns[i], 0);
    c.kv_sums = workspace + plan->kv_sums;
    c.kv_in_place = kv_in_place(p);
    c.ws = workspace + plan->slices;
    atomic_init(&c.next, 0);
    pthread_mutex_init(&c.lock, NULL);
    pthread_cond_init(&c.moved, NULL);
    if (!c.whole) opf_parallel_for(0, p->b * p->h, 1, bwd_prologue, &c);
    if (c.tasks > 0) opf_parallel_for(0, plan->workers, 1, bwd_worker, &c);
    if (!in_place && !c.whole) opf_parallel_for(0, p->b * p->h, 1, bwd_epilogue, &c);
    pthread_cond_destroy(&c.moved);
    pthread_mutex_destroy(&c.lock);
}
