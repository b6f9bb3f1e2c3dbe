/*
 * softmax and log_softmax on the GPU along one dim, and their backwards from
 * the saved output (formulas, and what -inf, +inf and NaN give: csrc/kernels/softmax.h).
 * Memory-bound: a kernel reads its inputs once and writes its output once when
 * the line fits in registers. Paths (sm_path):
 *   warp:  rows of stride 1 up to 512 (32 lanes * 16 elements): a warp per row, 8 rows per block,
 *          the row in registers (1, 2 or 4 packs per lane);
 *   block: rows of stride 1 up to 16384 (1024 threads * 16 elements): a block per row (128 to 1024
 *          threads), the row in registers, two block reductions (max, then sum);
 *   loop:  longer rows, strided rows, and float64 (whose exponential needs the registers): a warp
 *          (rows up to 512) or a block of 512 per row, an online max and sum of exponentials in one
 *          pass, then a second read of the row (mostly from L2) to write it;
 *   lanes: the reduced dim is strided but another dim has stride 1: 32 adjacent lines of it per tile
 *          (coalesced), 1 to 8 warps splitting the reduction, combined through shared memory.
 * A row of stride 1 moves 16-byte packs between its first and last 16-byte boundary (the elements
 * before and after one by one) when its operands lie equally far from a boundary; a row whose
 * operands do not (or of another stride) goes element by element through the two-pass line loop,
 * in whichever kernel meets it. Registers hold the storage type (4 floats, 2 doubles, 8 halves per
 * pack); the arithmetic is float (double for float64), exponentials recomputed where the output
 * needs them.
 */
#include <math.h>
#include <string.h>

#include "opforge/cuda_kernel.cuh"
#include "rows.cuh"
#include "softmax.h"

#define SM_WARP_ROWS 8 /* rows (warps) per block of the warp paths */
#define SM_LOOP_THREADS 512
#define SM_MAX_BLOCKS 4096 /* the rest by grid-stride loops */

/* packs per thread of a row held in registers: 16 elements, what 64 registers hold next to the rest
 * (float64 takes the two-pass kernels: its exponential alone needs most of them) */
template <class T> struct sm_np { static const int value = 16 / row_io<T>::V; };

__device__ __forceinline__ float sm_log(float v) { return logf(v); }
__device__ __forceinline__ double sm_log(double v) { return log(v); }

/* reductions over the group of a line: its warp, or the whole block (scratch: 32 values) */
template <bool WARP, class A> __device__ __forceinline__ A sm_group_max(A v, A *scratch) {
    if constexpr (WARP)
        return opf_warp_max(v);
    else
        return opf_block_max(v, scratch);
}
template <bool WARP, class A> __device__ __forceinline__ A sm_group_sum(A v, A *scratch) {
    if constexpr (WARP)
        return opf_warp_sum(v);
    else
        return opf_block_sum(v, scratch);
}

/* row_online1 (rows.cuh) over K packs at once: one rescale per batch. A row of -inf only keeps s = 0
 * and m = -inf, and its outputs come out NaN from x - m, as the reference's. */
template <class T, int K, class A> __device__ __forceinline__ void sm_online(A &m, A &s, const row_pack *pk) {
    const int V = row_io<T>::V;
    A pm = row_io<T>::get(pk[0], 0);
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int v = 0; v < V; v++) pm = opf_max(pm, row_io<T>::get(pk[k], v));
    const A mn = opf_max(m, pm);
    if (mn == (A)-INFINITY) return;
    if (mn != m) s *= row_exp(m - mn);
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int v = 0; v < V; v++) s += row_exp(row_io<T>::get(pk[k], v) - mn);
    m = mn;
}
template <class A> __device__ __forceinline__ void sm_warp_merge(A &m, A &s) {
    for (int k = 16; k > 0; k >>= 1) {
        A m2 = __shfl_xor_sync(0xffffffffu, m, k), s2 = __shfl_xor_sync(0xffffffffu, s, k);
        row_merge(m, s, m2, s2);
    }
}
/* the pair of the group (every thread of it gets it); scratch: 64 values */
template <bool WARP, class A> __device__ __forceinline__ void sm_group_merge(A &m, A &s, A *scratch) {
    sm_warp_merge(m, s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (WARP || warps == 1) return;
    if (lane == 0) scratch[warp] = m, scratch[32 + warp] = s;
    __syncthreads();
    m = lane < warps ? scratch[lane] : (A)-INFINITY;
    s = lane < warps ? scratch[32 + lane] : (A)0;
    sm_warp_merge(m, s);
    __syncthreads();
}

/* ---- one line in two passes (any length, any strides) ------------------------------ */

template <class T, bool WARP, class A>
__device__ __forceinline__ void sm_fwd_line(T *yr, const T *xr, int64_t n, int64_t ys, int64_t xs, const row_span &sp,
                                            int is_log, int tid, int G, A *scratch) {
    const int V = row_io<T>::V;
    A m = (A)-INFINITY, s = 0;
    if (sp.vec) {
        if (tid < sp.head) row_online1(m, s, opf_to_acc(xr[tid]));
        const row_pack *xp = (const row_pack *)(xr + sp.head);
        int64_t q = tid;
        for (; q + 3 * (int64_t)G < sp.npk; q += 4 * (int64_t)G) {
            row_pack pk[4];
#pragma unroll
            for (int u = 0; u < 4; u++) pk[u] = xp[q + u * (int64_t)G];
            sm_online<T, 4>(m, s, pk);
        }
        for (; q < sp.npk; q += G) sm_online<T, 1>(m, s, &xp[q]);
        if (sp.tail0 + tid < n) row_online1(m, s, opf_to_acc(xr[sp.tail0 + tid]));
    } else {
        for (int64_t e = tid; e < n; e += G) row_online1(m, s, opf_to_acc(xr[e * xs]));
    }
    sm_group_merge<WARP>(m, s, scratch);
    const A ls = m + sm_log(s), inv = (A)1 / s;
#define SM_FWD_OUT(v) (is_log ? (v)-ls : row_exp((v)-m) * inv)
    if (sp.vec) {
        if (tid < sp.head) yr[tid] = opf_from_acc<T>(SM_FWD_OUT(opf_to_acc(xr[tid])));
        const row_pack *xp = (const row_pack *)(xr + sp.head);
        row_pack *yp = (row_pack *)(yr + sp.head);
        for (int64_t q = tid; q < sp.npk; q += G) {
            row_pack pk = xp[q];
#pragma unroll
            for (int v = 0; v < V; v++) row_io<T>::set(pk, v, SM_FWD_OUT(row_io<T>::get(pk, v)));
            yp[q] = pk;
        }
        const int64_t e = sp.tail0 + tid;
        if (e < n) yr[e] = opf_from_acc<T>(SM_FWD_OUT(opf_to_acc(xr[e])));
    } else {
        for (int64_t e = tid; e < n; e += G) yr[e * ys] = opf_from_acc<T>(SM_FWD_OUT(opf_to_acc(xr[e * xs])));
    }
#undef SM_FWD_OUT
}

#define SM_BWD_TERM(gv, ov) (is_log ? (gv) : (gv) * (ov))
#define SM_BWD_OUT(gv, ov) (is_log ? (gv)-row_exp(ov) * s : (ov) * ((gv)-s))

template <class T, bool WARP, class A>
__device__ __forceinline__ void sm_bwd_line(T *dxr, const T *dyr, const T *yr, int64_t n, int64_t dxs, int64_t dys,
                                            int64_t ys, const row_span &sp, int is_log, int tid, int G, A *scratch) {
    const int V = row_io<T>::V;
    A s = 0;
    if (sp.vec) {
        if (tid < sp.head) s += SM_BWD_TERM(opf_to_acc(dyr[tid]), opf_to_acc(yr[tid]));
        const row_pack *gp = (const row_pack *)(dyr + sp.head), *op = (const row_pack *)(yr + sp.head);
        for (int64_t q = tid; q < sp.npk; q += G) {
            const row_pack gk = gp[q], ok = op[q];
#pragma unroll
            for (int v = 0; v < V; v++) s += SM_BWD_TERM(row_io<T>::get(gk, v), row_io<T>::get(ok, v));
        }
        const int64_t e = sp.tail0 + tid;
        if (e < n) s += SM_BWD_TERM(opf_to_acc(dyr[e]), opf_to_acc(yr[e]));
    } else {
        for (int64_t e = tid; e < n; e += G) s += SM_BWD_TERM(opf_to_acc(dyr[e * dys]), opf_to_acc(yr[e * ys]));
    }
    s = sm_group_sum<WARP>(s, scratch);
    if (sp.vec) {
        if (tid < sp.head) dxr[tid] = opf_from_acc<T>(SM_BWD_OUT(opf_to_acc(dyr[tid]), opf_to_acc(yr[tid])));
        const row_pack *gp = (const row_pack *)(dyr + sp.head), *op = (const row_pack *)(yr + sp.head);
        row_pack *dp = (row_pack *)(dxr + sp.head);
        for (int64_t q = tid; q < sp.npk; q += G) {
            row_pack gk = gp[q];
            const row_pack ok = op[q];
#pragma unroll
            for (int v = 0; v < V; v++) row_io<T>::set(gk, v, SM_BWD_OUT(row_io<T>::get(gk, v), row_io<T>::get(ok, v)));
            dp[q] = gk;
        }
        const int64_t e = sp.tail0 + tid;
        if (e < n) dxr[e] = opf_from_acc<T>(SM_BWD_OUT(opf_to_acc(dyr[e]), opf_to_acc(yr[e])));
    } else {
        for (int64_t e = tid; e < n; e += G)
            dxr[e * dxs] = opf_from_acc<T>(SM_BWD_OUT(opf_to_acc(dyr[e * dys]), opf_to_acc(yr[e * ys])));
    }
}

template <class T, bool WARP>
__global__ void __launch_bounds__(SM_LOOP_THREADS)
    sm_fwd_loop(T *__restrict__ y, const T *__restrict__ x, softmax_cuda_lines L, int is_log) {
    typedef typename opf_acc<T>::type A;
    __shared__ A scratch[64];
    int64_t line, step;
    int tid, G;
    row_group_first<WARP>(line, step, tid, G);
    for (; line < L.outer.numel; line += step) {
        const T *xr = x + opf_cuda_offset(L.outer, 1, line);
        T *yr = y + opf_cuda_offset(L.outer, 0, line);
        const row_span sp = row_span_of(xr, (const T *)yr, (const T *)yr, L.n, L.nstride[0] == 1 && L.nstride[1] == 1);
        sm_fwd_line<T, WARP>(yr, xr, L.n, L.nstride[0], L.nstride[1], sp, is_log, tid, G, scratch);
    }
}

template <class T, bool WARP>
__global__ void __launch_bounds__(SM_LOOP_THREADS)
    sm_bwd_loop(T *__restrict__ dx, const T *__restrict__ dy, const T *__restrict__ y, softmax_cuda_lines L,
                int is_log) {
    typedef typename opf_acc<T>::type A;
    __shared__ A scratch[32];
    int64_t line, step;
    int tid, G;
    row_group_first<WARP>(line, step, tid, G);
    for (; line < L.outer.numel; line += step) {
        T *dxr = dx + opf_cuda_offset(L.outer, 0, line);
        const T *dyr = dy + opf_cuda_offset(L.outer, 1, line), *yr = y + opf_cuda_offset(L.outer, 2, line);
        const row_span sp =
            row_span_of(dyr, yr, (const T *)dxr, L.n, L.nstride[0] == 1 && L.nstride[1] == 1 && L.nstride[2] == 1);
        sm_bwd_line<T, WARP>(dxr, dyr, yr, L.n, L.nstride[0], L.nstride[1], L.nstride[2], sp, is_log, tid, G, scratch);
    }
}

/* ---- rows held in registers ------------------------------------------------------ */

/* A row's span in a thread's registers: the head element tid (< V, so tid < G covers it), packs
 * tid + k*G, the tail element tail0 + tid; missing ones get `fill`. */
template <class T, int NP, class A>
__device__ __forceinline__ void sm_load(row_pack (&r)[NP], A &hv, A &tv, const T *p, int64_t n, const row_span &sp,
                                        int tid, int G, A fill) {
    const int V = row_io<T>::V;
    const row_pack *pp = (const row_pack *)(p + sp.head);
    const int npk = (int)sp.npk;
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int q = tid + k * G;
        if (q < npk)
            r[k] = pp[q];
        else
#pragma unroll
            for (int v = 0; v < V; v++) row_io<T>::set(r[k], v, fill);
    }
    hv = tid < sp.head ? opf_to_acc(p[tid]) : fill;
    tv = sp.tail0 + tid < n ? opf_to_acc(p[sp.tail0 + tid]) : fill;
}

template <class T, int NP, class A>
__device__ __forceinline__ void sm_store(T *p, const row_pack (&r)[NP], A hv, A tv, int64_t n, const row_span &sp,
                                         int tid, int G) {
    row_pack *pp = (row_pack *)(p + sp.head);
    const int npk = (int)sp.npk;
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int q = tid + k * G;
        if (q < npk) pp[q] = r[k];
    }
    if (tid < sp.head) p[tid] = opf_from_acc<T>(hv);
    if (sp.tail0 + tid < n) p[sp.tail0 + tid] = opf_from_acc<T>(tv);
}

template <class T, int NP, bool WARP>
__global__ void __launch_bounds__(WARP ? 32 * SM_WARP_ROWS : 1024, WARP ? 4 : 1)
    sm_fwd_regs(T *__restrict__ y, const T *__restrict__ x, softmax_cuda_lines L, int is_log) {
    typedef typename opf_acc<T>::type A;
    const int V = row_io<T>::V;
    __shared__ A scratch[64];
    int64_t line, step;
    int tid, G;
    row_group_first<WARP>(line, step, tid, G);
    const int64_t n = L.n;
    for (; line < L.outer.numel; line += step) {
        const T *xr = x + opf_cuda_offset(L.outer, 1, line);
        T *yr = y + opf_cuda_offset(L.outer, 0, line);
        const row_span sp = row_span_of(xr, (const T *)yr, (const T *)yr, n, true);
        if (!sp.vec || sp.npk > (int64_t)NP * G) { /* operands apart from each other's 16-byte phase */
            sm_fwd_line<T, WARP>(yr, xr, n, 1, 1, sp, is_log, tid, G, scratch);
            continue;
        }
        row_pack r[NP];
        A hv, tv;
        sm_load<T, NP>(r, hv, tv, xr, n, sp, tid, G, (A)-INFINITY);
        A m = opf_max(hv, tv);
#pragma unroll
        for (int k = 0; k < NP; k++)
#pragma unroll
            for (int v = 0; v < V; v++) m = opf_max(m, row_io<T>::get(r[k], v));
        m = sm_group_max<WARP>(m, scratch);
        /* the fill (-inf) adds exp(-inf) = 0 */
        A s = row_exp(hv - m) + row_exp(tv - m);
#pragma unroll
        for (int k = 0; k < NP; k++)
#pragma unroll
            for (int v = 0; v < V; v++) s += row_exp(row_io<T>::get(r[k], v) - m);
        s = sm_group_sum<WARP>(s, scratch);
        if (is_log) {
            const A ls = m + sm_log(s);
#pragma unroll
            for (int k = 0; k < NP; k++)
#pragma unroll
                for (int v = 0; v < V; v++) row_io<T>::set(r[k], v, row_io<T>::get(r[k], v) - ls);
            hv -= ls, tv -= ls;
        } else {
            const A inv = (A)1 / s;
#pragma unroll
            for (int k = 0; k < NP; k++)
#pragma unroll
                for (int v = 0; v < V; v++) row_io<T>::set(r[k], v, row_exp(row_io<T>::get(r[k], v) - m) * inv);
            hv = row_exp(hv - m) * inv, tv = row_exp(tv - m) * inv;
        }
        sm_store<T, NP>(yr, r, hv, tv, n, sp, tid, G);
    }
}

template <class T, int NP, bool WARP>
__global__ void __launch_bounds__(WARP ? 32 * SM_WARP_ROWS : 1024, WARP ? 4 : 1)
    sm_bwd_regs(T *__restrict__ dx, const T *__restrict__ dy, const T *__restrict__ y, softmax_cuda_lines L,
                int is_log) {
    typedef typename opf_acc<T>::type A;
    const int V = row_io<T>::V;
    __shared__ A scratch[32];
    int64_t line, step;
    int tid, G;
    row_group_first<WARP>(line, step, tid, G);
    const int64_t n = L.n;
    for (; line < L.outer.numel; line += step) {
        T *dxr = dx + opf_cuda_offset(L.outer, 0, line);
        const T *dyr = dy + opf_cuda_offset(L.outer, 1, line), *yr = y + opf_cuda_offset(L.outer, 2, line);
        const row_span sp = row_span_of(dyr, yr, (const T *)dxr, n, true);
        if (!sp.vec || sp.npk > (int64_t)NP * G) {
            sm_bwd_line<T, WARP>(dxr, dyr, yr, n, 1, 1, 1, sp, is_log, tid, G, scratch);
            continue;
        }
        row_pack g[NP], o[NP];
        A gh, gt, oh, ot;
        sm_load<T, NP>(g, gh, gt, dyr, n, sp, tid, G, (A)0);
        sm_load<T, NP>(o, oh, ot, yr, n, sp, tid, G, (A)0);
        A s = SM_BWD_TERM(gh, oh) + SM_BWD_TERM(gt, ot);
#pragma unroll
        for (int k = 0; k < NP; k++)
#pragma unroll
            for (int v = 0; v < V; v++) s += SM_BWD_TERM(row_io<T>::get(g[k], v), row_io<T>::get(o[k], v));
        s = sm_group_sum<WARP>(s, scratch);
#pragma unroll
        for (int k = 0; k < NP; k++)
#pragma unroll
            for (int v = 0; v < V; v++)
                row_io<T>::set(g[k], v, SM_BWD_OUT(row_io<T>::get(g[k], v), row_io<T>::get(o[k], v)));
        gh = SM_BWD_OUT(gh, oh), gt = SM_BWD_OUT(gt, ot);
        sm_store<T, NP>(dxr, g, gh, gt, n, sp, tid, G);
    }
}

/* ---- the lane path: 32 adjacent lines per tile, the reduction split over the block's warps ---- */

template <class T>
__global__ void __launch_bounds__(256)
    sm_fwd_lanes(T *__restrict__ y, const T *__restrict__ x, softmax_cuda_lines L, int is_log) {
    typedef typename opf_acc<T>::type A;
    __shared__ A part_m[256], part_s[256];
    const int lx = threadIdx.x & 31, ly = threadIdx.x >> 5, segs = blockDim.x >> 5;
    const int64_t n = L.n, tiles = (L.lanes + 31) / 32, items = L.outer.numel * tiles;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int64_t o = item / tiles, l = (item % tiles) * 32 + lx;
        const bool live = l < L.lanes;
        const T *xr = x + opf_cuda_offset(L.outer, 1, o) + l;
        T *yr = y + opf_cuda_offset(L.outer, 0, o) + l;
        A m = (A)-INFINITY, s = 0;
        if (live)
            for (int64_t k = ly; k < n; k += segs) row_online1(m, s, opf_to_acc(xr[k * L.nstride[1]]));
        part_m[threadIdx.x] = m, part_s[threadIdx.x] = s;
        __syncthreads();
        m = part_m[lx], s = part_s[lx];
        for (int j = 1; j < segs; j++) row_merge(m, s, part_m[j * 32 + lx], part_s[j * 32 + lx]);
        __syncthreads();
        const A ls = m + sm_log(s), inv = (A)1 / s;
        if (live)
            for (int64_t k = ly; k < n; k += segs) {
                const A v = opf_to_acc(xr[k * L.nstride[1]]);
                yr[k * L.nstride[0]] = opf_from_acc<T>(is_log ? v - ls : row_exp(v - m) * inv);
            }
    }
}

template <class T>
__global__ void __launch_bounds__(256) sm_bwd_lanes(T *__restrict__ dx, const T *__restrict__ dy,
                                                    const T *__restrict__ y, softmax_cuda_lines L, int is_log) {
    typedef typename opf_acc<T>::type A;
    __shared__ A part[256];
    const int lx = threadIdx.x & 31, ly = threadIdx.x >> 5, segs = blockDim.x >> 5;
    const int64_t n = L.n, tiles = (L.lanes + 31) / 32, items = L.outer.numel * tiles;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int64_t o = item / tiles, l = (item % tiles) * 32 + lx;
        const bool live = l < L.lanes;
        T *dxr = dx + opf_cuda_offset(L.outer, 0, o) + l;
        const T *dyr = dy + opf_cuda_offset(L.outer, 1, o) + l, *yr = y + opf_cuda_offset(L.outer, 2, o) + l;
        A s = 0;
        if (live)
            for (int64_t k = ly; k < n; k += segs)
                s += SM_BWD_TERM(opf_to_acc(dyr[k * L.nstride[1]]), opf_to_acc(yr[k * L.nstride[2]]));
        part[threadIdx.x] = s;
        __syncthreads();
        s = part[lx];
        for (int j = 1; j < segs; j++) s += part[j * 32 + lx];
        __syncthreads();
        if (live)
            for (int64_t k = ly; k < n; k += segs)
                dxr[k * L.nstride[0]] =
                    opf_from_acc<T>(SM_BWD_OUT(opf_to_acc(dyr[k * L.nstride[1]]), opf_to_acc(yr[k * L.nstride[2]])));
    }
}
#undef SM_BWD_TERM
#undef SM_BWD_OUT

/* ---- launchers ---------------------------------------------------------------- */

enum { SM_WARP1, SM_WARP2, SM_WARP4, SM_BLOCK, SM_LOOP_WARP, SM_LOOP, SM_LANES };
static const char *const SM_FWD_NAMES[] = {"softmax_fwd_warp1", "softmax_fwd_warp2",     "softmax_fwd_warp4",
                                           "softmax_fwd_block", "softmax_fwd_loop_warp", "softmax_fwd_loop",
                                           "softmax_fwd_lanes"};
static const char *const SM_BWD_NAMES[] = {"softmax_bwd_warp1", "softmax_bwd_warp2",     "softmax_bwd_warp4",
                                           "softmax_bwd_block", "softmax_bwd_loop_warp", "softmax_bwd_loop",
                                           "softmax_bwd_lanes"};

/* The path of a plan and its threads per block: rows of stride 1 in registers when they fit (16
 * elements a thread: up to 512 on a warp, 16384 on a block), others (strided, too long, float64) in
 * two passes; the lane path as planned. */
static int sm_path(const softmax_cuda_lines *l, int nops, int V, int regs, unsigned *block) {
    const int64_t n = l->n;
    if (l->lane_path) {
        int segs = 1;
        while (segs < 8 && segs < n) segs *= 2;
        *block = 32u * (unsigned)segs;
        return SM_LANES;
    }
    int unit = regs;
    for (int q = 0; q < nops; q++) unit &= l->nstride[q] == 1;
    *block = 32 * SM_WARP_ROWS;
    if (n <= 32 * 16) {
        if (!unit) return SM_LOOP_WARP;
        return n <= 32 * (int64_t)V ? SM_WARP1 : n <= 64 * (int64_t)V ? SM_WARP2 : SM_WARP4;
    }
    if (unit && n <= 1024 * 16) {
        int64_t t = (n + 15) / 16;
        t = (t + 31) / 32 * 32;
        *block = (unsigned)(t < 128 ? 128 : t);
        return SM_BLOCK;
    }
    *block = SM_LOOP_THREADS;
    return SM_LOOP;
}

static unsigned sm_grid(const softmax_cuda_lines *l, int path) {
    if (path == SM_LANES) return opf_cuda_blocks(l->outer.numel * ((l->lanes + 31) / 32), 1, SM_MAX_BLOCKS);
    if (path <= SM_WARP4 || path == SM_LOOP_WARP) return opf_cuda_blocks(l->outer.numel, SM_WARP_ROWS, SM_MAX_BLOCKS);
    return opf_cuda_blocks(l->outer.numel, 1, SM_MAX_BLOCKS);
}

template <class T>
static void sm_fwd_launch(T *y, const T *x, const softmax_cuda_lines *l, int is_log, cudaStream_t s,
                          softmax_cuda_launch *r) {
    typedef void (*fn)(T *, const T *, softmax_cuda_lines, int);
    const int NP = sm_np<T>::value, NP2 = NP < 2 ? NP : 2;
    fn kernels[] = {sm_fwd_loop<T, true>, sm_fwd_loop<T, true>,  sm_fwd_loop<T, true>, sm_fwd_loop<T, false>,
                    sm_fwd_loop<T, true>, sm_fwd_loop<T, false>, sm_fwd_lanes<T>};
    if constexpr (sizeof(T) < 8) { /* float64 takes no register path (sm_path) */
        kernels[SM_WARP1] = sm_fwd_regs<T, 1, true>;
        kernels[SM_WARP2] = sm_fwd_regs<T, NP2, true>;
        kernels[SM_WARP4] = sm_fwd_regs<T, NP, true>;
        kernels[SM_BLOCK] = sm_fwd_regs<T, NP, false>;
    }
    const int path = sm_path(l, 2, row_io<T>::V, sizeof(T) < 8, &r->block);
    const fn k = kernels[path];
    r->grid = sm_grid(l, path);
    r->kernel = SM_FWD_NAMES[path];
    OPF_LAUNCH(k, r->grid, r->block, 0, s, y, x, *l, is_log);
}

template <class T>
static void sm_bwd_launch(T *dx, const T *dy, const T *y, const softmax_cuda_lines *l, int is_log, cudaStream_t s,
                          softmax_cuda_launch *r) {
    typedef void (*fn)(T *, const T *, const T *, softmax_cuda_lines, int);
    const int NP = sm_np<T>::value, NP2 = NP < 2 ? NP : 2;
    fn kernels[] = {sm_bwd_loop<T, true>, sm_bwd_loop<T, true>,  sm_bwd_loop<T, true>, sm_bwd_loop<T, false>,
                    sm_bwd_loop<T, true>, sm_bwd_loop<T, false>, sm_bwd_lanes<T>};
    if constexpr (sizeof(T) < 8) { /* float64 takes no register path (sm_path) */
        kernels[SM_WARP1] = sm_bwd_regs<T, 1, true>;
        kernels[SM_WARP2] = sm_bwd_regs<T, NP2, true>;
        kernels[SM_WARP4] = sm_bwd_regs<T, NP, true>;
        kernels[SM_BLOCK] = sm_bwd_regs<T, NP, false>;
    }
    const int path = sm_path(l, 3, row_io<T>::V, sizeof(T) < 8, &r->block);
    const fn k = kernels[path];
    r->grid = sm_grid(l, path);
    r->kernel = SM_BWD_NAMES[path];
    OPF_LAUNCH(k, r->grid, r->block, 0, s, dx, dy, y, *l, is_log);
}

static int sm_unit_in_all(const int64_t *const *strides, int nops, int d) {
    for (int q = 0; q < nops; q++)
        if (strides[q][d] != 1) return 0;
    return 1;
}

extern "C" int softmax_cuda_plan(softmax_cuda_lines *l, int ndim, int dim, const int64_t *sizes, int nops,
                                 const int64_t *const *strides) {
    int64_t osize[OPF_MAX_DIMS], ostride[3][OPF_MAX_DIMS];
    const int64_t *ostrides[3] = {ostride[0], ostride[1], ostride[2]};
    memset(l, 0, sizeof *l);
    l->n = sizes[dim];
    for (int q = 0; q < nops; q++) l->nstride[q] = strides[q][dim];
    int lane = -1, nouter = 0;
    if (!(l->n > 1 && sm_unit_in_all(strides, nops, dim)))
        for (int d = ndim - 1; d >= 0; d--)
            if (d != dim && sizes[d] > 1 && sm_unit_in_all(strides, nops, d)) {
                lane = d;
                break;
            }
    l->lane_path = lane >= 0;
    l->lanes = lane >= 0 ? sizes[lane] : 1;
    for (int d = 0; d < ndim; d++) {
        if (d == dim || d == lane || sizes[d] == 1) continue;
        osize[nouter] = sizes[d];
        for (int q = 0; q < nops; q++) ostride[q][nouter] = strides[q][d];
        nouter++;
    }
    return opf_cuda_nd_make(&l->outer, nouter, osize, nops, ostrides);
}

extern "C" softmax_cuda_launch softmax_cuda_fwd(opf_dtype dt, void *y, const void *x, const softmax_cuda_lines *l,
                                                int log, void *stream) {
    softmax_cuda_launch r = {0, 0, "softmax_fwd"};
    if (l->outer.numel == 0 || l->n == 0) return r;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {
    case OPF_F32: sm_fwd_launch((float *)y, (const float *)x, l, log, s, &r); break;
    case OPF_F64: sm_fwd_launch((double *)y, (const double *)x, l, log, s, &r); break;
    case OPF_BF16: sm_fwd_launch((__nv_bfloat16 *)y, (const __nv_bfloat16 *)x, l, log, s, &r); break;
    case OPF_F16: sm_fwd_launch((__half *)y, (const __half *)x, l, log, s, &r); break;
    default: break;
    }
    return r;
}

extern "C" softmax_cuda_launch softmax_cuda_bwd(opf_dtype dt, void *dx, const void *dy, const void *y,
                                                const softmax_cuda_lines *l, int log, void *stream) {
    softmax_cuda_launch r = {0, 0, "softmax_bwd"};
    if (l->outer.numel == 0 || l->n == 0) return r;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {
    case OPF_F32: sm_bwd_launch((float *)dx, (const float *)dy, (const float *)y, l, log, s, &r); break;
    case OPF_F64: sm_bwd_launch((double *)dx, (const double *)dy, (const double *)y, l, log, s, &r); break;
    case OPF_BF16:
        sm_bwd_launch((__nv_bfloat16 *)dx, (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)y, l, log, s, &r);
        break;
    case OPF_F16: sm_bwd_launch((__half *)dx, (const __half *)dy, (const __half *)y, l, log, s, &r); break;
    default: break;
    }
    return r;
}
