/*
 * KV-cache decoding attention: the scalar reference kernels, the variant table, the chunk plan, the
 * driver (tasks, then the combine) and the double-precision oracle. See attention_decode.h.
 */
#include "attention_decode.h"
#include "attention_rows.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

/* Chunks are planned so that B x Hkv x chunks reaches ATTENTION_DECODE_TASKS (a few tasks per thread on up to ~16
 * threads, so that uneven chunks even out), but no chunk is shorter than ATTENTION_DECODE_MIN_CHUNK keys: below
 * that the per-task cost (loading the group's queries, writing and combining g x N partial rows of Dv)
 * shows against the keys' bytes. */
enum { ATTENTION_DECODE_TASKS = 64, ATTENTION_DECODE_MIN_CHUNK = 256 };

#define LOG2E 1.44269504088896341

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const attention_decode_kernels attention_decode_kernels_avx2 __attribute__((weak));
extern const attention_decode_kernels attention_decode_kernels_avx512 __attribute__((weak));

const opf_variants attention_decode_variants =
    OPF_VARIANTS("attention_decode", &attention_decode_kernels_ref, &attention_decode_kernels_avx2,
                 &attention_decode_kernels_avx512);

/* Not noted for the log here: attention_decode_fwd notes what runs (this table, or the oracle for float64). */
const attention_decode_kernels *attention_decode_kernels_for(opf_isa isa) {
    return opf_variant_best(&attention_decode_variants, isa);
}

/* ---- scalar reference kernels ------------------------------------------------------------ */

static void scores_ref(float *s, int64_t lds, const float *q, int64_t r, int64_t d, const void *k, int64_t ldk,
                       int64_t bk, opf_dtype kdt) {
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < bk; j++) {
            float sum = 0.0f;
            for (int64_t e = 0; e < d; e++) sum += q[i * d + e] * (float)opf_load_elem(k, j * ldk + e, kdt);
            s[i * lds + j] = sum;
        }
}

static float softmax_row_ref(float *x, int64_t bk, int64_t keys, float *m, float *l, float unit) {
    float mx = *m;
    for (int64_t j = 0; j < keys; j++) mx = fmaxf(mx, x[j]);
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < bk; j++) x[j] = 0.0f;
        return 1.0f;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < bk; j++) {
        x[j] = j < keys ? exp2f((x[j] - mx) * unit) : 0.0f;
        sum += x[j];
    }
    const float alpha = exp2f((*m - mx) * unit);
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

static void pv_ref(float *o, const float *alpha, const float *p, int64_t ldp, int64_t r, int64_t bk, const void *v,
                   int64_t ldv, int64_t dv, opf_dtype vdt) {
    for (int64_t i = 0; i < r; i++)
        for (int64_t e = 0; e < dv; e++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < bk; j++) sum += p[i * ldp + j] * (float)opf_load_elem(v, j * ldv + e, vdt);
            o[i * dv + e] = o[i * dv + e] * alpha[i] + sum;
        }
}

const attention_decode_kernels attention_decode_kernels_ref = {.name = "ref",
                                                               .isa = OPF_ISA_REF,
                                                               .cvt = &convert_kernels_ref,
                                                               .scores = scores_ref,
                                                               .softmax_row = softmax_row_ref,
                                                               .pv = pv_ref};

/* ---- plan and workspace ---------------------------------------------------------------------- */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round16(int64_t n) { return cdiv(n, 16) * 16; } /* keeps workspace slices 64-byte aligned */

static int64_t carve(int64_t *at, int64_t n) {
    const int64_t offset = *at;
    *at += n;
    return offset;
}

static int64_t max_len(const attention_decode_problem *p) {
    int64_t m = 0;
    for (int64_t b = 0; b < p->b; b++) {
        const int64_t len = attention_decode_len(p, b);
        m = len > m ? len : m;
    }
    return m;
}

int64_t attention_decode_chunk(const attention_decode_problem *p) {
    const int64_t groups = p->b * p->hkv > 0 ? p->b * p->hkv : 1;
    const int64_t chunk =
        cdiv(cdiv(max_len(p), cdiv(ATTENTION_DECODE_TASKS, groups)), ATTENTION_DECODE_BK) * ATTENTION_DECODE_BK;
    return chunk > ATTENTION_DECODE_MIN_CHUNK ? chunk : ATTENTION_DECODE_MIN_CHUNK;
}

static int64_t group_rows(const attention_decode_problem *p) { return p->hkv ? p->h / p->hkv * p->n : 0; }

attention_decode_plan attention_decode_plan_make(const attention_decode_problem *p, int64_t threads) {
    attention_decode_plan lay = {.ref = p->dt == OPF_F64};
    if (lay.ref) { /* the oracle's scratch */
        lay.floats = 2 * attention_decode_ref_doubles(p);
        return lay;
    }
    const int64_t r = group_rows(p), len = max_len(p);
    lay.chunk = attention_decode_chunk(p);
    lay.chunks = len > 0 ? cdiv(len, lay.chunk) : 0;
    lay.tasks = p->b * p->hkv * lay.chunks;
    /* nothing to compute (no row, or no output column and no lse asked for): zeros, -inf lse */
    if (r == 0 || (p->d_v == 0 && !p->lse)) lay.tasks = 0;
    lay.workers = lay.tasks < threads ? lay.tasks : threads;
    lay.part_floats = round16(r * (2 + p->d_v));
    int64_t at = 0;
    lay.q32 = carve(&at, r * p->d_qk);                    /* the group's query rows, float32, times scale log2(e) */
    lay.kbuf = carve(&at, ATTENTION_DECODE_BK * p->d_qk); /* a block's K and V rows, float32, when not read in place */
    lay.vbuf = carve(&at, ATTENTION_DECODE_BK * p->d_v);
    lay.s = carve(&at, r * ATTENTION_DECODE_BK); /* scores, then probabilities */
    lay.o = carve(&at, r * p->d_v);              /* unnormalised output rows */
    lay.m = carve(&at, r);
    lay.l = carve(&at, r);
    lay.alpha = carve(&at, r);
    lay.per_worker = round16(at);
    at = 0;
    lay.parts = carve(&at, lay.tasks * lay.part_floats);
    lay.done = carve(&at, round16(2 * (lay.tasks ? p->b * p->hkv : 0))); /* an atomic_llong per group */
    lay.slices = carve(&at, lay.workers * lay.per_worker);
    lay.floats = at;
    return lay;
}

int64_t attention_decode_workspace(const attention_decode_plan *plan) { return plan->floats; }

/* ---- driver -------------------------------------------------------------------------------------- */

/* rows (K or V) j0..j0+bk of head (b, kvh): in place when unit-stride (a 16-bit cache too: the kernels
 * convert in registers), else converted to float32 into buf; returns the rows, their stride and type */
static const void *cache_rows(const attention_decode_kernels *k, const attention_decode_problem *p, const void *src,
                              const int64_t *st, int64_t b, int64_t kvh, int64_t j0, int64_t bk, int64_t d, float *buf,
                              int64_t *ld, opf_dtype *dt) {
    if (st[3] == 1) {
        *ld = st[2];
        *dt = p->dt;
        return (const char *)src + (size_t)off4(st, b, kvh, j0, 0) * opf_dtype_size(p->dt);
    }
    for (int64_t j = 0; j < bk; j++) load_row(k->cvt, buf + j * d, src, off4(st, b, kvh, j0 + j, 0), st[3], d, p->dt);
    *ld = d;
    *dt = OPF_F32;
    return buf;
}

/* An explicit mask on the scores of block j0.. (bk keys) of the group's rows. An added mask is added in
 * natural units (attention_decode_unit), so that float32's lowest, torch's usual mask value, stays finite: a row
 * masked by it alone gets uniform weights, as in torch, and its lse stays what the backward recomputes
 * P from. Cheap beside the scores: one element per score against d_qk multiply-adds. */
static void attention_decode_mask(const attention_decode_problem *p, float *s, int64_t r, int64_t b, int64_t kvh,
                                  int64_t j0, int64_t bk) {
    const int64_t g = p->h / p->hkv, m3 = p->ms[3];
    for (int64_t ri = 0; ri < r; ri++) {
        const int64_t at = off4(p->ms, b, kvh * g + ri / p->n, ri % p->n, j0);
        float *restrict row = s + ri * ATTENTION_DECODE_BK;
        if (p->mask_kind == ATTENTION_DECODE_MASK_BOOL) {
            const uint8_t *keep = (const uint8_t *)p->mask + at;
            for (int64_t j = 0; j < bk; j++)
                if (!keep[j * m3]) row[j] = -INFINITY;
        } else {
            for (int64_t j = 0; j < bk; j++) {
                row[j] += (float)opf_load_elem(p->mask, at + j * m3, p->mask_dt);
            }
        }
    }
}

/* The units of the scores, as softmax_row takes them: base 2 (1), or natural (log2(e)) under an added mask */
static float attention_decode_unit(const attention_decode_problem *p) {
    return p->mask_kind == ATTENTION_DECODE_MASK_ADD ? (float)LOG2E : 1.0f;
}

typedef struct attention_decode_ctx {
    const attention_decode_kernels *k;
    const attention_decode_problem *p;
    const attention_decode_plan *lay;
    int64_t chunk;
    float *ws;
    atomic_llong next;
} attention_decode_ctx;

/* Task t = (b, kv head, chunk c): the partial state of the group's g x N rows over the chunk's keys. */
static void attention_decode_task(const attention_decode_ctx *c, int64_t t, float *slice) {
    const attention_decode_kernels *k = c->k;
    const attention_decode_problem *p = c->p;
    const attention_decode_plan *lay = c->lay;
    const int64_t g = p->h / p->hkv, r = g * p->n, d_qk = p->d_qk, d_v = p->d_v;
    const int64_t grp = t / lay->chunks, b = grp / p->hkv, kvh = grp % p->hkv;
    const int64_t len = attention_decode_len(p, b), j_begin = t % lay->chunks * c->chunk;
    const int64_t j_end = j_begin + c->chunk < len ? j_begin + c->chunk : len;
    float *part = c->ws + lay->parts + t * lay->part_floats; /* row i: m, l, acc[d_v] */
    if (j_begin >= j_end) {                                  /* past this row's keys: nothing seen */
        for (int64_t i = 0; i < r; i++) part[i * (2 + d_v)] = -INFINITY, part[i * (2 + d_v) + 1] = 0.0f;
        return;
    }
    float *q32 = slice + lay->q32, *kbuf = slice + lay->kbuf, *vbuf = slice + lay->vbuf, *s = slice + lay->s;
    float *o = slice + lay->o, *m = slice + lay->m, *l = slice + lay->l, *alpha = slice + lay->alpha;
    const float unit = attention_decode_unit(p), qscale = (float)(unit == 1.0f ? p->scale * LOG2E : p->scale);
    for (int64_t hl = 0; hl < g; hl++)
        for (int64_t i = 0; i < p->n; i++) {
            float *row = q32 + (hl * p->n + i) * d_qk;
            load_row(k->cvt, row, p->q, off4(p->qs, b, kvh * g + hl, i, 0), p->qs[3], d_qk, p->dt);
            for (int64_t e = 0; e < d_qk; e++) row[e] *= qscale;
        }
    for (int64_t i = 0; i < r; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(o, 0, sizeof(float) * (size_t)(r * d_v));
    for (int64_t j0 = j_begin; j0 < j_end; j0 += ATTENTION_DECODE_BK) {
        const int64_t bk = j_end - j0 < ATTENTION_DECODE_BK ? j_end - j0 : ATTENTION_DECODE_BK;
        int64_t ldk, ldv;
        opf_dtype kdt, vdt;
        const void *kr = cache_rows(k, p, p->k, p->ks, b, kvh, j0, bk, d_qk, kbuf, &ldk, &kdt);
        k->scores(s, ATTENTION_DECODE_BK, q32, r, d_qk, kr, ldk, bk, kdt);
        if (p->mask) attention_decode_mask(p, s, r, b, kvh, j0, bk);
        for (int64_t i = 0; i < r; i++) {
            const int64_t lim = attention_decode_lim(p, len, i % p->n); /* row i is query i % N of its head */
            const int64_t keys = lim - j0 < 0 ? 0 : lim - j0 < bk ? lim - j0 : bk;
            alpha[i] = k->softmax_row(s + i * ATTENTION_DECODE_BK, bk, keys, &m[i], &l[i], unit);
        }
        const void *vr = cache_rows(k, p, p->v, p->vs, b, kvh, j0, bk, d_v, vbuf, &ldv, &vdt);
        k->pv(o, alpha, s, ATTENTION_DECODE_BK, r, bk, vr, ldv, d_v, vdt);
    }
    for (int64_t i = 0; i < r; i++) {
        float *pi = part + i * (2 + d_v);
        pi[0] = m[i], pi[1] = l[i];
        memcpy(pi + 2, o + i * d_v, sizeof(float) * (size_t)d_v);
    }
}

/* The group's g x N output rows: each row's chunks combined in chunk order, into the acc of chunk 0 (the
 * row owns that slot), then normalised and stored. */
static void attention_decode_combine(const attention_decode_ctx *c, int64_t grp) {
    const attention_decode_problem *p = c->p;
    const attention_decode_plan *lay = c->lay;
    const int64_t d_v = p->d_v, g = p->h / p->hkv, stride = 2 + d_v, b = grp / p->hkv, kvh = grp % p->hkv;
    const float unit = attention_decode_unit(p);
    for (int64_t ri = 0; ri < g * p->n; ri++) {
        const int64_t h = kvh * g + ri / p->n, i = ri % p->n;
        float *acc = c->ws + lay->parts + grp * lay->chunks * lay->part_floats + ri * stride;
        float mx = -INFINITY;
        for (int64_t ch = 0; ch < lay->chunks; ch++) {
            const float *pc = acc + ch * lay->part_floats;
            if (pc[1] > 0.0f || isnan(pc[1])) mx = fmaxf(mx, pc[0]);
        }
        if (mx == -INFINITY) { /* no key: zeros */
            for (int64_t e = 0; e < d_v; e++) opf_store_elem(p->out, off4(p->os, b, h, i, e), p->dt, 0.0);
            if (p->lse) p->lse[(b * p->h + h) * p->n + i] = -INFINITY;
            continue;
        }
        float total = 0.0f;
        for (int64_t ch = 0; ch < lay->chunks; ch++) {
            const float *pc = acc + ch * lay->part_floats;
            if (!(pc[1] > 0.0f || isnan(pc[1]))) { /* no key of this row in the chunk: its acc is unset */
                if (ch == 0) memset(acc + 2, 0, sizeof(float) * (size_t)d_v);
                continue;
            }
            const float w = exp2f((pc[0] - mx) * unit);
            total += pc[1] * w;
            float *restrict dst = acc + 2;
            const float *restrict src = pc + 2;
            if (ch == 0) {
                for (int64_t e = 0; e < d_v; e++) dst[e] = src[e] * w;
            } else {
                for (int64_t e = 0; e < d_v; e++) dst[e] += src[e] * w;
            }
        }
        const float inv = 1.0f / total;
        for (int64_t e = 0; e < d_v; e++) acc[2 + e] *= inv;
        if (p->lse) p->lse[(b * p->h + h) * p->n + i] = (float)(((double)mx * unit + log2((double)total)) / LOG2E);
        store_row(c->k->cvt, p->out, off4(p->os, b, h, i, 0), p->os[3], acc + 2, d_v, p->dt);
    }
}

/* Tasks are taken in order; whoever completes a group's last chunk combines the group: one parallel
 * region per call, not a second one for the combine (each region waits for every thread, which on a
 * busy machine means waiting for the OS to schedule them). The counter's read-modify-write orders the
 * other tasks' partials before the combine reads them. */
static void attention_decode_worker(int64_t w0, int64_t w1, void *arg) {
    attention_decode_ctx *c = arg;
    atomic_llong *done = (atomic_llong *)(void *)(c->ws + c->lay->done);
    for (int64_t w = w0; w < w1; w++) {
        float *slice = c->ws + c->lay->slices + w * c->lay->per_worker;
        for (;;) {
            const int64_t t = atomic_fetch_add(&c->next, 1);
            if (t >= c->lay->tasks) break;
            attention_decode_task(c, t, slice);
            const int64_t grp = t / c->lay->chunks;
            if (atomic_fetch_add(&done[grp], 1) == c->lay->chunks - 1) attention_decode_combine(c, grp);
        }
    }
}

void attention_decode_fwd(const attention_decode_kernels *k, const attention_decode_plan *plan,
                          const attention_decode_problem *p, float *workspace) {
    if (opf_log_enabled(OPF_LOG_INFO))
        opf_log_note_pick(attention_decode_variants.family, plan->ref ? "ref_f64" : k->name,
                          plan->ref ? OPF_ISA_REF : k->isa);
    if (plan->ref) {
        attention_decode_ref_fwd(p, (double *)(void *)workspace);
        return;
    }
    attention_decode_ctx c = {.k = k, .p = p, .lay = plan, .chunk = plan->chunk, .ws = workspace};
    atomic_init(&c.next, 0);
    if (plan->tasks == 0) { /* no key anywhere (or no row): zeros */
        for (int64_t b = 0; b < p->b; b++)
            for (int64_t h = 0; h < p->h; h++)
                for (int64_t i = 0; i < p->n; i++) {
                    for (int64_t e = 0; e < p->d_v; e++) opf_store_elem(p->out, off4(p->os, b, h, i, e), p->dt, 0.0);
                    if (p->lse) p->lse[(b * p->h + h) * p->n + i] = -INFINITY;
                }
        return;
    }
    atomic_llong *done = (atomic_llong *)(void *)(workspace + plan->done);
    for (int64_t grp = 0; grp < p->b * p->hkv; grp++) atomic_init(&done[grp], 0);
    opf_parallel_for(0, plan->workers, 1, attention_decode_worker, &c);
}

/* ---- the oracle ---------------------------------------------------------------------------------- */

/* the scores of one query row (s_max), then its output row (d_v) */
int64_t attention_decode_ref_doubles(const attention_decode_problem *p) { return p->s_max + p->d_v + 1; }

void attention_decode_ref_fwd(const attention_decode_problem *p, double *scratch) {
    double *w = scratch, *acc = w + p->s_max;
    const int64_t g = p->hkv ? p->h / p->hkv : 1;
    for (int64_t b = 0; b < p->b; b++) {
        const int64_t len = attention_decode_len(p, b);
        for (int64_t h = 0; h < p->h; h++)
            for (int64_t i = 0; i < p->n; i++) {
                const int64_t lim = attention_decode_lim(p, len, i), kvh = h / g;
                double mx = -INFINITY;
                for (int64_t j = 0; j < lim; j++) {
                    double dot = 0.0;
                    for (int64_t e = 0; e < p->d_qk; e++)
                        dot += opf_load_elem(p->q, off4(p->qs, b, h, i, e), p->dt) *
                               opf_load_elem(p->k, off4(p->ks, b, kvh, j, e), p->dt);
                    w[j] = dot * p->scale;
                    if (p->mask_kind == ATTENTION_DECODE_MASK_BOOL &&
                        !((const uint8_t *)p->mask)[off4(p->ms, b, h, i, j)])
                        w[j] = -INFINITY;
                    else if (p->mask_kind == ATTENTION_DECODE_MASK_ADD)
                        w[j] += opf_load_elem(p->mask, off4(p->ms, b, h, i, j), p->mask_dt);
                    mx = fmax(mx, w[j]);
                }
                double sum = 0.0;
                for (int64_t e = 0; e < p->d_v; e++) acc[e] = 0.0;
                for (int64_t j = 0; j < lim && mx != -INFINITY; j++) {
                    const double e_j = exp(w[j] - mx);
                    sum += e_j;
                    for (int64_t e = 0; e < p->d_v; e++)
                        acc[e] += e_j * opf_load_elem(p->v, off4(p->vs, b, kvh, j, e), p->dt);
                }
                for (int64_t e = 0; e < p->d_v; e++)
                    opf_store_elem(p->out, off4(p->os, b, h, i, e), p->dt, sum > 0.0 ? acc[e] / sum : 0.0);
                if (p->lse) p->lse[(b * p->h + h) * p->n + i] = sum > 0.0 ? (float)(mx + log(sum)) : -INFINITY;
            }
    }
}
