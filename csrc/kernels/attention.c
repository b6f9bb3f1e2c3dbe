/*
 * Attention driver (blocking, masking, threads, dtype conversion), the scalar
 * reference kernels and the double-precision oracle. See attention.h.
 */
#include "attention.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* query and key block sizes: with D = Dv = 64 a block's Q^T, K, V, S^T and O
 * are 16 KiB each (L2-resident) */
enum { BQ = 64, BK = 64 };

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const attn_kernels attn_kernels_avx2 __attribute__((weak));

const opf_variants attn_variants = OPF_VARIANTS("attention", &attn_kernels_ref, &attn_kernels_avx2);

const attn_kernels *attn_kernels_for(opf_isa isa) { return opf_variant_pick(&attn_variants, isa); }

/* ---- scalar reference kernels ------------------------------------------------------------ */

static void mm_ref(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t ldb, float *c, int64_t ldc, int acc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int64_t p = 0; p < k; p++) sum += a[i * rsa + p * csa] * b[p * ldb + j];
            c[i * ldc + j] = acc ? c[i * ldc + j] + sum : sum;
        }
}

static void softmax_cols_ref(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l,
                             float *alpha, int64_t diag) {
    for (int64_t i = 0; i < bq; i++) {
        const int64_t keys = bk < i + diag + 1 ? bk : (i + diag + 1 > 0 ? i + diag + 1 : 0); /* unmasked: j < keys */
        float mx = m[i];
        for (int64_t j = 0; j < keys; j++) mx = fmaxf(mx, st[j * ld + i] * scale);
        float base = mx == -INFINITY ? 0.0f : mx, sum = 0.0f;
        for (int64_t j = 0; j < bk; j++) {
            float e = j < keys ? expf(st[j * ld + i] * scale - base) : 0.0f;
            st[j * ld + i] = e;
            sum += e;
        }
        alpha[i] = expf(m[i] - base);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mx;
    }
}

static void probs_ref(float *s, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse, int64_t diag) {
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < bk; j++)
            s[i * ld + j] = lse[i] == -INFINITY || j > i + diag ? 0.0f : expf(s[i * ld + j] * scale - lse[i]);
}

static void dscores_ref(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *di, float scale) {
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < bk; j++) dp[i * ld + j] = p[i * ld + j] * (dp[i * ld + j] - di[i]) * scale;
}

const attn_kernels attn_kernels_ref = {.name = "ref", .isa = OPF_ISA_REF, .cvt = &cvt_kernels_ref, .mm = mm_ref,
                                       .softmax_cols = softmax_cols_ref, .probs = probs_ref,
                                       .dscores = dscores_ref};

/* ---- element access ---------------------------------------------------------------------- */

static inline int64_t off4(const int64_t *st, int64_t b, int64_t h, int64_t i, int64_t d) {
    return b * st[0] + h * st[1] + i * st[2] + d * st[3];
}

/* n elements from src[off + e*stride] into float32 dst */
static void load_row(const attn_kernels *k, float *dst, const void *src, int64_t off, int64_t stride, int64_t n,
                     opf_dtype dt) {
    if (dt != OPF_F32 && stride == 1) {
        k->cvt->to_f32(dst, (const uint16_t *)src + off, dt, n);
        return;
    }
    for (int64_t e = 0; e < n; e++) dst[e] = (float)opf_load_elem(src, off + e * stride, dt);
}

static void store_row(const attn_kernels *k, void *dst, int64_t off, int64_t stride, const float *src, int64_t n,
                      opf_dtype dt) {
    if (dt != OPF_F32 && stride == 1) {
        k->cvt->from_f32((uint16_t *)dst + off, src, dt, n);
        return;
    }
    for (int64_t e = 0; e < n; e++) opf_store_elem(dst, off + e * stride, dt, src[e]);
}

/* The mask's verdict on query i, key j: -inf (masked out), or what to add. */
static inline float mask_bias(const attn_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (p->causal && j > i) return -INFINITY;
    if (p->mask_kind == ATTN_MASK_NONE) return 0.0f;
    int64_t o = off4(p->ms, b, h, i, j);
    if (p->mask_kind == ATTN_MASK_BOOL) return ((const uint8_t *)p->mask)[o] ? 0.0f : -INFINITY;
    return (float)opf_load_elem(p->mask, o, p->mask_dt);
}

/* Tile element (i, j) at t[i*ti + j*tj] (queries i0.., keys j0..) becomes
 * scale * t + bias under an explicit mask (and the causal one with it). */
static void apply_mask(const attn_problem *p, float *t, int64_t ti, int64_t tj, int64_t b, int64_t h, int64_t i0,
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
static inline int64_t tile_diag(const attn_problem *p, float *t, int64_t ti, int64_t tj, int64_t b, int64_t h,
                                int64_t i0, int64_t bq, int64_t j0, int64_t bk, float *scale) {
    *scale = (float)p->scale;
    if (p->mask_kind != ATTN_MASK_NONE) {
        apply_mask(p, t, ti, tj, b, h, i0, bq, j0, bk);
        *scale = 1.0f;
        return bk;
    }
    return p->causal && j0 + bk - 1 > i0 ? i0 - j0 : bk; /* only tiles crossing the diagonal */
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round16(int64_t n) { return cdiv(n, 16) * 16; } /* keeps workspace slices 64-byte aligned */

static int64_t workers_for(int64_t tasks) {
    int64_t w = opf_num_threads();
    if (w > tasks) w = tasks;
    return w > 0 ? w : 1;
}

/* ---- forward ------------------------------------------------------------------------------- */

static int64_t fwd_tasks(const attn_problem *p) { return p->b * p->h * cdiv(p->n, BQ); }

static int64_t fwd_worker_floats(const attn_problem *p) {
    int64_t wide = p->d > p->dv ? p->d : p->dv;
    return round16(p->d * BQ + BK * p->d + BK * p->dv + BK * BQ + BQ * p->dv + 3 * BQ + wide);
}

int64_t attn_fwd_workspace(const attn_problem *p) { return workers_for(fwd_tasks(p)) * fwd_worker_floats(p); }

typedef struct fwd_ctx {
    const attn_kernels *k;
    const attn_problem *p;
    float *ws;
    int64_t per_worker, tasks, nqb;
    atomic_llong next;
} fwd_ctx;

static void fwd_task(const attn_kernels *k, const attn_problem *p, int64_t qb, int64_t bh, float *ws) {
    const int64_t D = p->d, DV = p->dv, b = bh / p->h, h = bh % p->h, kvh = h / (p->h / p->hkv);
    const int64_t i0 = qb * BQ, bq = p->n - i0 < BQ ? p->n - i0 : BQ;
    float *qt = ws, *kbuf = qt + D * BQ, *vbuf = kbuf + BK * D, *st = vbuf + BK * DV, *o = st + BK * BQ;
    float *m = o + BQ * DV, *l = m + BQ, *alpha = l + BQ, *row = alpha + BQ;
    for (int64_t i = 0; i < bq; i++) { /* Q^T of the block, float32 */
        load_row(k, row, p->q, off4(p->qs, b, h, i0 + i, 0), p->qs[3], D, p->dt);
        for (int64_t d = 0; d < D; d++) qt[d * BQ + i] = row[d];
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(BQ * DV));
    const int64_t kend = p->causal ? (p->s < i0 + bq ? p->s : i0 + bq) : p->s;
    const int f32 = p->dt == OPF_F32;
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int64_t bk = kend - j0 < BK ? kend - j0 : BK;
        /* S^T (bk x bq) = K_block Q^T: K rows are read in place in float32 */
        const float *ka = kbuf;
        int64_t rsk = D, csk = 1;
        if (f32) {
            ka = (const float *)p->k + off4(p->ks, b, kvh, j0, 0);
            rsk = p->ks[2], csk = p->ks[3];
        } else {
            for (int64_t j = 0; j < bk; j++) load_row(k, kbuf + j * D, p->k, off4(p->ks, b, kvh, j0 + j, 0), p->ks[3], D, p->dt);
        }
        k->mm(bk, bq, D, ka, rsk, csk, qt, BQ, st, BQ, 0);
        float scale;
        const int64_t diag = tile_diag(p, st, 1, BQ, b, h, i0, bq, j0, bk, &scale);
        k->softmax_cols(st, BQ, bk, bq, scale, m, l, alpha, diag);
        for (int64_t i = 0; i < bq; i++)
            if (alpha[i] != 1.0f)
                for (int64_t d = 0; d < DV; d++) o[i * DV + d] *= alpha[i];
        /* O (bq x Dv) += P V_block, P(i, j) = st[j*BQ + i] */
        const float *vb = vbuf;
        int64_t ldv = DV;
        if (f32 && p->vs[3] == 1) {
            vb = (const float *)p->v + off4(p->vs, b, kvh, j0, 0);
            ldv = p->vs[2];
        } else {
            for (int64_t j = 0; j < bk; j++) load_row(k, vbuf + j * DV, p->v, off4(p->vs, b, kvh, j0 + j, 0), p->vs[3], DV, p->dt);
        }
        k->mm(bq, DV, bk, st, 1, BQ, vb, ldv, o, DV, 1);
    }
    for (int64_t i = 0; i < bq; i++) {
        const float inv = l[i] == 0.0f ? 0.0f : 1.0f / l[i]; /* a NaN score keeps the row NaN */
        for (int64_t d = 0; d < DV; d++) o[i * DV + d] *= inv;
        store_row(k, p->out, off4(p->os, b, h, i0 + i, 0), p->os[3], o + i * DV, DV, p->dt);
        p->lse[bh * p->n + i0 + i] = l[i] == 0.0f ? -INFINITY : m[i] + logf(l[i]);
    }
}

static void fwd_worker(int64_t w0, int64_t w1, void *arg) {
    fwd_ctx *c = arg;
    for (int64_t w = w0; w < w1; w++) {
        float *ws = c->ws + w * c->per_worker;
        for (;;) {
            int64_t t = atomic_fetch_add(&c->next, 1);
            if (t >= c->tasks) break;
            /* head by head, so that a head's K and V stay in cache across its
             * query blocks; within a head the last blocks first: under a
             * causal mask they are the most work, and the cheap ones at the
             * end even out the threads */
            fwd_task(c->k, c->p, c->nqb - 1 - t % c->nqb, t / c->nqb, ws);
        }
    }
}

void attn_fwd(const attn_kernels *k, const attn_problem *p, float *workspace) {
    fwd_ctx c = {k, p, workspace, fwd_worker_floats(p), fwd_tasks(p), cdiv(p->n, BQ), 0};
    if (c.tasks == 0) return;
    opf_parallel_for(0, workers_for(c.tasks), 1, fwd_worker, &c);
}

/* ---- backward ------------------------------------------------------------------------------ */

/* dQ takes dS K of each key block in key-block order, whatever the thread
 * count, so it is bitwise the same run to run and on any number of threads.
 * With enough head groups for every thread a task is a whole group: its
 * worker walks the key blocks in order and accumulates straight into dQ.
 * With fewer (e.g. batch x heads = 1) a task is one key block and tasks are
 * taken in key order: a task that finds every earlier one added into dQ adds
 * straight into it too; any other writes its dS K into its slot of a ring, and
 * whoever completes the oldest outstanding task adds the completed slots into
 * dQ in task order. Both orders give the same sums. A slot costs one pass over
 * a head group's dQ rows per key block (against 10 x 64 flops per element for
 * the block: 0.3-2% of the backward on 2 cores, measured), and a task waits
 * only when it is a whole ring ahead of the oldest: unlike lock-step schemes,
 * a thread that loses its core holds the others up only after the ring is
 * full. The adds run on one thread at a time, so on many cores (~16 and more
 * busy on one head group) they would bound the backward: adding by query
 * block behind per-block turns would spread them. */
/* Decided once per call, on the calling thread (workers may see another thread count). */
static int whole_groups(const attn_problem *p) { return p->b * p->hkv >= 2 * (int64_t)opf_num_threads(); }

static int64_t bwd_tasks(const attn_problem *p) { return p->b * p->hkv * (whole_groups(p) ? 1 : cdiv(p->s, BK)); }

/* per worker: the task's blocks */
static int64_t bwd_worker_floats(const attn_problem *p) {
    const int64_t wide = p->d > p->dv ? p->d : p->dv;
    return round16(2 * p->d * BK + p->dv * BK + BK * p->d + BK * p->dv + BQ * p->d + BQ * p->dv + 2 * BQ * BK + wide);
}

/* float32 dQ is accumulated in place when its rows are unit-stride (the block matmul's C) */
static int dq_in_place(const attn_problem *p) { return p->dt == OPF_F32 && p->dqs[3] == 1; }

static int64_t slot_floats(const attn_problem *p) { return p->hkv ? round16(p->h / p->hkv * p->n * p->d) : 0; }

/* Slots of the ring: at least two per worker, so that a worker runs a round
 * ahead before it waits, and as many as fit in 8 MiB (every task when dQ is
 * small), so that a thread preempted by the OS stalls no other. */
static int64_t ring_slots(const attn_problem *p) {
    const int64_t tasks = bwd_tasks(p), w = workers_for(tasks), sf = slot_floats(p);
    if (whole_groups(p) || tasks == 0) return 0; /* tasks == 0 also when there is no key/value head */
    const int64_t fit = sf > 0 ? ((int64_t)8 << 20) / (int64_t)sizeof(float) / sf : tasks;
    const int64_t slots = w == 1 ? 1 : 2 * w > fit ? 2 * w : fit;
    return slots < tasks ? slots : tasks;
}

/* shared: D = rowsum(dO * out) (b, h, n); a float32 dQ (b, h, n, d) unless in
 * place; the ring's slots, each (g, n, d), and their task numbers (int64) */
static int64_t bwd_shared_floats(const attn_problem *p) {
    const int64_t slots = ring_slots(p);
    return round16(p->b * p->h * p->n) + (dq_in_place(p) ? 0 : round16(p->b * p->h * p->n * p->d)) +
           slots * slot_floats(p) + round16(2 * slots);
}

int64_t attn_bwd_workspace(const attn_problem *p) {
    return bwd_shared_floats(p) + workers_for(bwd_tasks(p)) * bwd_worker_floats(p);
}

typedef struct bwd_ctx {
    const attn_kernels *k;
    const attn_problem *p;
    float *di, *dq32, *ws, *ring;
    int64_t dq32s[4];
    int64_t per_worker, tasks, nkb, slots;
    int whole; /* whole_groups(), as sized by attn_bwd_workspace */
    atomic_llong next;
    /* the ring, under lock: tasks < added are in dQ; slot_task[t % slots] == t once task t is done */
    pthread_mutex_t lock;
    pthread_cond_t moved;
    int64_t added, *slot_task;
    int adding; /* a worker is adding slots into dQ (outside the lock) */
} bwd_ctx;

/* The first query that sees key block kb: under a causal mask, none before its first key. */
static int64_t first_query(const attn_problem *p, int64_t kb) { return p->causal ? kb * BK : 0; }

/* dQ (b, h of group grp, rows >= first_query) += the slot of key block kb; dQ's
 * rows are unit-stride (dq_in_place or the float32 workspace), so this vectorises */
static void add_slot(bwd_ctx *c, int64_t grp, int64_t kb, const float *slot) {
    const attn_problem *p = c->p;
    const int64_t g = p->h / p->hkv, b = grp / p->hkv, kvh = grp % p->hkv;
    for (int64_t hl = 0; hl < g; hl++)
        for (int64_t i = first_query(p, kb); i < p->n; i++) {
            const float *restrict src = slot + (hl * p->n + i) * p->d;
            float *restrict dst = c->dq32 + off4(c->dq32s, b, kvh * g + hl, i, 0);
            for (int64_t d = 0; d < p->d; d++) dst[d] += src[d];
        }
}

/* dS K of key block kb goes into dQ (slot NULL) or into slot (g, n, d), rows >= first_query(kb) */
static void bwd_task(bwd_ctx *c, int64_t grp, int64_t kb, float *ws, float *slot) {
    const attn_kernels *k = c->k;
    const attn_problem *p = c->p;
    const int64_t D = p->d, DV = p->dv, g = p->h / p->hkv, b = grp / p->hkv, kvh = grp % p->hkv;
    const int64_t j0 = kb * BK, bk = p->s - j0 < BK ? p->s - j0 : BK;
    float *kt = ws, *vt = kt + D * BK, *kr = vt + DV * BK, *dk = kr + BK * D, *dv = dk + BK * D;
    float *qr = dv + BK * DV, *dor = qr + BQ * D, *s = dor + BQ * DV, *dp = s + BQ * BK, *row = dp + BQ * BK;
    for (int64_t j = 0; j < bk; j++) { /* K rows, K^T and V^T of the block, float32 */
        load_row(k, kr + j * D, p->k, off4(p->ks, b, kvh, j0 + j, 0), p->ks[3], D, p->dt);
        for (int64_t d = 0; d < D; d++) kt[d * BK + j] = kr[j * D + d];
        load_row(k, row, p->v, off4(p->vs, b, kvh, j0 + j, 0), p->vs[3], DV, p->dt);
        for (int64_t d = 0; d < DV; d++) vt[d * BK + j] = row[d];
    }
    memset(dk, 0, sizeof(float) * (size_t)(BK * D));
    memset(dv, 0, sizeof(float) * (size_t)(BK * DV));
    const int64_t qstart = first_query(p, kb);
    const int f32 = p->dt == OPF_F32;
    for (int64_t hl = 0; hl < g && qstart < p->n; hl++) {
        const int64_t h = kvh * g + hl, bh = b * p->h + h;
        /* the slot is written once per row (acc 0), dQ accumulated (acc 1): the same sums */
        float *dqh = slot ? slot + hl * p->n * D : c->dq32 + off4(c->dq32s, b, h, 0, 0);
        const int64_t lddq = slot ? D : c->dq32s[2];
        for (int64_t i0 = qstart; i0 < p->n; i0 += BQ) {
            const int64_t bq = p->n - i0 < BQ ? p->n - i0 : BQ;
            const float *q = qr, *dout = dor;
            int64_t ldq = D, lddo = DV;
            if (f32 && p->qs[3] == 1) {
                q = (const float *)p->q + off4(p->qs, b, h, i0, 0);
                ldq = p->qs[2];
            } else {
                for (int64_t i = 0; i < bq; i++) load_row(k, qr + i * D, p->q, off4(p->qs, b, h, i0 + i, 0), p->qs[3], D, p->dt);
            }
            if (f32 && p->dos[3] == 1) {
                dout = (const float *)p->dout + off4(p->dos, b, h, i0, 0);
                lddo = p->dos[2];
            } else {
                for (int64_t i = 0; i < bq; i++)
                    load_row(k, dor + i * DV, p->dout, off4(p->dos, b, h, i0 + i, 0), p->dos[3], DV, p->dt);
            }
            k->mm(bq, bk, D, q, ldq, 1, kt, BK, s, BK, 0); /* S = Q K^T */
            float scale;
            const int64_t diag = tile_diag(p, s, BK, 1, b, h, i0, bq, j0, bk, &scale);
            k->probs(s, BK, bq, bk, scale, p->lse + bh * p->n + i0, diag);         /* P */
            k->mm(bq, bk, DV, dout, lddo, 1, vt, BK, dp, BK, 0);                   /* dP = dO V^T */
            k->dscores(dp, s, BK, bq, bk, c->di + bh * p->n + i0, (float)p->scale); /* dS */
            k->mm(bk, DV, bq, s, 1, BK, dout, lddo, dv, DV, 1);                    /* dV += P^T dO */
            k->mm(bk, D, bq, dp, 1, BK, q, ldq, dk, D, 1);                         /* dK += dS^T Q */
            k->mm(bq, D, bk, dp, BK, 1, kr, D, dqh + i0 * lddq, lddq, !slot);      /* dQ += dS K */
        }
    }
    for (int64_t j = 0; j < bk; j++) {
        store_row(k, p->dk, off4(p->dks, b, kvh, j0 + j, 0), p->dks[3], dk + j * D, D, p->dt);
        store_row(k, p->dvv, off4(p->dvs, b, kvh, j0 + j, 0), p->dvs[3], dv + j * DV, DV, p->dt);
    }
}

/* Task t of the ring: wait for a free slot, run, then add what is complete in order. */
static void ring_task(bwd_ctx *c, int64_t t, float *ws) {
    float *slot = c->ring + t % c->slots * slot_floats(c->p);
    pthread_mutex_lock(&c->lock);
    while (t - c->added >= c->slots) pthread_cond_wait(&c->moved, &c->lock);
    const int direct = t == c->added; /* nothing before t is outstanding, and nothing after it adds before it */
    pthread_mutex_unlock(&c->lock);
    bwd_task(c, t / c->nkb, t % c->nkb, ws, direct ? NULL : slot);
    pthread_mutex_lock(&c->lock);
    if (direct)
        c->added = t + 1;
    else
        c->slot_task[t % c->slots] = t;
    if (!c->adding) {
        c->adding = 1;
        for (int64_t u; (u = c->added) < c->tasks && c->slot_task[u % c->slots] == u;) {
            pthread_mutex_unlock(&c->lock);
            add_slot(c, u / c->nkb, u % c->nkb, c->ring + u % c->slots * slot_floats(c->p));
            pthread_mutex_lock(&c->lock);
            c->added = u + 1;
        }
        c->adding = 0;
    }
    pthread_cond_broadcast(&c->moved);
    pthread_mutex_unlock(&c->lock);
}

static void bwd_worker(int64_t w0, int64_t w1, void *arg) {
    bwd_ctx *c = arg;
    for (int64_t w = w0; w < w1; w++) {
        float *ws = c->ws + w * c->per_worker;
        for (int64_t t; (t = atomic_fetch_add(&c->next, 1)) < c->tasks;) {
            if (!c->whole)
                ring_task(c, t, ws);
            else
                for (int64_t kb = 0; kb < c->nkb; kb++) bwd_task(c, t, kb, ws, NULL);
        }
    }
}

typedef struct rows_ctx {
    const attn_kernels *k;
    const attn_problem *p;
    bwd_ctx *c;
} rows_ctx;

/* per (b, h): zero dQ's float32 accumulator, D[i] = sum_d dO[i, d] out[i, d] */
static void bwd_prologue(int64_t bh0, int64_t bh1, void *arg) {
    rows_ctx *r = arg;
    const attn_problem *p = r->p;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / p->h, h = bh % p->h;
        for (int64_t i = 0; i < p->n; i++) {
            float *dq = r->c->dq32 + off4(r->c->dq32s, b, h, i, 0);
            for (int64_t d = 0; d < p->d; d++) dq[d * r->c->dq32s[3]] = 0.0f;
            double sum = 0.0;
            for (int64_t d = 0; d < p->dv; d++)
                sum += opf_load_elem(p->dout, off4(p->dos, b, h, i, d), p->dt) * opf_load_elem(p->out, off4(p->os, b, h, i, d), p->dt);
            r->c->di[bh * p->n + i] = (float)sum;
        }
    }
}

static void bwd_epilogue(int64_t bh0, int64_t bh1, void *arg) {
    rows_ctx *r = arg;
    const attn_problem *p = r->p;
    for (int64_t bh = bh0; bh < bh1; bh++)
        for (int64_t i = 0; i < p->n; i++)
            store_row(r->k, p->dq, off4(p->dqs, bh / p->h, bh % p->h, i, 0), p->dqs[3],
                      r->c->dq32 + (bh * p->n + i) * p->d, p->d, p->dt);
}

void attn_bwd(const attn_kernels *k, const attn_problem *p, float *workspace) {
    bwd_ctx c = {.k = k, .p = p, .per_worker = bwd_worker_floats(p), .tasks = bwd_tasks(p), .nkb = cdiv(p->s, BK),
                 .slots = ring_slots(p), .whole = whole_groups(p)};
    const int in_place = dq_in_place(p);
    c.di = workspace;
    float *next = workspace + round16(p->b * p->h * p->n);
    if (in_place) {
        c.dq32 = p->dq;
        memcpy(c.dq32s, p->dqs, sizeof c.dq32s);
    } else {
        c.dq32 = next;
        next += round16(p->b * p->h * p->n * p->d);
        int64_t st[4] = {p->h * p->n * p->d, p->n * p->d, p->d, 1};
        memcpy(c.dq32s, st, sizeof st);
    }
    c.ring = next;
    c.slot_task = (int64_t *)(next + c.slots * slot_floats(p));
    for (int64_t i = 0; i < c.slots; i++) c.slot_task[i] = -1;
    c.ws = workspace + bwd_shared_floats(p);
    atomic_init(&c.next, 0);
    pthread_mutex_init(&c.lock, NULL);
    pthread_cond_init(&c.moved, NULL);
    rows_ctx r = {k, p, &c};
    opf_parallel_for(0, p->b * p->h, 1, bwd_prologue, &r);
    if (c.tasks > 0) opf_parallel_for(0, workers_for(c.tasks), 1, bwd_worker, &c);
    if (!in_place) opf_parallel_for(0, p->b * p->h, 1, bwd_epilogue, &r);
    pthread_cond_destroy(&c.moved);
    pthread_mutex_destroy(&c.lock);
}

/* ---- oracle: row by row in double ---------------------------------------------------------- */

/* scores of query i of (b, h) against every key, softmax in place; returns lse */
static double ref_probs(const attn_problem *p, int64_t b, int64_t h, int64_t i, double *w) {
    const int64_t kvh = h / (p->h / p->hkv);
    double mx = -INFINITY;
    int nan = 0;
    for (int64_t j = 0; j < p->s; j++) {
        double bias = mask_bias(p, b, h, i, j);
        if (p->mask_kind == ATTN_MASK_ADD && !(p->causal && j > i))
            bias = opf_load_elem(p->mask, off4(p->ms, b, h, i, j), p->mask_dt); /* in double for float64 */
        double dot = 0.0;
        for (int64_t d = 0; d < p->d; d++)
            dot += opf_load_elem(p->q, off4(p->qs, b, h, i, d), p->dt) * opf_load_elem(p->k, off4(p->ks, b, kvh, j, d), p->dt);
        w[j] = bias == -INFINITY ? -INFINITY : dot * p->scale + bias;
        if (w[j] > mx) mx = w[j];
        nan |= isnan(w[j]);
    }
    if (nan) { /* a NaN score makes the whole row NaN, as softmax does */
        for (int64_t j = 0; j < p->s; j++) w[j] = NAN;
        return NAN;
    }
    if (mx == -INFINITY) { /* no key left: zeros */
        for (int64_t j = 0; j < p->s; j++) w[j] = 0.0;
        return -INFINITY;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < p->s; j++) sum += (w[j] = exp(w[j] - mx));
    for (int64_t j = 0; j < p->s; j++) w[j] /= sum;
    return mx + log(sum);
}

int attn_ref_fwd(const attn_problem *p) {
    double *w = malloc(sizeof(double) * (size_t)(p->s + 1));
    if (!w) return -1;
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->h; h++) {
            const int64_t kvh = h / (p->h / p->hkv);
            for (int64_t i = 0; i < p->n; i++) {
                p->lse[(b * p->h + h) * p->n + i] = (float)ref_probs(p, b, h, i, w);
                for (int64_t d = 0; d < p->dv; d++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < p->s; j++) acc += w[j] * opf_load_elem(p->v, off4(p->vs, b, kvh, j, d), p->dt);
                    opf_store_elem(p->out, off4(p->os, b, h, i, d), p->dt, acc);
                }
            }
        }
    free(w);
    return 0;
}

int attn_ref_bwd(const attn_problem *p) {
    const int64_t nk = p->b * p->hkv * p->s;
    double *w = malloc(sizeof(double) * (size_t)(2 * p->s + p->d + 1));
    double *dk = calloc((size_t)(nk * p->d + 1), sizeof(double)), *dv = calloc((size_t)(nk * p->dv + 1), sizeof(double));
    if (!w || !dk || !dv) {
        free(w), free(dk), free(dv);
        return -1;
    }
    double *dpr = w + p->s, *dqr = dpr + p->s;
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->h; h++) {
            const int64_t kvh = h / (p->h / p->hkv), kbase = (b * p->hkv + kvh) * p->s;
            for (int64_t i = 0; i < p->n; i++) {
                ref_probs(p, b, h, i, w);
                double di = 0.0;
                for (int64_t j = 0; j < p->s; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < p->dv; d++)
                        dot += opf_load_elem(p->dout, off4(p->dos, b, h, i, d), p->dt) * opf_load_elem(p->v, off4(p->vs, b, kvh, j, d), p->dt);
                    dpr[j] = dot;
                    di += w[j] * dot;
                }
                for (int64_t d = 0; d < p->d; d++) dqr[d] = 0.0;
                for (int64_t j = 0; j < p->s; j++) {
                    const double ds = w[j] * (dpr[j] - di) * p->scale;
                    for (int64_t d = 0; d < p->dv; d++)
                        dv[(kbase + j) * p->dv + d] += w[j] * opf_load_elem(p->dout, off4(p->dos, b, h, i, d), p->dt);
                    for (int64_t d = 0; d < p->d; d++) {
                        dk[(kbase + j) * p->d + d] += ds * opf_load_elem(p->q, off4(p->qs, b, h, i, d), p->dt);
                        dqr[d] += ds * opf_load_elem(p->k, off4(p->ks, b, kvh, j, d), p->dt);
                    }
                }
                for (int64_t d = 0; d < p->d; d++) opf_store_elem(p->dq, off4(p->dqs, b, h, i, d), p->dt, dqr[d]);
            }
        }
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t kvh = 0; kvh < p->hkv; kvh++)
            for (int64_t j = 0; j < p->s; j++) {
                const int64_t r = (b * p->hkv + kvh) * p->s + j;
                for (int64_t d = 0; d < p->d; d++) opf_store_elem(p->dk, off4(p->dks, b, kvh, j, d), p->dt, dk[r * p->d + d]);
                for (int64_t d = 0; d < p->dv; d++) opf_store_elem(p->dvv, off4(p->dvs, b, kvh, j, d), p->dt, dv[r * p->dv + d]);
            }
    free(w), free(dk), free(dv);
    return 0;
}
