/*
 * rms_norm (with or without a residual), layer_norm and their backward on the
 * GPU. Formulas and numerics as the CPU kernels' (csrc/kernels/norm.h):
 * float32, bfloat16 and float16 compute in float32, float64 in double, and
 * the float64 backward recomputes mean / rstd from x.
 *
 * The fast kernels (_vec) take rows that are contiguous, 16-byte aligned and
 * a whole number of 16-byte packs (4 floats, 8 halves, 2 doubles) long, with
 * the leading dims merging into one: a group of `tpr` threads (one warp for
 * short rows, up to 1024 threads) owns a row; thread t of the group holds
 * packs t, t + tpr, ... (NP of them) in registers, so the forward reads x
 * once and writes y once, and the backward reads x and grad once and writes
 * dx once (the backward at 4 packs per thread, a block per row, reads the
 * weights from shared memory: registers would spill). Several groups share
 * a block when a row needs fewer threads than the block has. Every other
 * layout (strided, transposed, misaligned, odd sizes, leading dims that do
 * not merge) and rows too long for registers (more than 1024 threads x 4
 * packs; 512 x 4 in the backward) take the generic kernels (_any): element
 * by element, one pass over the row in global memory per sum.
 *
 * Weight and bias gradients are deterministic: when they are wanted the
 * backward runs at most NORM_CUDA_BWD_SLOTS blocks, each over a fixed chunk
 * of rows (at least 2 per group); a thread sums its columns over its group's
 * rows (in registers, or in its group's slot for the generic kernel), the
 * fast kernel adds its block's groups in group order, each writes slots of H
 * partial sums (float; double for float64) to the workspace, and a second
 * kernel adds the slots column by column in a fixed order.
 */
#include "norm.h"
#include "opforge/cuda_kernel.cuh"

/* packs of a row the fast kernels hold, at most (4 per thread); beyond: the generic kernels */
#define NRM_FWD_MAX_PACKS (4 * NORM_CUDA_MAX_THREADS)
#define NRM_BWD_MAX_PACKS (4 * NORM_CUDA_BWD_THREADS)
/* blocks of a forward launch at most (a block loops over the rest of its rows) */
#define NRM_MAX_GRID (1 << 30)
/* the column sums of the slots: 32 columns x 8 slot strides per block */
#define NRM_REDUCE_THREADS 256

/* A 16-byte pack of a row: 4 floats, 2 doubles, or 8 16-bit values held as four 32-bit words of two
 * each (the first in the low half): held as eight values of their own they would take eight
 * registers, not four (and the backward at 4 packs per thread spilled). Its elements are read with
 * nrm_get, and a pack is made from values with nrm_put. */
template <class T> struct alignas(16) nrm_pack { T v[16 / sizeof(T)]; };
template <> struct alignas(16) nrm_pack<__nv_bfloat16> { unsigned u[4]; };
template <> struct alignas(16) nrm_pack<__half> { unsigned u[4]; };

/* A word's two 16-bit values as floats, and two floats rounded (to nearest even) into a word. */
#ifdef OPF_CUDA_EMULATE
__device__ __forceinline__ float2 nrm_unpack2(unsigned w, __nv_bfloat16 *) {
    return make_float2(opf_bf16_to_f32((uint16_t)w), opf_bf16_to_f32((uint16_t)(w >> 16)));
}
__device__ __forceinline__ float2 nrm_unpack2(unsigned w, __half *) {
    return make_float2(opf_f16_to_f32((uint16_t)w), opf_f16_to_f32((uint16_t)(w >> 16)));
}
__device__ __forceinline__ unsigned nrm_pack2(float lo, float hi, __nv_bfloat16 *) {
    return opf_f32_to_bf16(lo) | (unsigned)opf_f32_to_bf16(hi) << 16;
}
__device__ __forceinline__ unsigned nrm_pack2(float lo, float hi, __half *) {
    return opf_f32_to_f16(lo) | (unsigned)opf_f32_to_f16(hi) << 16;
}
#else
__device__ __forceinline__ float2 nrm_unpack2(unsigned w, __nv_bfloat16 *) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 nrm_unpack2(unsigned w, __half *) { return __half22float2(*(const __half2 *)&w); }
__device__ __forceinline__ unsigned nrm_pack2(float lo, float hi, __nv_bfloat16 *) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(const unsigned *)&h;
}
__device__ __forceinline__ unsigned nrm_pack2(float lo, float hi, __half *) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const unsigned *)&h;
}
#endif

/* Element k of a pack in the compute type; the pack of e[0 .. V), each rounded to T. */
template <class T> __device__ __forceinline__ typename opf_acc<T>::type nrm_get(const nrm_pack<T> &p, int k) {
    return opf_to_acc(p.v[k]);
}
template <class T>
__device__ __forceinline__ nrm_pack<T> nrm_put(const typename opf_acc<T>::type (&e)[16 / sizeof(T)]) {
    nrm_pack<T> o;
#pragma unroll
    for (int k = 0; k < 16 / (int)sizeof(T); k++) o.v[k] = opf_from_acc<T>(e[k]);
    return o;
}
template <class T> __device__ __forceinline__ float nrm_get16(const nrm_pack<T> &p, int k) {
    const float2 f = nrm_unpack2(p.u[k >> 1], (T *)0);
    return k & 1 ? f.y : f.x;
}
template <class T> __device__ __forceinline__ nrm_pack<T> nrm_put16(const float (&e)[8]) {
    nrm_pack<T> o;
#pragma unroll
    for (int i = 0; i < 4; i++) o.u[i] = nrm_pack2(e[2 * i], e[2 * i + 1], (T *)0);
    return o;
}
template <> __device__ __forceinline__ float nrm_get(const nrm_pack<__nv_bfloat16> &p, int k) {
    return nrm_get16(p, k);
}
template <> __device__ __forceinline__ float nrm_get(const nrm_pack<__half> &p, int k) { return nrm_get16(p, k); }
template <> __device__ __forceinline__ nrm_pack<__nv_bfloat16> nrm_put<__nv_bfloat16>(const float (&e)[8]) {
    return nrm_put16<__nv_bfloat16>(e);
}
template <> __device__ __forceinline__ nrm_pack<__half> nrm_put<__half>(const float (&e)[8]) {
    return nrm_put16<__half>(e);
}

/* Row r of row input k: the fast kernels' lead is one dim. */
template <class T> __device__ __forceinline__ const T *nrm_row1(const norm_cuda_args &a, int k, int64_t r) {
    return (const T *)a.in[k] + r * a.lead.stride[k + 1][0];
}
template <class T> __device__ __forceinline__ const T *nrm_row(const norm_cuda_args &a, int k, int64_t r) {
    const int64_t off = a.lead.ndim == 1 ? r * a.lead.stride[k + 1][0] : opf_cuda_offset(a.lead, k + 1, r);
    return (const T *)a.in[k] + off;
}

template <class T> __device__ __forceinline__ nrm_pack<T> nrm_ld(const T *row, int p) {
    return ((const nrm_pack<T> *)row)[p];
}
template <class T> __device__ __forceinline__ void nrm_st(T *row, int p, const nrm_pack<T> &v) {
    ((nrm_pack<T> *)row)[p] = v;
}

/* The sum over the calling thread's group of tpr threads (tpr a multiple of 32 dividing blockDim.x),
 * returned to every thread of the group. With tpr > 32 every thread of the block calls it (it waits
 * at the block's barrier); scratch: 32 values of shared memory. */
template <class A> __device__ __forceinline__ A nrm_grp_sum(A v, A *scratch, int tpr) {
    v = opf_warp_sum(v);
    if (tpr == 32) return v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, first = (int)(threadIdx.x / tpr) * (tpr >> 5);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A s = lane < (tpr >> 5) ? scratch[first + lane] : (A)0;
    s = opf_warp_sum(s);
    __syncthreads();
    return s;
}

/* Two sums at once (one pair of barriers); scratch: 64 values. */
template <class A> __device__ __forceinline__ void nrm_grp_sum2(A &u, A &v, A *scratch, int tpr) {
    u = opf_warp_sum(u);
    v = opf_warp_sum(v);
    if (tpr == 32) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, first = (int)(threadIdx.x / tpr) * (tpr >> 5);
    if (lane == 0) scratch[warp] = u, scratch[32 + warp] = v;
    __syncthreads();
    u = lane < (tpr >> 5) ? scratch[first + lane] : (A)0;
    v = lane < (tpr >> 5) ? scratch[32 + first + lane] : (A)0;
    u = opf_warp_sum(u);
    v = opf_warp_sum(v);
    __syncthreads();
}

/* w' of one element: w, or 1 + w (offset) */
template <class A> __device__ __forceinline__ A nrm_w(A w, int offset) { return offset ? (A)1 + w : w; }

/* ---- forward ----------------------------------------------------------------------- */

/* The fast forward: every row input contiguous, 16-byte aligned, H a multiple of the pack. Rows
 * [blockIdx.x * chunk, + chunk), a group of tpr threads per row, NP packs of the row per thread in
 * registers. LAYER: layer_norm; else rms_norm, add_rms_norm when in[1] is given. */
template <class T, int NP, bool LAYER>
__global__ void __launch_bounds__(NORM_CUDA_MAX_THREADS) nrm_fwd_vec(norm_cuda_args a, int tpr, int64_t chunk) {
    typedef typename opf_acc<T>::type A;
    const int V = 16 / sizeof(T);
    __shared__ A scratch[32];
    const int rpb = blockDim.x / tpr, grp = threadIdx.x / tpr, t = threadIdx.x % tpr;
    const int64_t n = a.hidden;
    const int P = (int)(n / V);
    const int64_t r0 = (int64_t)blockIdx.x * chunk, r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    const T *w = (const T *)a.w, *b = LAYER ? (const T *)a.b : NULL;
    const bool add = !LAYER && a.in[1] != NULL;
    const int offset = LAYER ? 0 : a.offset;
    for (int64_t base = r0; base < r1; base += rpb) { /* the same trip count for the whole block */
        const int64_t r = base + grp;
        const bool active = r < r1;
        nrm_pack<T> v[NP];
        A s1 = 0;
        if (active) {
            const T *x = nrm_row1<T>(a, 0, r);
#pragma unroll
            for (int j = 0; j < NP; j++) {
                const int p = j * tpr + t;
                if (p < P) v[j] = nrm_ld(x, p);
            }
            if (add) { /* s = x + residual, rounded to the dtype: what the rest reads */
                const T *res = nrm_row1<T>(a, 1, r);
                T *s = (T *)a.out2 + r * n;
#pragma unroll
                for (int j = 0; j < NP; j++) {
                    const int p = j * tpr + t;
                    if (p >= P) continue;
                    const nrm_pack<T> q = nrm_ld(res, p);
                    A e[V];
#pragma unroll
                    for (int k = 0; k < V; k++) e[k] = nrm_get(v[j], k) + nrm_get(q, k);
                    v[j] = nrm_put<T>(e);
                    nrm_st(s, p, v[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < NP; j++) {
                if (j * tpr + t >= P) continue;
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const A e = nrm_get(v[j], k);
                    s1 += LAYER ? e : e * e;
                }
            }
        }
        s1 = nrm_grp_sum(s1, scratch, tpr);
        A mu = 0;
        if (LAYER) { /* the variance around the mean, from the registers */
            mu = s1 / (A)n;
            A s2 = 0;
            if (active)
#pragma unroll
                for (int j = 0; j < NP; j++) {
                    if (j * tpr + t >= P) continue;
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        const A d = nrm_get(v[j], k) - mu;
                        s2 += d * d;
                    }
                }
            s1 = nrm_grp_sum(s2, scratch, tpr);
        }
        if (!active) continue;
        const A rs = (A)1 / sqrt(s1 / (A)n + (A)a.eps);
        if (t == 0) {
            a.rstd[r] = (float)rs;
            if (LAYER) a.mean[r] = (float)mu;
        }
        T *y = (T *)a.out + r * n;
#pragma unroll
        for (int j = 0; j < NP; j++) {
            const int p = j * tpr + t;
            if (p >= P) continue;
            nrm_pack<T> wp, bp;
            if (w) wp = nrm_ld(w, p);
            if (b) bp = nrm_ld(b, p);
            A e[V];
#pragma unroll
            for (int k = 0; k < V; k++) {
                e[k] = (nrm_get(v[j], k) - mu) * rs;
                if (w) e[k] *= nrm_w(nrm_get(wp, k), offset);
                if (b) e[k] += nrm_get(bp, k);
            }
            nrm_st(y, p, nrm_put<T>(e));
        }
    }
}

/* The generic forward: any strides, any H; element by element, a pass over the row (in global
 * memory) per sum. add_rms_norm writes the sum in the first pass and reads it back in the last (each
 * thread its own elements). */
template <class T, bool LAYER>
__global__ void __launch_bounds__(NORM_CUDA_MAX_THREADS) nrm_fwd_any(norm_cuda_args a, int tpr, int64_t chunk) {
    typedef typename opf_acc<T>::type A;
    __shared__ A scratch[32];
    const int rpb = blockDim.x / tpr, grp = threadIdx.x / tpr, t = threadIdx.x % tpr;
    const int64_t n = a.hidden;
    const int64_t r0 = (int64_t)blockIdx.x * chunk, r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    const T *w = (const T *)a.w, *b = LAYER ? (const T *)a.b : NULL;
    const bool add = !LAYER && a.in[1] != NULL;
    const int offset = LAYER ? 0 : a.offset;
    const int64_t xcs = a.in_cs[0], rcs = a.in_cs[1], wcs = a.wcs, bcs = a.bcs;
    for (int64_t base = r0; base < r1; base += rpb) { /* the same trip count for the whole block */
        const int64_t r = base + grp;
        const bool active = r < r1;
        const T *x = active ? nrm_row<T>(a, 0, r) : NULL, *res = active && add ? nrm_row<T>(a, 1, r) : NULL;
        T *s = add ? (T *)a.out2 + r * n : NULL, *y = (T *)a.out + r * n;
        A s1 = 0;
        if (active)
            for (int64_t e = t; e < n; e += tpr) {
                A v = opf_to_acc(x[e * xcs]);
                if (add) {
                    s[e] = opf_from_acc<T>(v + opf_to_acc(res[e * rcs]));
                    v = opf_to_acc(s[e]);
                }
                s1 += LAYER ? v : v * v;
            }
        s1 = nrm_grp_sum(s1, scratch, tpr);
        A mu = 0;
        if (LAYER) {
            mu = s1 / (A)n;
            A s2 = 0;
            if (active)
                for (int64_t e = t; e < n; e += tpr) {
                    const A d = opf_to_acc(x[e * xcs]) - mu;
                    s2 += d * d;
                }
            s1 = nrm_grp_sum(s2, scratch, tpr);
        }
        if (!active) continue;
        const A rs = (A)1 / sqrt(s1 / (A)n + (A)a.eps);
        if (t == 0) {
            a.rstd[r] = (float)rs;
            if (LAYER) a.mean[r] = (float)mu;
        }
        for (int64_t e = t; e < n; e += tpr) {
            A o = ((add ? opf_to_acc(s[e]) : opf_to_acc(x[e * xcs])) - mu) * rs;
            if (w) o *= nrm_w(opf_to_acc(w[e * wcs]), offset);
            if (b) o += opf_to_acc(b[e * bcs]);
            y[e] = opf_from_acc<T>(o);
        }
    }
}

/* ---- backward ---------------------------------------------------------------------- */

/* One row's packs of grad, x and grad_sum held by a thread, and its saved statistics. */
template <class T, int NP> struct nrm_bwd_row {
    nrm_pack<T> g[NP], x[NP], gs[NP];
    float mean, rstd;
};

template <class T, int NP, bool LAYER>
__device__ __forceinline__ void nrm_bwd_load(const norm_cuda_args &a, int64_t r, int tpr, int t, int P, bool has_gs,
                                             nrm_bwd_row<T, NP> &row) {
    const T *g = nrm_row1<T>(a, 0, r), *x = nrm_row1<T>(a, 1, r);
#pragma unroll
    for (int j = 0; j < NP; j++) {
        const int p = j * tpr + t;
        if (p >= P) continue;
        row.g[j] = nrm_ld(g, p);
        row.x[j] = nrm_ld(x, p);
    }
    if (has_gs) {
        const T *gs = nrm_row1<T>(a, 2, r);
#pragma unroll
        for (int j = 0; j < NP; j++) {
            const int p = j * tpr + t;
            if (p < P) row.gs[j] = nrm_ld(gs, p);
        }
    }
    if (sizeof(T) != 8) { /* float64 recomputes them */
        row.rstd = a.rstd[r];
        if (LAYER) row.mean = a.mean[r];
    }
}

/* The block's slot of partial sums: its groups' column sums added in group order (buf: V values per
 * thread of shared memory, unused with one group per block). Every thread of the block calls it. */
template <class A, int NP, int V>
__device__ __forceinline__ void nrm_write_partial(A *dst, const A (&acc)[NP][V], A *buf, int tpr, int P) {
    const int rpb = blockDim.x / tpr, grp = threadIdx.x / tpr, t = threadIdx.x % tpr;
#pragma unroll
    for (int j = 0; j < NP; j++) {
        const int p = j * tpr + t;
        if (rpb == 1) {
            if (p < P)
#pragma unroll
                for (int k = 0; k < V; k++) dst[(int64_t)p * V + k] = acc[j][k];
            continue;
        }
#pragma unroll
        for (int k = 0; k < V; k++) buf[threadIdx.x * V + k] = acc[j][k];
        __syncthreads();
        if (grp == 0 && p < P)
#pragma unroll
            for (int k = 0; k < V; k++) {
                A s = 0;
                for (int q = 0; q < rpb; q++) s += buf[(q * tpr + t) * V + k];
                dst[(int64_t)p * V + k] = s;
            }
        __syncthreads();
    }
}

/* The fast backward (layouts as the fast forward's): rows [blockIdx.x * chunk, + chunk), a group of
 * tpr threads per row, NP packs per thread in registers; with NP <= 2 the group's next row is
 * loaded while the current one is reduced. LAYER: layer_norm's backward; else rms_norm's,
 * add_rms_norm's when in[2] (grad_sum) is given (out2: dresidual = dx).
 *
 * At NP = 4 the block is one group of NORM_CUDA_BWD_THREADS threads (nrm_config), which have 128
 * registers each: a thread's packs of grad and x and its weight and bias partial sums take 96 of them
 * at 16 bits (layer_norm), too many to hold its weights' packs as well (16 more: that spilled), so
 * the block reads the weights from shared memory there; and with one group per block the partial
 * sums need no buffer. */
template <class T, int NP, bool LAYER>
__global__ void __launch_bounds__(NORM_CUDA_BWD_THREADS) nrm_bwd_vec(norm_cuda_args a, int group, int64_t chunk) {
    typedef typename opf_acc<T>::type A;
    const int V = 16 / sizeof(T);
    const bool F64 = sizeof(T) == 8, PREFETCH = NP <= 2, WSHARED = NP == 4;
    /* the group's threads: at NP = 4 known here, so that the packs' offsets in a row are constants
     * (fewer registers for addresses) */
    const int tpr = NP == 4 ? NORM_CUDA_BWD_THREADS : group;
    __shared__ A scratch[64];
    __shared__ A buf[WSHARED ? 1 : NORM_CUDA_BWD_THREADS * (16 / sizeof(T))];
    __shared__ nrm_pack<T> wsh[WSHARED ? NRM_BWD_MAX_PACKS : 1];
    const int rpb = blockDim.x / tpr, grp = threadIdx.x / tpr, t = threadIdx.x % tpr;
    const int64_t n = a.hidden;
    const int P = (int)(n / V);
    const int64_t r0 = (int64_t)blockIdx.x * chunk, r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    const T *w = (const T *)a.w;
    const bool want_dw = a.dw != NULL, want_db = LAYER && a.db != NULL, has_gs = !LAYER && a.in[2] != NULL;
    const int offset = LAYER ? 0 : a.offset;
    /* this thread's columns are the same in every row: their weights (ones without a weight, w' = 1
     * then), kept as stored (in wsh at NP = 4), and their partial sums */
    const int woff = w ? offset : 0;
    nrm_pack<T> wp[NP];
    A dwa[NP][V], dba[NP][V];
#pragma unroll
    for (int j = 0; j < NP; j++) {
        const int p = j * tpr + t;
        A one[V];
#pragma unroll
        for (int k = 0; k < V; k++) dwa[j][k] = dba[j][k] = 0, one[k] = 1;
        const nrm_pack<T> wj = w && p < P ? nrm_ld(w, p) : nrm_put<T>(one);
        if (!WSHARED)
            wp[j] = wj;
        else if (p < P)
            wsh[p] = wj;
    }
    if (WSHARED) __syncthreads();
    nrm_bwd_row<T, NP> cur, nxt;
    cur.mean = cur.rstd = 0.0f;
    if (PREFETCH && r0 + grp < r1) nrm_bwd_load<T, NP, LAYER>(a, r0 + grp, tpr, t, P, has_gs, cur);
    for (int64_t base = r0; base < r1; base += rpb) { /* the same trip count for the whole block */
        const int64_t r = base + grp;
        const bool active = r < r1;
        if (PREFETCH) {
            if (r + rpb < r1) nrm_bwd_load<T, NP, LAYER>(a, r + rpb, tpr, t, P, has_gs, nxt);
        } else if (active) {
            nrm_bwd_load<T, NP, LAYER>(a, r, tpr, t, P, has_gs, cur);
        }
        A mu = 0, rs;
        if (F64) { /* mean and rstd again, in double, from x */
            A s1 = 0;
            if (active)
#pragma unroll
                for (int j = 0; j < NP; j++) {
                    if (j * tpr + t >= P) continue;
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        const A e = nrm_get(cur.x[j], k);
                        s1 += LAYER ? e : e * e;
                    }
                }
            s1 = nrm_grp_sum(s1, scratch, tpr);
            if (LAYER) {
                mu = s1 / (A)n;
                A s2 = 0;
                if (active)
#pragma unroll
                    for (int j = 0; j < NP; j++) {
                        if (j * tpr + t >= P) continue;
#pragma unroll
                        for (int k = 0; k < V; k++) {
                            const A d = nrm_get(cur.x[j], k) - mu;
                            s2 += d * d;
                        }
                    }
                s1 = nrm_grp_sum(s2, scratch, tpr);
            }
            rs = (A)1 / sqrt(s1 / (A)n + (A)a.eps);
        } else {
            rs = (A)cur.rstd;
            if (LAYER) mu = (A)cur.mean;
        }
        /* sums over the row of g w' and of g w' xh */
        A sa = 0, sb = 0;
        if (active)
#pragma unroll
            for (int j = 0; j < NP; j++) {
                const int p = j * tpr + t;
                if (p >= P) continue;
                const nrm_pack<T> &wj = WSHARED ? wsh[p] : wp[j];
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const A gw = nrm_get(cur.g[j], k) * nrm_w(nrm_get(wj, k), woff);
                    const A xh = (nrm_get(cur.x[j], k) - mu) * rs;
                    sa += gw;
                    sb += gw * xh;
                }
            }
        if (LAYER)
            nrm_grp_sum2(sa, sb, scratch, tpr);
        else
            sb = nrm_grp_sum(sb, scratch, tpr);
        if (active) {
            const A ca = sa / (A)n, cb = sb / (A)n;
            T *dx = (T *)a.out + r * n, *dr = has_gs && a.out2 ? (T *)a.out2 + r * n : NULL;
#pragma unroll
            for (int j = 0; j < NP; j++) {
                const int p = j * tpr + t;
                if (p >= P) continue;
                const nrm_pack<T> &wj = WSHARED ? wsh[p] : wp[j];
                A d[V];
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const A gi = nrm_get(cur.g[j], k), xh = (nrm_get(cur.x[j], k) - mu) * rs;
                    const A gw = gi * nrm_w(nrm_get(wj, k), woff);
                    d[k] = LAYER ? rs * (gw - ca - xh * cb) : rs * (gw - xh * cb);
                    if (has_gs) d[k] += nrm_get(cur.gs[j], k);
                    dwa[j][k] += gi * xh;
                    dba[j][k] += gi;
                }
                const nrm_pack<T> o = nrm_put<T>(d);
                nrm_st(dx, p, o);
                if (dr) nrm_st(dr, p, o);
            }
        }
        if (PREFETCH) cur = nxt;
    }
    A *slots = (A *)a.ws;
    if (want_dw) nrm_write_partial<A, NP, V>(slots + (int64_t)blockIdx.x * n, dwa, buf, tpr, P);
    if (want_db)
        nrm_write_partial<A, NP, V>(slots + ((want_dw ? (int64_t)gridDim.x : 0) + blockIdx.x) * n, dba, buf, tpr, P);
}

/* The generic backward: any strides, any H; element by element, a pass over the row (in global
 * memory) per sum. Each group has a slot of partial sums of its own, summed in place (each thread
 * its own columns, the group's rows in order); a group without rows writes zeros there. */
template <class T, bool LAYER>
__global__ void __launch_bounds__(NORM_CUDA_MAX_THREADS) nrm_bwd_any(norm_cuda_args a, int tpr, int64_t chunk) {
    typedef typename opf_acc<T>::type A;
    const bool F64 = sizeof(T) == 8;
    __shared__ A scratch[64];
    const int rpb = blockDim.x / tpr, grp = threadIdx.x / tpr, t = threadIdx.x % tpr;
    const int64_t n = a.hidden;
    const int64_t r0 = (int64_t)blockIdx.x * chunk, r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    const T *w = (const T *)a.w;
    const bool has_gs = !LAYER && a.in[2] != NULL;
    const int offset = LAYER ? 0 : a.offset;
    const int64_t gcs = a.in_cs[0], xcs = a.in_cs[1], gscs = a.in_cs[2], wcs = a.wcs;
    const int64_t slot = (int64_t)blockIdx.x * rpb + grp, nslots = (int64_t)gridDim.x * rpb;
    A *slots = (A *)a.ws;
    A *dws = a.dw ? slots + slot * n : NULL;
    A *dbs = LAYER && a.db ? slots + ((a.dw ? nslots : 0) + slot) * n : NULL;
    bool first = true;
    for (int64_t base = r0; base < r1; base += rpb) { /* the same trip count for the whole block */
        const int64_t r = base + grp;
        const bool active = r < r1;
        const T *g = active ? nrm_row<T>(a, 0, r) : NULL, *x = active ? nrm_row<T>(a, 1, r) : NULL;
        const T *gs = active && has_gs ? nrm_row<T>(a, 2, r) : NULL;
        A mu = 0, rs;
        if (F64) {
            A s1 = 0;
            if (active)
                for (int64_t e = t; e < n; e += tpr) {
                    const A v = opf_to_acc(x[e * xcs]);
                    s1 += LAYER ? v : v * v;
                }
            s1 = nrm_grp_sum(s1, scratch, tpr);
            if (LAYER) {
                mu = s1 / (A)n;
                A s2 = 0;
                if (active)
                    for (int64_t e = t; e < n; e += tpr) {
                        const A d = opf_to_acc(x[e * xcs]) - mu;
                        s2 += d * d;
                    }
                s1 = nrm_grp_sum(s2, scratch, tpr);
            }
            rs = (A)1 / sqrt(s1 / (A)n + (A)a.eps);
        } else {
            rs = active ? (A)a.rstd[r] : (A)0;
            if (LAYER && active) mu = (A)a.mean[r];
        }
        A sa = 0, sb = 0;
        if (active)
            for (int64_t e = t; e < n; e += tpr) {
                const A gw = opf_to_acc(g[e * gcs]) * (w ? nrm_w(opf_to_acc(w[e * wcs]), offset) : (A)1);
                const A xh = (opf_to_acc(x[e * xcs]) - mu) * rs;
                sa += gw;
                sb += gw * xh;
            }
        if (LAYER)
            nrm_grp_sum2(sa, sb, scratch, tpr);
        else
            sb = nrm_grp_sum(sb, scratch, tpr);
        if (!active) continue;
        const A ca = sa / (A)n, cb = sb / (A)n;
        T *dx = (T *)a.out + r * n, *dr = has_gs && a.out2 ? (T *)a.out2 + r * n : NULL;
        for (int64_t e = t; e < n; e += tpr) {
            const A gi = opf_to_acc(g[e * gcs]), xh = (opf_to_acc(x[e * xcs]) - mu) * rs;
            const A gw = gi * (w ? nrm_w(opf_to_acc(w[e * wcs]), offset) : (A)1);
            A d = LAYER ? rs * (gw - ca - xh * cb) : rs * (gw - xh * cb);
            if (has_gs) d += opf_to_acc(gs[e * gscs]);
            dx[e] = opf_from_acc<T>(d);
            if (dr) dr[e] = opf_from_acc<T>(d);
            if (dws) dws[e] = (first ? (A)0 : dws[e]) + gi * xh;
            if (dbs) dbs[e] = (first ? (A)0 : dbs[e]) + gi;
        }
        first = false;
    }
    if (first)
        for (int64_t e = t; e < n; e += tpr) {
            if (dws) dws[e] = 0;
            if (dbs) dbs[e] = 0;
        }
}

/* dw[c] (blockIdx.y 0, when wanted) and db[c]: the sum of column c over the slots, in a fixed order
 * (each of 8 warps sums every 8th slot, then the 8 sums in warp order), rounded once. */
template <class T>
__global__ void __launch_bounds__(NRM_REDUCE_THREADS)
    nrm_reduce(T *dw, T *db, const typename opf_acc<T>::type *slots, int64_t nslots, int64_t n) {
    typedef typename opf_acc<T>::type A;
    __shared__ A part[NRM_REDUCE_THREADS];
    const int lane = threadIdx.x & 31, q = threadIdx.x >> 5, nq = NRM_REDUCE_THREADS / 32;
    const int64_t c = (int64_t)blockIdx.x * 32 + lane;
    T *out = blockIdx.y == 0 && dw ? dw : db;
    const A *src = slots + (int64_t)blockIdx.y * nslots * n;
    A s = 0;
    if (c < n)
        for (int64_t k = q; k < nslots; k += nq) s += src[k * n + c];
    part[threadIdx.x] = s;
    __syncthreads();
    if (q == 0 && c < n) {
        A u = 0;
        for (int i = 0; i < nq; i++) u += part[i * 32 + lane];
        out[c] = opf_from_acc<T>(u);
    }
}

/* ---- launch ------------------------------------------------------------------------ */

/* The fast kernels' layout: H a multiple of the pack, the leading dims one (merged) dim of a stride
 * that keeps rows 16-byte aligned, every row input and vector contiguous and 16-byte aligned. */
static int nrm_fast_layout(const norm_cuda_args *a, int nin) {
    const int64_t V = 16 / (int64_t)opf_dtype_size(a->dt);
    if (a->hidden % V != 0 || a->lead.ndim != 1) return 0;
    for (int k = 0; k < nin; k++) {
        if (!a->in[k]) continue;
        if (a->in_cs[k] != 1 || (uintptr_t)a->in[k] % 16 != 0) return 0;
        if (a->rows > 1 && a->lead.stride[k + 1][0] % V != 0) return 0;
    }
    if (a->w && (a->wcs != 1 || (uintptr_t)a->w % 16 != 0)) return 0;
    if (a->b && (a->bcs != 1 || (uintptr_t)a->b % 16 != 0)) return 0;
    if ((uintptr_t)a->out % 16 != 0 || (uintptr_t)a->out2 % 16 != 0) return 0;
    return 1;
}

/* How a call runs: np packs per thread in registers (0: the generic kernels), tpr threads per row,
 * block threads, chunk rows per block, grid blocks, nslots slots of partial sums (per gradient).
 * The backward with weight / bias gradients runs at most NORM_CUDA_BWD_SLOTS blocks. */
typedef struct nrm_cfg {
    int np, tpr, block;
    int64_t chunk, nslots;
    unsigned grid;
} nrm_cfg;

static int nrm_pow2_at_least(int64_t v) {
    int p = 32;
    while (p < v && p < NORM_CUDA_MAX_THREADS) p *= 2;
    return p;
}

static nrm_cfg nrm_config(const norm_cuda_args *a, int bwd) {
    const int64_t V = 16 / (int64_t)opf_dtype_size(a->dt), P = a->hidden / V;
    const int partials = bwd && (a->dw != NULL || a->db != NULL);
    nrm_cfg c;
    if (!nrm_fast_layout(a, bwd ? 3 : 2) || P > (bwd ? NRM_BWD_MAX_PACKS : NRM_FWD_MAX_PACKS))
        c.np = 0, c.tpr = nrm_pow2_at_least((a->hidden + 3) / 4); /* about 4 elements per thread and pass */
    else if (P <= 32)
        c.np = 1, c.tpr = 32;
    else if (bwd ? P <= 1024 : P <= 64) /* the backward holds 2 rows (the next one loaded early) */
        c.np = 2, c.tpr = nrm_pow2_at_least((P + 1) / 2);
    else /* more bytes in flight per thread, fewer threads per row; in the backward (1024 < P <= 2048)
            always NORM_CUDA_BWD_THREADS, what nrm_bwd_vec<T, 4, *> takes for granted */
        c.np = 4, c.tpr = nrm_pow2_at_least((P + 3) / 4);
    const int base = c.np == 0 ? NORM_CUDA_FWD_THREADS : bwd ? NORM_CUDA_BWD_THREADS : NORM_CUDA_FWD_THREADS;
    c.block = c.tpr > base ? c.tpr : base;
    const int64_t rpb = c.block / c.tpr, groups = (a->rows + rpb - 1) / rpb;
    /* with partial sums: at least 2 rows per group (what the next-row loads overlap), at most
     * NORM_CUDA_BWD_SLOTS blocks */
    const int64_t want = partials ? (groups + 1) / 2 : groups, cap = partials ? NORM_CUDA_BWD_SLOTS : NRM_MAX_GRID;
    const int64_t grid = want < cap ? want : cap;
    c.chunk = grid > 0 ? rpb * ((groups + grid - 1) / grid) : rpb;
    c.grid = (unsigned)((a->rows + c.chunk - 1) / c.chunk);
    c.nslots = partials ? (int64_t)c.grid * (c.np ? 1 : rpb) : 0;
    return c;
}

extern "C" int64_t norm_cuda_bwd_workspace(const norm_cuda_args *a) {
    const int nvec = (a->dw != NULL) + (a->db != NULL);
    if (nvec == 0 || a->rows == 0 || a->hidden == 0) return 0;
    return nvec * nrm_config(a, 1).nslots * a->hidden * (a->dt == OPF_F64 ? 2 : 1);
}

typedef void (*nrm_kernel)(norm_cuda_args, int, int64_t);

template <class T, bool LAYER> static norm_cuda_launch nrm_fwd_launch(const norm_cuda_args *a, cudaStream_t s) {
    const nrm_cfg c = nrm_config(a, 0);
    nrm_kernel k = c.np == 0   ? nrm_fwd_any<T, LAYER>
                   : c.np == 1 ? nrm_fwd_vec<T, 1, LAYER>
                   : c.np == 2 ? nrm_fwd_vec<T, 2, LAYER>
                               : nrm_fwd_vec<T, 4, LAYER>;
    OPF_LAUNCH(k, c.grid, c.block, 0, s, *a, c.tpr, c.chunk);
    norm_cuda_launch l = {c.grid, c.block, NULL};
    l.kernel =
        LAYER ? (c.np ? "layer_norm_fwd_vec" : "layer_norm_fwd_any") : (c.np ? "rms_norm_fwd_vec" : "rms_norm_fwd_any");
    return l;
}

template <class T, bool LAYER> static norm_cuda_launch nrm_bwd_launch(const norm_cuda_args *a, cudaStream_t s) {
    const nrm_cfg c = nrm_config(a, 1);
    norm_cuda_launch l = {c.grid, c.block, NULL};
    if (a->rows > 0) {
        nrm_kernel k = c.np == 0   ? nrm_bwd_any<T, LAYER>
                       : c.np == 1 ? nrm_bwd_vec<T, 1, LAYER>
                       : c.np == 2 ? nrm_bwd_vec<T, 2, LAYER>
                                   : nrm_bwd_vec<T, 4, LAYER>;
        OPF_LAUNCH(k, c.grid, c.block, 0, s, *a, c.tpr, c.chunk);
        l.kernel = LAYER ? (c.np ? "layer_norm_bwd_vec" : "layer_norm_bwd_any")
                         : (c.np ? "rms_norm_bwd_vec" : "rms_norm_bwd_any");
    }
    const unsigned nvec = (a->dw != NULL) + (LAYER && a->db != NULL);
    if (nvec > 0) { /* also with no rows: the gradients are then zeros */
        typedef typename opf_acc<T>::type A;
        const dim3 grid((unsigned)((a->hidden + 31) / 32), nvec);
        OPF_LAUNCH(nrm_reduce<T>, grid, NRM_REDUCE_THREADS, 0, s, (T *)a->dw, LAYER ? (T *)a->db : (T *)NULL,
                   (const A *)a->ws, c.nslots, a->hidden);
        if (a->rows == 0) l = {grid.x, NRM_REDUCE_THREADS, "norm_bwd_reduce"};
    }
    return l;
}

#define NRM_DISPATCH(fn, LAYER)                           \
    switch (a->dt) {                                      \
    case OPF_F32: return fn<float, LAYER>(a, s);          \
    case OPF_F64: return fn<double, LAYER>(a, s);         \
    case OPF_BF16: return fn<__nv_bfloat16, LAYER>(a, s); \
    case OPF_F16: return fn<__half, LAYER>(a, s);         \
    default: return none;                                 \
    }                                                     \
    return none;

/* Nothing to launch (grid 0): no rows (forward), or no element of dx and of the gradients of w / b
 * (backward). */
extern "C" norm_cuda_launch norm_cuda_rms_fwd(const norm_cuda_args *a, void *stream) {
    const norm_cuda_launch none = {0, 0, NULL};
    cudaStream_t s = (cudaStream_t)stream;
    if (a->rows == 0) return none;
    NRM_DISPATCH(nrm_fwd_launch, false)
}

extern "C" norm_cuda_launch norm_cuda_ln_fwd(const norm_cuda_args *a, void *stream) {
    const norm_cuda_launch none = {0, 0, NULL};
    cudaStream_t s = (cudaStream_t)stream;
    if (a->rows == 0) return none;
    NRM_DISPATCH(nrm_fwd_launch, true)
}

extern "C" norm_cuda_launch norm_cuda_rms_bwd(const norm_cuda_args *a, void *stream) {
    const norm_cuda_launch none = {0, 0, NULL};
    cudaStream_t s = (cudaStream_t)stream;
    if (a->hidden == 0) return none;
    NRM_DISPATCH(nrm_bwd_launch, false)
}

extern "C" norm_cuda_launch norm_cuda_ln_bwd(const norm_cuda_args *a, void *stream) {
    const norm_cuda_launch none = {0, 0, NULL};
    cudaStream_t s = (cudaStream_t)stream;
    if (a->hidden == 0) return none;
    NRM_DISPATCH(nrm_bwd_launch, true)
}
