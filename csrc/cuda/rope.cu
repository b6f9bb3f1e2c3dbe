/*
 * Rotary position embedding on the GPU: q and k (or their gradients) rotated
 * in one launch, with the formulas of csrc/kernels/rope.h. Products are
 * rounded and summed (no FMA: __fmul_rn / __dmul_rn), as every CPU variant
 * does, so float32 and float64 match the CPU op bit for bit; bfloat16 /
 * float16 compute in float32 and round once.
 *
 * A row is one head of q or k at one position; a thread owns one unit of a
 * row -- V pairs (j, j + R/2) of the half-split form as two packs, one pack
 * of V / 2 pairs (2i, 2i+1) of the interleaved form, or one pack of the
 * pass-through dims R..D -- and loads its x, cos and sin together, so that
 * every load is in flight at once and a thread needs few registers (many
 * threads in flight). Each input is read from memory once: the heads of a
 * position lie in the same block (several rows per block, heads innermost),
 * whose cos / sin loads hit the caches after the first. A pack is 16 bytes
 * (4 floats, 8 halves) when every row is a 16-byte aligned unit-stride run
 * whose halves (or pairs) fill whole packs, else one element (one pair) at
 * any strides. Grid-stride over rows.
 */
#include <math.h>

#include "opforge/cuda_kernel.cuh"
#include "rope.h"

#define ROPE_THREADS ROPE_CUDA_THREADS
/* blocks per launch at most: 16 per multiprocessor of the largest GPUs (132 SMs), the rest by the
 * grid-stride loop over rows */
#ifdef OPF_CUDA_EMULATE
#define ROPE_MAX_BLOCKS 5 /* the C tests' emulation: a few blocks, so that they run the grid-stride loop */
#else
#define ROPE_MAX_BLOCKS 4096
#endif

/* The three kernels: pairs (j, j + R/2) at any strides, one element each (also the interleaved form's
 * (2i, 2i+1) there); V such pairs of unit-stride runs (half-split, vector); one pack of V / 2 adjacent
 * pairs (interleaved, vector). */
enum { ROPE_SCALAR = 0, ROPE_HALF = 1, ROPE_PAIRS = 2 };

/* Elements per pack: 16 bytes (4 floats, 8 halves) in the vector kernels */
template <class T, int FORM> struct rope_form {
    enum { V = FORM == ROPE_SCALAR ? 1 : 16 / (int)sizeof(T) };
};
static int rope_pack_elems(opf_dtype dt, int form) { return form == ROPE_SCALAR ? 1 : 16 / (int)opf_dtype_size(dt); }

template <class T, int V> struct alignas(sizeof(T) * V) rope_pack { T v[V]; };

/* a product rounded on its own: never contracted with the sum into an FMA */
#ifdef OPF_CUDA_EMULATE
__device__ __forceinline__ float rope_mul(float a, float b) { return a * b; }
__device__ __forceinline__ double rope_mul(double a, double b) { return a * b; }
#else
__device__ __forceinline__ float rope_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double rope_mul(double a, double b) { return __dmul_rn(a, b); }
#endif

/* The pair (a, b) = (j, partner) with a the first of the two (first half, or even index):
 *   forward  oa = xa ca - xb sa,  ob = xb cb + xa sb
 *   inverse  oa = xa ca + xb sb,  ob = xb cb - xa sa   (the transpose) */
template <class T>
__device__ __forceinline__ void rope_pair(T xa_, T xb_, T ca_, T cb_, T sa_, T sb_, int inverse, T &oa, T &ob) {
    typedef typename opf_acc<T>::type A;
    const A xa = opf_to_acc(xa_), xb = opf_to_acc(xb_), ca = opf_to_acc(ca_), cb = opf_to_acc(cb_),
            sa = opf_to_acc(sa_), sb = opf_to_acc(sb_);
    if (!inverse) {
        oa = opf_from_acc<T>(rope_mul(xa, ca) + rope_mul(-xb, sa));
        ob = opf_from_acc<T>(rope_mul(xb, cb) + rope_mul(xa, sb));
    } else {
        oa = opf_from_acc<T>(rope_mul(xa, ca) + rope_mul(xb, sb));
        ob = opf_from_acc<T>(rope_mul(xb, cb) + rope_mul(-xa, sa));
    }
}

/* pack of elements j0.. of a row: one 16-byte access (V > 1, unit stride), or element j0 at stride st */
template <class T, int V> __device__ __forceinline__ rope_pack<T, V> rope_ld(const T *x, int64_t j0, int64_t st) {
    if (V > 1) return *(const rope_pack<T, V> *)(x + j0);
    rope_pack<T, V> r;
    r.v[0] = x[j0 * st];
    return r;
}
template <class T, int V>
__device__ __forceinline__ void rope_st(T *o, int64_t j0, int64_t st, const rope_pack<T, V> &v) {
    if (V > 1)
        *(rope_pack<T, V> *)(o + j0) = v;
    else
        o[j0 * st] = v.v[0];
}

/* How a launch's threads cover the rows: a row is one head of q or k at one position, (b, n, h) with
 * the heads of q before those of k, cut into units. */
struct rope_plan {
    int64_t rows;    /* B * N * (Hq + Hk) */
    int urot, units; /* units of the rotated dims, and with the pass-through ones */
    int ustep;       /* units > ustep: a thread loops over a row's units at this step */
    int rpb;         /* rows per block and grid-stride step */
    int narrow;      /* rows and positions fit 32 bits: 32-bit divisions */
};

template <class T, int FORM>
__global__ void __launch_bounds__(ROPE_THREADS) rope_rows(rope_cuda_problem p, rope_plan pl) {
    enum { V = rope_form<T, FORM>::V };
    typedef rope_pack<T, V> P;
    const int u0 = pl.units <= pl.ustep ? (int)threadIdx.x % pl.units : (int)threadIdx.x;
    const int sub = pl.units <= pl.ustep ? (int)threadIdx.x / pl.units : 0;
    if (sub >= pl.rpb) return; /* the block's rounding to whole warps; no barrier follows */
    const int64_t heads = p.hq + p.hk, half = p.r / 2;
    P nans; /* what a position outside the table gives */
#pragma unroll
    for (int e = 0; e < V; e++) nans.v[e] = opf_from_acc<T>((typename opf_acc<T>::type)NAN);
    for (int64_t row = (int64_t)blockIdx.x * pl.rpb + sub; row < pl.rows; row += (int64_t)gridDim.x * pl.rpb) {
        int64_t pos, b;
        if (pl.narrow) {
            pos = (uint32_t)row / (uint32_t)heads;
            b = (uint32_t)pos / (uint32_t)p.n;
        } else {
            pos = row / heads;
            b = pos / p.n;
        }
        const int64_t h = row - pos * heads, i = pos - b * p.n;
        int64_t crow = b * p.cb + i * p.cn, srow = b * p.sb + i * p.sn;
        bool bad = false;
        if (p.pos) {
            const int64_t at = p.pos[b * p.pb + i * p.pn];
            bad = at < 0 || at >= p.table_rows;
            crow = bad ? 0 : at * p.cn;
            srow = bad ? 0 : at * p.sn;
        }
        const T *c = (const T *)p.cos + crow, *s = (const T *)p.sin + srow;
        const bool isq = h < p.hq;
        const T *x;
        T *o;
        int64_t xs, os;
        if (isq) {
            x = (const T *)p.q + b * p.qs[0] + h * p.qs[1] + i * p.qs[2], xs = p.qs[3];
            o = (T *)p.oq + b * p.oqs[0] + h * p.oqs[1] + i * p.oqs[2], os = p.oqs[3];
        } else {
            x = (const T *)p.k + b * p.ks[0] + (h - p.hq) * p.ks[1] + i * p.ks[2], xs = p.ks[3];
            o = (T *)p.ok + b * p.oks[0] + (h - p.hq) * p.oks[1] + i * p.oks[2], os = p.oks[3];
        }
        for (int u = u0; u < pl.units; u += pl.ustep) {
            if (u >= pl.urot) { /* pass-through dims: a copy (NaN at a position outside the table) */
                const int64_t j = p.r + (int64_t)(u - pl.urot) * V;
                rope_st<T, V>(o, j, os, bad ? nans : rope_ld<T, V>(x, j, xs));
                continue;
            }
            /* the unit's elements: runs a and b of the pairs (FORM != ROPE_PAIRS), or one run of pairs */
            const int64_t ja = FORM != ROPE_SCALAR ? (int64_t)u * V : p.interleaved ? 2 * (int64_t)u : u;
            const int64_t jb = FORM == ROPE_PAIRS ? ja : FORM == ROPE_HALF || !p.interleaved ? ja + half : ja + 1;
            P xa = rope_ld<T, V>(x, ja, xs), xb, ca = nans, cb = nans, sa = nans, sb = nans, oa, ob;
            if (FORM != ROPE_PAIRS) xb = rope_ld<T, V>(x, jb, xs);
            if (!bad) {
                ca = rope_ld<T, V>(c, ja, p.cr), sa = rope_ld<T, V>(s, ja, p.sr);
                if (FORM != ROPE_PAIRS) cb = rope_ld<T, V>(c, jb, p.cr), sb = rope_ld<T, V>(s, jb, p.sr);
            }
            if (FORM == ROPE_PAIRS) {
#pragma unroll
                for (int e = 0; e < V; e += 2)
                    rope_pair(xa.v[e], xa.v[e + 1], ca.v[e], ca.v[e + 1], sa.v[e], sa.v[e + 1], p.inverse, oa.v[e],
                              oa.v[e + 1]);
            } else {
#pragma unroll
                for (int e = 0; e < V; e++)
                    rope_pair(xa.v[e], xb.v[e], ca.v[e], cb.v[e], sa.v[e], sb.v[e], p.inverse, oa.v[e], ob.v[e]);
                rope_st<T, V>(o, jb, os, ob);
            }
            rope_st<T, V>(o, ja, os, oa);
        }
    }
}

/* every stride of a dim of more than one element a multiple of v */
static bool rope_strides_ok(const int64_t *sizes, const int64_t *st, int64_t v) {
    for (int d = 0; d < 3; d++)
        if (sizes[d] > 1 && st[d] % v != 0) return false;
    return true;
}

/* The vector kernel of p's convention when its rows allow it, else ROPE_SCALAR. */
static int rope_pick_form(opf_dtype dt, const rope_cuda_problem *p) {
    const int form = p->interleaved ? ROPE_PAIRS : ROPE_HALF;
    const int64_t v = rope_pack_elems(dt, form), bytes = v * (int64_t)opf_dtype_size(dt);
    const int64_t qsz[] = {p->b, p->hq, p->n}, ksz[] = {p->b, p->hk, p->n};
    if (p->qs[3] != 1 || p->ks[3] != 1 || p->oqs[3] != 1 || p->oks[3] != 1) return ROPE_SCALAR;
    if ((form == ROPE_PAIRS ? p->r : p->r / 2) % v != 0 || (p->d - p->r) % v != 0) return ROPE_SCALAR;
    const void *ptrs[] = {p->q, p->k, p->oq, p->ok, p->cos, p->sin};
    for (int i = 0; i < (p->r > 0 ? 6 : 4); i++)
        if ((uintptr_t)ptrs[i] % (uintptr_t)bytes != 0) return ROPE_SCALAR;
    if (!rope_strides_ok(qsz, p->qs, v) || !rope_strides_ok(qsz, p->oqs, v) || !rope_strides_ok(ksz, p->ks, v) ||
        !rope_strides_ok(ksz, p->oks, v))
        return ROPE_SCALAR;
    if (p->r > 0 && (p->cr != 1 || p->sr != 1 || p->cb % v || p->cn % v || p->sb % v || p->sn % v)) return ROPE_SCALAR;
    return form;
}

extern "C" int rope_cuda_vector(opf_dtype dt, const rope_cuda_problem *p) {
    return rope_pick_form(dt, p) != ROPE_SCALAR;
}

/* Units of a row, rows per block; the threads of a block and the grid. */
static rope_plan rope_make_plan(const rope_cuda_problem *p, int form, int v, int *threads, unsigned *grid) {
    rope_plan pl;
    const int64_t positions = p->b * p->n;
    pl.rows = positions * (p->hq + p->hk);
    pl.narrow = pl.rows <= (int64_t)UINT32_MAX;
    pl.urot = (int)(form == ROPE_PAIRS ? p->r / v : p->r / 2 / v);
    pl.units = pl.urot + (int)((p->d - p->r) / v);
    if (pl.units >= ROPE_THREADS) {
        pl.ustep = ROPE_THREADS;
        pl.rpb = 1;
        *threads = ROPE_THREADS;
    } else {
        pl.ustep = pl.units;
        pl.rpb = ROPE_THREADS / pl.units;
        *threads = (pl.units * pl.rpb + 31) / 32 * 32;
    }
    *grid = opf_cuda_blocks(pl.rows, pl.rpb, ROPE_MAX_BLOCKS);
    return pl;
}

template <class T, int FORM> static unsigned rope_launch(const rope_cuda_problem *p, cudaStream_t s) {
    int threads;
    unsigned grid;
    const rope_plan pl = rope_make_plan(p, FORM, rope_form<T, FORM>::V, &threads, &grid);
    auto kernel = rope_rows<T, FORM>;
    OPF_LAUNCH(kernel, grid, threads, 0, s, *p, pl);
    return grid;
}

template <class T> static unsigned rope_launch_form(const rope_cuda_problem *p, int form, cudaStream_t s) {
    switch (form) {
    case ROPE_HALF: return rope_launch<T, ROPE_HALF>(p, s);
    case ROPE_PAIRS: return rope_launch<T, ROPE_PAIRS>(p, s);
    default: return rope_launch<T, ROPE_SCALAR>(p, s);
    }
}

/* The launcher the glue calls. Returns the number of blocks launched (0 when there was nothing to
 * do), for the log line; the glue reads the runtime's error. */
extern "C" unsigned rope_cuda(opf_dtype dt, const rope_cuda_problem *p, void *stream) {
    if (p->b * p->n == 0 || p->hq + p->hk == 0 || p->d == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    const int form = rope_pick_form(dt, p);
    switch (dt) {
    case OPF_F32: return rope_launch_form<float>(p, form, s);
    case OPF_F64: return rope_launch_form<double>(p, form, s);
    case OPF_BF16: return rope_launch_form<__nv_bfloat16>(p, form, s);
    case OPF_F16: return rope_launch_form<__half>(p, form, s);
    default: return 0;
    }
}
