/*
 * GEMM plan and driver: how a product is split into blocks and tasks, the
 * one workspace layout, and the threaded loops over panels, K slices and
 * tiles; the variant list. Packing is in gemm_pack.c, the oracles and the
 * scalar micro-kernel in gemm_ref.c. Contract and blocking in gemm.h.
 */
#include <stddef.h>
#include <string.h>

#include "gemm_pack.h"

/* The largest MR x NR tile an epilogue runs from memory (gemm_finish, slices run at once) */
enum { FINISH_TILE_MAX = 64 * 64 };

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const gemm_kernels gemm_kernels_avx2 __attribute__((weak));
extern const gemm_kernels gemm_kernels_avx512 __attribute__((weak));
extern const gemm_kernels gemm_kernels_avx512_bf16 __attribute__((weak));
extern const gemm_kernels gemm_kernels_amx __attribute__((weak));

const opf_variants gemm_variants = OPF_VARIANTS("gemm", &gemm_kernels_ref, &gemm_kernels_avx2, &gemm_kernels_avx512,
                                                &gemm_kernels_avx512_bf16, &gemm_kernels_amx);

/* Not noted for the log here: which kernel multiplies depends on the operand types (a pair kernel's table
 * hands the other products to its float32 table), so gemm_run notes the table that runs. */
const gemm_kernels *gemm_kernels_for(opf_isa isa) { return opf_variant_best(&gemm_variants, isa); }

static int use_pairs(const gemm_kernels *kern, opf_dtype ta, opf_dtype tb) {
    return kern->ukernel_pairs && (ta == OPF_BF16 || tb == OPF_BF16) && ta != OPF_F16 && tb != OPF_F16;
}

/* the table whose micro-kernel multiplies operands of these types */
static const gemm_kernels *table_for(const gemm_kernels *kern, opf_dtype ta, opf_dtype tb) {
    return kern->f32 && !use_pairs(kern, ta, tb) ? kern->f32 : kern;
}

/* a pair takes one float's room in the workspace: a slice of pairs is twice as deep */
int64_t gemm_slice_depth(const gemm_kernels *kern, opf_dtype ta, opf_dtype tb) {
    kern = table_for(kern, ta, tb);
    return use_pairs(kern, ta, tb) ? 2 * kern->kc : kern->kc;
}

/* Workspace of one slice run beside others: its A packed whole, its B panel, the panel's partial sums */
static int64_t ksplit_slice_floats(const gemm_plan *p, const gemm_kernels *kern, int64_t nc) {
    return (round_up(p->m, kern->mr) + round_up(nc, kern->nr)) * p->kc_max + p->m * round_up(nc, kern->nr);
}

/* The tiles the busiest of `threads` workers runs of `units` tiles dealt evenly */
static int64_t ksplit_steps(int64_t units, int64_t threads) { return (units + threads - 1) / threads; }

gemm_plan gemm_plan_make(const gemm_kernels *kern, int64_t m, int64_t n, int64_t k, opf_dtype ta, opf_dtype tb,
                         int64_t threads) {
    kern = table_for(kern, ta, tb);
    gemm_plan p = {
        .kern = kern, .m = m, .n = n, .k = k, .ta = ta, .tb = tb, .threads = threads > 0 ? threads : 1, .ksplit = 1};
    p.pairs = use_pairs(kern, ta, tb);
    if (m <= 0 || n <= 0 || k <= 0) return p; /* nothing to pack: no workspace */
    p.kc_max = k < kern->kc ? k : kern->kc;
    if (kern->tile_pairs) p.kc_max = round_up(p.kc_max, kern->tile_pairs); /* zero pairs up to a whole tile */
    p.slivers = (m + kern->mr - 1) / kern->mr;
    p.mblocks = round_up((m + kern->mc - 1) / kern->mc, p.threads);
    if (p.mblocks > p.slivers) p.mblocks = p.slivers;
    p.mc = (p.slivers + p.mblocks - 1) / p.mblocks * kern->mr;
    p.own_a = p.mblocks >= 2 * p.threads;
    p.workers = p.mblocks < p.threads ? p.mblocks : p.threads;
    const int64_t nc = n < kern->nc ? n : kern->nc;
    p.b_offset = (p.own_a ? p.workers * p.mc : round_up(m, kern->mr)) * p.kc_max;
    p.floats = p.b_offset + round_up(nc, kern->nr) * p.kc_max;
    const int64_t slices = (k + gemm_slice_depth(kern, ta, tb) - 1) / gemm_slice_depth(kern, ta, tb);
    const int64_t tiles = p.slivers * ((nc + kern->nr - 1) / kern->nr), want = GEMM_KSPLIT_TILES * p.threads;
    if (!p.own_a && p.threads > 1 && slices > 1 && tiles < want && kern->mr * kern->nr <= FINISH_TILE_MAX) {
        const int64_t per = ksplit_slice_floats(&p, kern, nc);
        int64_t most = slices < GEMM_KSPLIT_MAX ? slices : GEMM_KSPLIT_MAX, best = -1;
        if (most > GEMM_KSPLIT_FLOATS / per) most = GEMM_KSPLIT_FLOATS / per;
        for (int64_t g = 1; g <= most; g++) { /* the fewest tile steps of the busiest worker, in the least memory */
            const int64_t rounds = (slices + g - 1) / g, rest = slices - (rounds - 1) * g;
            const int64_t steps =
                (rounds - 1) * ksplit_steps(g * tiles, p.threads) + ksplit_steps(rest * tiles, p.threads);
            if (best < 0 || steps < best) best = steps, p.ksplit = g;
        }
        if (p.ksplit > 1 && p.floats < p.ksplit * per) p.floats = p.ksplit * per;
    }
    /* a plan on pairs: the pair form, for a bfloat16 B (a float32 B rounded to pairs is not a row it reads) */
    p.skinny = m <= GEMM_SKINNY_M &&
               (p.pairs ? kern->skinny_pairs && tb == OPF_BF16 : kern->skinny && (tb == OPF_F32 || tb == OPF_BF16));
    if (p.skinny && p.floats < m * (k + n) + k) p.floats = m * (k + n) + k; /* A, the product, a row's staging */
    return p;
}

typedef struct skinny_job {
    gemm_skinny_fn fn;
    gemm_skinny_pairs_fn pairs_fn; /* set: A as bfloat16 rows (a16) */
    int64_t m, k, n, ldb, ldo, group, lda16;
    const float *a;
    const uint16_t *a16;
    const void *b;
    int b16;
    float *out;
} skinny_job;

static void skinny_range(int64_t g0, int64_t g1, void *ctx) {
    const skinny_job *j = ctx;
    const int64_t j0 = g0 * j->group, j1 = g1 * j->group < j->n ? g1 * j->group : j->n;
    if (j->pairs_fn)
        j->pairs_fn(j->m, j->k, j->a16, j->lda16, j->b, j->ldb, j0, j1, j->out, j->ldo);
    else
        j->fn(j->m, j->k, j->a, j->b, j->b16, j->ldb, j0, j1, j->out, j->ldo);
}

/* The skinny product (plan->skinny, B of unit stride along K): A's rows converted to float32, or on pairs
 * to bfloat16 rows (a float32 row rounded as the pair packing rounds it), the dot products over column
 * groups in parallel, into C where nothing follows them, else into scratch that gemm_finish finishes as
 * another GEMM's product */
static void run_skinny(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t csb,
                       float *c, int64_t rsc, const gemm_epilogue *ep, float *ws) {
    const gemm_kernels *kern = plan->kern;
    const int64_t m = plan->m, n = plan->n, k = plan->k, es = (int64_t)opf_dtype_size(plan->ta);
    const int b16 = plan->tb == OPF_BF16;
    const int64_t lda16 = (k + 1) / 2 * 2; /* bfloat16 rows in the first m * k floats: m * lda16 / 2 of them */
    for (int64_t i = 0; i < m; i++) {
        const void *ai = (const char *)a + i * rsa * es;
        if (!plan->pairs) {
            convert_load_f32(kern->cvt, ws + i * k, ai, plan->ta, k, csa);
            continue;
        }
        float *staged = ws + m * k; /* past A, in the product's room (not yet written) */
        uint16_t *r16 = (uint16_t *)ws + i * lda16;
        convert_load_f32(kern->cvt, staged, ai, plan->ta, k, csa);
        kern->cvt->from_f32(r16, staged, OPF_BF16, k);
        if (lda16 > k) r16[k] = 0;
    }
    const int direct = c && ep->beta == 0.0f && !ep->alpha && !ep->out16 && !gemm_epilogue_needed(ep);
    /* columns in groups of 4 (the kernels' column block); a task reads at least ~32 KiB of B */
    const int64_t group = 4, groups = (n + group - 1) / group, per = group * k * (b16 ? 2 : 4);
    skinny_job job = {.fn = kern->skinny,
                      .pairs_fn = plan->pairs ? kern->skinny_pairs : NULL,
                      .m = m,
                      .k = k,
                      .n = n,
                      .ldb = csb,
                      .ldo = direct ? rsc : n,
                      .group = group,
                      .lda16 = lda16,
                      .a = ws,
                      .a16 = (const uint16_t *)ws,
                      .b = b,
                      .b16 = b16,
                      .out = direct ? c : ws + m * k};
    opf_parallel_for(0, groups, per >= 32768 ? 1 : 32768 / per, skinny_range, &job);
    if (!direct) gemm_finish(plan, job.out, OPF_F32, n, ep->beta != 0.0f, c, rsc, ep);
}

int64_t gemm_workspace(const gemm_plan *plan) { return plan->floats; }

int64_t gemm_slice_kp(const gemm_plan *plan, int64_t depth) {
    if (!plan->pairs) return depth;
    const int64_t kp = (depth + 1) / 2;
    return plan->kern->tile_pairs ? round_up(kp, plan->kern->tile_pairs) : kp;
}

int64_t gemm_pack_grain(int w, int64_t kp) {
    const int64_t bytes = (int64_t)w * kp * (int64_t)sizeof(float);
    return bytes >= 32768 ? 1 : 32768 / bytes;
}

int64_t gemm_pack_b_parts(const gemm_plan *plan, int64_t nslivers, int64_t kp) {
    const int64_t bytes = (int64_t)plan->kern->nr * kp * (int64_t)sizeof(float), most = bytes / GEMM_PACK_PART_MIN;
    if (nslivers <= 0 || nslivers >= plan->threads || most < 2) return 1;
    const int64_t parts = (plan->threads + nslivers - 1) / nslivers;
    return parts < most ? parts : most;
}

/* The epilogue of the C tile at row r, column col, for the K slice that is the product's first and / or last */
static gemm_tile slice_tile(const gemm_epilogue *ep, int first, int last, int64_t r, int64_t col, int64_t rsc) {
    return (gemm_tile){
        .load_c = !first || ep->beta != 0.0f,
        .beta = first ? ep->beta : 1.0f,
        .alpha = ep->alpha,
        .bias_n = last && ep->bias_kind == GEMM_BIAS_ROW ? ep->bias + col : NULL,
        .bias_m = last && ep->bias_kind == GEMM_BIAS_COL ? ep->bias + r : NULL,
        .act = last ? ep->act : ACT_NONE,
        .pre = last && ep->preact ? ep->preact + r * ep->rsp + col : NULL,
        .rsp = ep->rsp,
        .c16 = last && ep->out16 ? (uint16_t *)ep->out16 + r * rsc + col : NULL,
        .pre16 = last && ep->pre16 ? (uint16_t *)ep->pre16 + r * ep->rsp + col : NULL,
        .dt16 = ep->out_dt,
    };
}

/* The tiles of A's slivers [a_lo, a_hi) against the panel's B slivers [s_lo, s_hi): ap holds A's packed
 * slivers from a_lo on. Each B sliver stays in cache across the rows. */
static void compute_tiles(const gemm_job *job, const float *ap, int64_t a_lo, int64_t a_hi, int64_t s_lo,
                          int64_t s_hi) {
    const gemm_kernels *kern = job->kern;
    const gemm_epilogue *ep = job->ep;
    const int64_t i_lo = a_lo * kern->mr, i_hi = a_hi * kern->mr < job->m ? a_hi * kern->mr : job->m;
    const int first = job->pc == 0, last = job->pc + job->depth >= job->k;
    const int strip = job->pairs && kern->ukernel_strip ? GEMM_STRIP_MAX : 1;
    for (int64_t s = s_lo; s < s_hi; s++) {
        int64_t jj = s * kern->nr, n = job->nc - jj < kern->nr ? job->nc - jj : kern->nr, col = job->jc + jj;
        const float *bs = job->bp + s * kern->nr * job->kp;
        for (int64_t i = i_lo; i < i_hi; i += (int64_t)strip * kern->mr) {
            const int64_t rows = i_hi - i < (int64_t)strip * kern->mr ? i_hi - i : (int64_t)strip * kern->mr;
            const int count = (int)((rows + kern->mr - 1) / kern->mr);
            gemm_tile tiles[GEMM_STRIP_MAX];
            for (int t = 0; t < count; t++)
                tiles[t] = slice_tile(ep, first, last, i + (int64_t)t * kern->mr, col, job->rsc);
            const float *as = ap + ((i - i_lo) / kern->mr) * kern->mr * job->kp;
            float *cs = job->c ? job->c + i * job->rsc + col : NULL; /* NULL: one slice into out16 */
            if (strip > 1)
                kern->ukernel_strip(job->kp, (const uint32_t *)as, count, rows, (const uint32_t *)bs, cs, job->rsc,
                                    (int)n, tiles);
            else if (job->pairs)
                kern->ukernel_pairs(job->kp, (const uint32_t *)as, (const uint32_t *)bs, cs, job->rsc, (int)rows,
                                    (int)n, tiles);
            else
                kern->ukernel(job->depth, as, bs, cs, job->rsc, (int)rows, (int)n, tiles);
        }
    }
}

/* A pass's units and their dealing: gemm.h */
int64_t gemm_pass_units(const gemm_plan *plan, int64_t ntn) {
    return plan->own_a ? plan->mblocks : plan->slivers * ntn * plan->ksplit;
}

int64_t gemm_pass_workers(const gemm_plan *plan, int64_t ntn) {
    const int64_t units = gemm_pass_units(plan, ntn);
    return units < plan->threads ? units : plan->threads;
}

/* Unit u's A slivers [*a_lo, *a_hi) and chunk (*jn; own A blocks: 0, the whole panel) of its K slice (slices
 * run at once: u / (slivers x ntn), the units of each slice in the order of one pass) */
static void unit_at(const gemm_plan *plan, int64_t ntn, int64_t u, int64_t *a_lo, int64_t *a_hi, int64_t *jn) {
    if (plan->own_a) {
        *a_lo = plan->slivers * u / plan->mblocks, *a_hi = plan->slivers * (u + 1) / plan->mblocks, *jn = 0;
        return;
    }
    u %= plan->slivers * ntn;
    *jn = u / plan->slivers, *a_lo = u % plan->slivers, *a_hi = *a_lo + 1;
}

int64_t gemm_pass_most_tiles(const gemm_plan *plan, int64_t nslivers, int64_t ntn) {
    const int64_t units = gemm_pass_units(plan, ntn), workers = gemm_pass_workers(plan, ntn);
    int64_t most = 0;
    for (int64_t w = 0; w < workers; w++) {
        int64_t tiles = 0;
        for (int64_t u = units * w / workers, a_lo, a_hi, jn; u < units * (w + 1) / workers; u++) {
            unit_at(plan, ntn, u, &a_lo, &a_hi, &jn);
            tiles += (a_hi - a_lo) * (nslivers * (jn + 1) / ntn - nslivers * jn / ntn);
        }
        if (tiles > most) most = tiles;
    }
    return most;
}

/* Workers [w0, w1) of a pass, each running its units (gemm_pass_units).
 * Own A blocks: worker w packs each of its row blocks into its own slot, where the block stays in that
 * core's L2, and runs it against the whole panel.
 * Shared A (packed whole before the pass): a worker's run is a few chunks' rows, each chunk's B slivers
 * held in cache across its rows (gemm_col_chunks). */
static void compute_workers(int64_t w0, int64_t w1, void *ctx) {
    const gemm_job *job = ctx;
    const gemm_kernels *kern = job->kern;
    const gemm_plan *plan = &job->plan;
    const int64_t workers = plan->workers, units = gemm_pass_units(plan, job->ntn);
    const int64_t nslivers = (job->nc + kern->nr - 1) / kern->nr;
    for (int64_t w = w0; w < w1; w++) {
        const int64_t u1 = units * (w + 1) / workers;
        for (int64_t u = units * w / workers, next; u < u1; u = next) {
            int64_t a_lo, a_hi, jn;
            unit_at(plan, job->ntn, u, &a_lo, &a_hi, &jn);
            const float *ap = job->ap + a_lo * kern->mr * job->kp;
            if (plan->own_a) {
                float *own_a = job->ap + w * plan->mc * job->kp;
                gemm_pack_a(job, own_a, a_lo, a_lo, a_hi);
                ap = own_a, next = u + 1;
            } else { /* the run's rest of this chunk's rows, in one call */
                a_hi = a_lo + (u1 - u < plan->slivers - a_lo ? u1 - u : plan->slivers - a_lo);
                next = u + (a_hi - a_lo);
            }
            compute_tiles(job, ap, a_lo, a_hi, nslivers * jn / job->ntn, nslivers * (jn + 1) / job->ntn);
        }
    }
    if (kern->release) kern->release();
}

/* ---- a provider's products ---- */

static const gemm_provider *provider; /* read and written atomically: installed once, read per product */

void gemm_provider_set(const gemm_provider *p) { __atomic_store_n(&provider, p, __ATOMIC_RELEASE); }

const gemm_provider *gemm_provider_get(void) { return __atomic_load_n(&provider, __ATOMIC_ACQUIRE); }

int gemm_epilogue_needed(const gemm_epilogue *ep) {
    return ep->bias_kind != GEMM_BIAS_NONE || ep->act != ACT_NONE || ep->preact || ep->pre16;
}

typedef struct finish_job {
    const gemm_kernels *kern; /* the float32 table: its MR x NR tiles and its epilogue */
    const gemm_plan *plan;
    const void *prod;
    opf_dtype prod_dt;
    int64_t rs_prod;
    int with_c;
    float *c;
    int64_t rsc;
    const gemm_epilogue *ep;
} finish_job;

static void finish_range(int64_t b0, int64_t b1, void *ctx) {
    const finish_job *job = ctx;
    const gemm_kernels *kern = job->kern;
    const gemm_epilogue *ep = job->ep;
    const int mr = kern->mr, nr = kern->nr;
    const int64_t m = job->plan->m, n = job->plan->n;
    float acc[FINISH_TILE_MAX];
    for (int64_t i = b0 * mr; i < b1 * mr && i < m; i += mr) {
        const int mm = (int)(m - i < mr ? m - i : mr);
        for (int64_t j = 0; j < n; j += nr) {
            const int nn = (int)(n - j < nr ? n - j : nr);
            for (int r = 0; r < mm; r++) {
                if (job->prod_dt == OPF_F32)
                    memcpy(acc + r * nr, (const float *)job->prod + (i + r) * job->rs_prod + j, nn * sizeof(float));
                else
                    kern->cvt->to_f32(acc + r * nr, (const uint16_t *)job->prod + (i + r) * job->rs_prod + j,
                                      job->prod_dt, nn);
            }
            gemm_tile tile = {
                .load_c = job->with_c && ep->beta != 0.0f,
                .beta = ep->beta,
                .alpha = ep->alpha,
                .bias_n = ep->bias_kind == GEMM_BIAS_ROW ? ep->bias + j : NULL,
                .bias_m = ep->bias_kind == GEMM_BIAS_COL ? ep->bias + i : NULL,
                .act = ep->act,
                .pre = ep->preact ? ep->preact + i * ep->rsp + j : NULL,
                .rsp = ep->rsp,
                .c16 = ep->out16 ? (uint16_t *)ep->out16 + i * job->rsc + j : NULL,
                .pre16 = ep->pre16 ? (uint16_t *)ep->pre16 + i * ep->rsp + j : NULL,
                .dt16 = ep->out_dt,
            };
            float *cs = job->c ? job->c + i * job->rsc + j : NULL;
            if (kern->store)
                kern->store(acc, cs, job->rsc, mm, nn, &tile);
            else
                gemm_tile_store(acc, nr, cs, job->rsc, mm, nn, &tile);
        }
    }
}

void gemm_finish(const gemm_plan *plan, const void *prod, opf_dtype prod_dt, int64_t rs_prod, int with_c, float *c,
                 int64_t rsc, const gemm_epilogue *ep) {
    if (plan->m <= 0 || plan->n <= 0) return;
    const gemm_kernels *kern = plan->kern->f32 ? plan->kern->f32 : plan->kern;
    if (kern->mr * kern->nr > FINISH_TILE_MAX) kern = &gemm_kernels_ref;
    finish_job job = {.kern = kern,
                      .plan = plan,
                      .prod = prod,
                      .prod_dt = prod_dt,
                      .rs_prod = rs_prod,
                      .with_c = with_c,
                      .c = c,
                      .rsc = rsc,
                      .ep = ep};
    const int64_t blocks = (plan->m + kern->mr - 1) / kern->mr, per_block = kern->mr * plan->n;
    opf_parallel_for(0, blocks, per_block >= 16384 ? 1 : 16384 / per_block, finish_range, &job);
}

/* ---- K slices at once (gemm_plan.ksplit) ---- */

typedef struct ksplit_job {
    const gemm_job *job; /* the product's: A, B, C, the epilogue, the panel (jc, nc), plan.workers, ntn */
    gemm_job *slice;     /* the round's slices: pc, depth, kp, and where each one's A and B are packed */
    float *partial;      /* slice s's sums: m x ncr floats from s * m * ncr, row stride ncr */
    int64_t count, nslivers, ncr;
} ksplit_job;

/* B's slivers, then A's, of each slice of the round */
static void ksplit_pack(int64_t begin, int64_t end, void *ctx) {
    const ksplit_job *kj = ctx;
    const int64_t packs = kj->nslivers + kj->job->plan.slivers;
    for (int64_t t = begin; t < end; t++) {
        gemm_job *sj = &kj->slice[t / packs];
        const int64_t r = t % packs;
        if (r < kj->nslivers)
            gemm_pack_b_range(r, r + 1, sj);
        else
            gemm_pack_a_range(r - kj->nslivers, r - kj->nslivers + 1, sj);
    }
}

/* Workers [w0, w1): their units (gemm_pass_units: slice by slice, a tile each), each tile's sum over its
 * slice stored as it is (the slice's first and last, with no epilogue) into the slice's partial sums */
static void ksplit_compute(int64_t w0, int64_t w1, void *ctx) {
    const ksplit_job *kj = ctx;
    const gemm_plan *plan = &kj->job->plan;
    const int64_t per = plan->slivers * kj->job->ntn, units = per * kj->count, workers = plan->workers;
    const gemm_epilogue plain = {0};
    for (int64_t w = w0; w < w1 && w < workers; w++) {
        const int64_t u1 = units * (w + 1) / workers;
        for (int64_t u = units * w / workers, next; u < u1; u = next) {
            int64_t a_lo, a_hi, jn;
            unit_at(plan, kj->job->ntn, u, &a_lo, &a_hi, &jn);
            a_hi = a_lo + (u1 - u < plan->slivers - a_lo ? u1 - u : plan->slivers - a_lo); /* the chunk's run */
            next = u + (a_hi - a_lo);
            gemm_job cj = kj->slice[u / per];
            cj.ep = &plain, cj.k = cj.depth, cj.pc = 0, cj.jc = 0;
            cj.c = kj->partial + u / per * kj->job->m * kj->ncr, cj.rsc = kj->ncr;
            compute_tiles(&cj, cj.ap + a_lo * cj.kern->mr * cj.kp, a_lo, a_hi, kj->nslivers * jn / kj->job->ntn,
                          kj->nslivers * (jn + 1) / kj->job->ntn);
        }
    }
    if (kj->job->kern->release) kj->job->kern->release();
}

/* Row slivers [b0, b1) of the panel: each tile's partial sums added onto C slice after slice, in order, through
 * the epilogue each slice has when slices run one after another: the micro-kernel's own, tile for tile (its
 * table's `store`, or the scalar one) */
static void ksplit_reduce(int64_t b0, int64_t b1, void *ctx) {
    const ksplit_job *kj = ctx;
    const gemm_job *job = kj->job;
    const gemm_kernels *kern = job->kern;
    const int mr = kern->mr, nr = kern->nr;
    _Alignas(64) float acc[FINISH_TILE_MAX];
    for (int64_t i = b0 * mr; i < b1 * mr && i < job->m; i += mr) {
        const int mm = (int)(job->m - i < mr ? job->m - i : mr);
        for (int64_t jj = 0; jj < job->nc; jj += nr) {
            const int nn = (int)(job->nc - jj < nr ? job->nc - jj : nr);
            const int64_t col = job->jc + jj;
            float *cs = job->c ? job->c + i * job->rsc + col : NULL;
            for (int64_t s = 0; s < kj->count; s++) {
                const gemm_job *sj = &kj->slice[s];
                const float *ps = kj->partial + (s * job->m + i) * kj->ncr + jj;
                for (int r = 0; r < mm; r++) memcpy(acc + r * nr, ps + r * kj->ncr, (size_t)nn * sizeof(float));
                const gemm_tile tile = slice_tile(job->ep, sj->pc == 0, sj->pc + sj->depth >= job->k, i, col, job->rsc);
                if (kern->store)
                    kern->store(acc, cs, job->rsc, mm, nn, &tile);
                else
                    gemm_tile_store(acc, nr, cs, job->rsc, mm, nn, &tile);
            }
        }
    }
}

/* The panel's K slices, plan.ksplit at a time: packed, multiplied into their partial sums, added onto C */
static void run_ksplit(gemm_job *job, int64_t nslivers, float *workspace) {
    const gemm_plan *plan = &job->plan;
    const gemm_kernels *kern = job->kern;
    const int64_t max_depth = gemm_slice_depth(kern, plan->ta, plan->tb), ncr = nslivers * kern->nr;
    const int64_t a_floats = round_up(plan->m, kern->mr) * plan->kc_max, b_floats = ncr * plan->kc_max;
    gemm_job slice[GEMM_KSPLIT_MAX];
    ksplit_job kj = {.job = job,
                     .slice = slice,
                     .partial = workspace + plan->ksplit * (a_floats + b_floats),
                     .nslivers = nslivers,
                     .ncr = ncr};
    const int64_t blocks = plan->slivers;
    for (int64_t pc0 = 0; pc0 < plan->k; pc0 += plan->ksplit * max_depth) {
        kj.count = 0;
        for (int64_t pc = pc0; pc < plan->k && kj.count < plan->ksplit; pc += max_depth, kj.count++) {
            gemm_job *sj = &slice[kj.count];
            *sj = *job;
            sj->pc = pc, sj->depth = plan->k - pc < max_depth ? plan->k - pc : max_depth;
            sj->kp = gemm_slice_kp(plan, sj->depth);
            sj->ap = workspace + kj.count * (a_floats + b_floats), sj->bp = sj->ap + a_floats;
        }
        opf_parallel_for(0, kj.count * (nslivers + plan->slivers), 1, ksplit_pack, &kj);
        opf_parallel_for(0, plan->workers, 1, ksplit_compute, &kj);
        const int64_t per_block = kern->mr * job->nc * kj.count;
        opf_parallel_for(0, blocks, per_block >= 16384 ? 1 : 16384 / per_block, ksplit_reduce, &kj);
    }
}

/* The idle share of a pass whose units (rows row slivers x c chunks of a panel of nslivers) are dealt to
 * t threads in contiguous runs: 1 - the panel's tiles / (t x the most tiles one worker runs) */
static double chunks_idle(int64_t rows, int64_t nslivers, int64_t c, int64_t t) {
    const int64_t units = rows * c, workers = units < t ? units : t, most = (units + workers - 1) / workers;
    return 1.0 - (double)(rows * nslivers) / ((double)t * (double)(most * (nslivers / c)));
}

int64_t gemm_col_chunks(const gemm_plan *plan, int64_t nslivers) {
    if (plan->own_a || nslivers <= 1 || plan->slivers <= 0) return 1;
    if (plan->ksplit > 1) return nslivers; /* slices at once: few tiles, each a unit */
    const int64_t t = plan->threads, rows = plan->slivers;
    double least = 1.0; /* chunks of one width (a divisor of nslivers): every unit the same work */
    for (int64_t c = 1; c <= nslivers; c++) {
        const double idle = nslivers % c ? 1.0 : chunks_idle(rows, nslivers, c, t);
        if (idle < least) least = idle;
    }
    int64_t best = 1;
    double best_traffic = -1.0;
    for (int64_t c = 1; c <= nslivers; c++) {
        if (nslivers % c || chunks_idle(rows, nslivers, c, t) > least + GEMM_IDLE_SLACK) continue;
        /* the packed A and B read per tile by a worker whose run is r rows of one chunk (a sliver of A is
         * MR rows, one of B NR columns, both kp deep): MR / width + NR / r */
        const int64_t units = rows * c, workers = units < t ? units : t;
        const double r = (double)units / (double)workers < (double)rows ? (double)units / (double)workers : rows;
        const double traffic = (double)plan->kern->mr / (double)(nslivers / c) + (double)plan->kern->nr / r;
        if (best_traffic < 0.0 || traffic < best_traffic) best = c, best_traffic = traffic;
    }
    return best;
}

/* The product offered to the provider pv: 1 if it ran it */
static int offer(const gemm_provider *pv, const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b,
                 int64_t rsb, int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep, float *workspace,
                 int64_t ws_floats, int claimed, int64_t class_m) {
    const gemm_call call = {.plan = plan,
                            .a = a,
                            .rsa = rsa,
                            .csa = csa,
                            .b = b,
                            .rsb = rsb,
                            .csb = csb,
                            .c = c,
                            .rsc = rsc,
                            .ep = ep,
                            .workspace = workspace,
                            .ws_floats = ws_floats,
                            .claimed = claimed,
                            .class_m = class_m};
    return pv->run(&call);
}

int gemm_run(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb, int64_t csb,
             float *c, int64_t rsc, const gemm_epilogue *ep, float *workspace, int64_t ws_floats) {
    const gemm_provider *pv = gemm_provider_get();
    if (pv && plan->m > 0 && plan->n > 0 && plan->k > 0) {
        if (ws_floats < plan->floats) return -1; /* a caller that sized for another product, whoever runs it */
        if (offer(pv, plan, a, rsa, csa, b, rsb, csb, c, rsc, ep, workspace, ws_floats, 0, 0)) return 0;
    }
    return gemm_run_own(plan, a, rsa, csa, b, rsb, csb, c, rsc, ep, workspace, ws_floats);
}

int gemm_run_claimed(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb,
                     int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep, int64_t class_m) {
    const gemm_provider *pv = gemm_provider_get();
    if (plan->m <= 0 || plan->n <= 0) return 0;
    return pv && plan->k > 0 && offer(pv, plan, a, rsa, csa, b, rsb, csb, c, rsc, ep, NULL, 0, 1, class_m) ? 0 : -1;
}

int gemm_provider_claims(const gemm_plan *plan, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                         const gemm_epilogue *ep) {
    const gemm_provider *pv = gemm_provider_get();
    if (!pv || !pv->claims || plan->m <= 0 || plan->n <= 0 || plan->k <= 0) return 0;
    const gemm_call call = {.plan = plan, .rsa = rsa, .csa = csa, .rsb = rsb, .csb = csb, .ep = ep};
    return pv->claims(&call);
}

int gemm_provider_settled(const gemm_plan *plan, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                          const gemm_epilogue *ep) {
    const gemm_provider *pv = gemm_provider_get();
    if (!pv || !pv->claims || plan->m <= 0 || plan->n <= 0 || plan->k <= 0) return 1;
    const gemm_call call = {.plan = plan, .rsa = rsa, .csa = csa, .rsb = rsb, .csb = csb, .ep = ep};
    return pv->settled && pv->settled(&call);
}

int gemm_run_own(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb,
                 int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep, float *workspace, int64_t ws_floats) {
    const gemm_kernels *kern = plan->kern;
    const int64_t m = plan->m, n = plan->n, k = plan->k;
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) { /* empty sum: the epilogue alone */
        gemm_ref_f32(m, n, 0, NULL, 0, 0, NULL, 0, 0, c, rsc, ep);
        return 0;
    }
    if (ws_floats < plan->floats) return -1; /* a caller that sized for another product */
    const int skinny = plan->skinny && rsb == 1;
    if (opf_log_enabled(OPF_LOG_INFO)) { /* the path's name: the skinny product's, else the table's */
        const char *name = !skinny ? NULL : plan->pairs ? kern->skinny_pairs_name : kern->skinny_name;
        opf_log_note_pick(gemm_variants.family, name ? name : kern->name, kern->isa);
    }
    if (skinny) {
        run_skinny(plan, a, rsa, csa, b, csb, c, rsc, ep, workspace);
        return 0;
    }
    gemm_job job = {.kern = kern,
                    .ep = ep,
                    .m = m,
                    .k = k,
                    .a = a,
                    .b = b,
                    .ta = plan->ta,
                    .tb = plan->tb,
                    .rsa = rsa,
                    .csa = csa,
                    .rsb = rsb,
                    .csb = csb,
                    .rsc = rsc,
                    .c = c,
                    .ap = workspace,
                    .bp = workspace + plan->b_offset,
                    .plan = *plan,
                    .pairs = plan->pairs};
    const int64_t max_depth = gemm_slice_depth(kern, plan->ta, plan->tb);
    const int64_t mslivers = plan->slivers;
    for (int64_t jc = 0; jc < n; jc += kern->nc) {
        job.jc = jc;
        job.nc = n - jc < kern->nc ? n - jc : kern->nc;
        int64_t nslivers = (job.nc + kern->nr - 1) / kern->nr;
        job.ntn = gemm_col_chunks(plan, nslivers);
        job.plan.workers = gemm_pass_workers(plan, job.ntn); /* own_a: plan.workers (mblocks >= 2 threads) */
        if (plan->ksplit > 1) {
            run_ksplit(&job, nslivers, workspace);
            continue;
        }
        for (int64_t pc = 0; pc < k; pc += max_depth) {
            job.pc = pc;
            job.depth = k - pc < max_depth ? k - pc : max_depth;
            job.kp = gemm_slice_kp(plan, job.depth);
            job.b_parts = gemm_pack_b_parts(plan, nslivers, job.kp);
            if (job.b_parts > 1)
                opf_parallel_for(0, nslivers * job.b_parts, 1, gemm_pack_b_parts_range, &job);
            else
                opf_parallel_for(0, nslivers, gemm_pack_grain(kern->nr, job.kp), gemm_pack_b_range, &job);
            if (!plan->own_a) /* blocks shared by tasks */
                opf_parallel_for(0, mslivers, gemm_pack_grain(kern->mr, job.kp), gemm_pack_a_range, &job);
            opf_parallel_for(0, job.plan.workers, 1, compute_workers, &job);
        }
    }
    return 0;
}
