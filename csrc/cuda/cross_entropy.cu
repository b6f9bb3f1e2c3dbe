/*
 * The fused cross-entropy on the GPU (formulas, ignore_index, label smoothing,
 * softcap and reductions: csrc/kernels/cross_entropy.h), made for long
 * vocabularies: the forward reads each row of logits once (an online max and
 * sum of exponentials, plus sum_j w_j z_j under label smoothing) and writes
 * the row's loss and logsumexp; the backward reads each row once more and
 * writes its gradient once, in the logits' dtype (no float32 copy of a row).
 *   rows of up to CE_WARP_MAX classes: a warp per row, 8 rows per block;
 *   longer rows: a block per row (256 threads, 512 from CE_WIDE classes).
 * A row of stride 1 moves 16-byte packs (4 loads in flight a thread) between
 * its first and last 16-byte boundary, the rest element by element; a class
 * stride other than 1 goes element by element. The arithmetic is float
 * (double for float64); the per-row scalars (loss, lse, the gradient's
 * coefficients) are double, as the reference's. The mean and the sum are
 * deterministic: each block adds its rows' losses and target weights in
 * double in a fixed order, and one block adds the blocks' sums in a fixed
 * order (ce_finish). The mean's W and the weights' sum that the backward and
 * label smoothing need come from one small block (ce_prep) that runs first.
 * The CPU op raises on a target outside [0, C) other than ignore_index; a
 * kernel cannot raise without a synchronisation, so such a row's loss and lse
 * are NaN (and so the mean and the sum), and its gradient row NaN.
 */
#include <math.h>
#include <string.h>

#include "cross_entropy.h"
#include "opforge/cuda_kernel.cuh"
#include "rows.cuh"

#define CE_WARP_MAX 2048   /* classes up to which a warp takes a row */
#define CE_WIDE 32768      /* classes from which a block has 512 threads (else 256) */
#define CE_WARP_ROWS 8     /* rows (warps) per block on the warp path */
#define CE_MAX_BLOCKS 2048 /* blocks of the row kernels at most (the rest by grid-stride loops) */
#define CE_PREP_THREADS 512
#define CE_FINISH_THREADS 256
#define CE_MEAN 1 /* CROSS_ENTROPY_REDUCTION_MEAN */

__device__ __forceinline__ float ce_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double ce_tanh(double v) { return tanh(v); }

/* row_online1 (rows.cuh) over K values at once: one rescale per batch */
template <int K, class A> __device__ __forceinline__ void ce_online(A &m, A &s, const A *z) {
    A pm = z[0];
#pragma unroll
    for (int k = 1; k < K; k++) pm = opf_max(pm, z[k]);
    const A mn = opf_max(m, pm);
    if (mn == (A)-INFINITY) return;
    if (mn != m) s *= row_exp(m - mn);
#pragma unroll
    for (int k = 0; k < K; k++) s += row_exp(z[k] - mn);
    m = mn;
}
/* (m, s, and t summed) over the row's group: its warp, or the block (scratch: 96 values) */
template <bool WARP, class A> __device__ __forceinline__ void ce_group_reduce(A &m, A &s, A &t, A *scratch) {
    for (int k = 16; k > 0; k >>= 1) {
        A m2 = __shfl_xor_sync(0xffffffffu, m, k), s2 = __shfl_xor_sync(0xffffffffu, s, k);
        t += __shfl_xor_sync(0xffffffffu, t, k);
        row_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (WARP || warps == 1) return;
    if (lane == 0) scratch[warp] = m, scratch[32 + warp] = s, scratch[64 + warp] = t;
    __syncthreads();
    m = lane < warps ? scratch[lane] : (A)-INFINITY;
    s = lane < warps ? scratch[32 + lane] : (A)0;
    t = lane < warps ? scratch[64 + lane] : (A)0;
    for (int k = 16; k > 0; k >>= 1) {
        A m2 = __shfl_xor_sync(0xffffffffu, m, k), s2 = __shfl_xor_sync(0xffffffffu, s, k);
        t += __shfl_xor_sync(0xffffffffu, t, k);
        row_merge(m, s, m2, s2);
    }
    __syncthreads();
}

/* what the kernels share: the problem's scalars */
struct ce_geom {
    opf_cuda_nd rows;
    int64_t nrows, C, cs, ws, ignore;
    double eps, cap;
    int reduction;
};

/* z = c tanh(x / c) with a softcap (EXTRA), else x */
template <bool EXTRA, class A> __device__ __forceinline__ A ce_z(A x, A cap) {
    if constexpr (EXTRA)
        return cap > (A)0 ? cap * ce_tanh(x / cap) : x;
    else
        return x;
}
template <class T> __device__ __forceinline__ typename opf_acc<T>::type ce_w(const T *w, int64_t ws, int64_t j) {
    typedef typename opf_acc<T>::type A;
    return w ? opf_to_acc(w[j * ws]) : (A)1;
}

/* ---- forward --------------------------------------------------------------------- */

/* One row's online (m, s) of z and, under label smoothing (EXTRA with smooth), t = sum_j w_j z_j, this
 * thread's share. */
template <class T, bool EXTRA, class A>
__device__ __forceinline__ void ce_row_fwd(const T *xr, const T *w, const ce_geom &g, bool smooth, int tid, int G, A &m,
                                           A &s, A &t) {
    const int V = row_io<T>::V, U = 4;
    const A cap = (A)g.cap;
    m = (A)-INFINITY, s = 0, t = 0;
    const row_span sp = row_span_of(xr, xr, xr, g.C, g.cs == 1);
#define CE_ONE(j, xv)                                      \
    do {                                                   \
        const A z_ = ce_z<EXTRA>((A)(xv), cap);            \
        if (EXTRA && smooth) t += ce_w(w, g.ws, (j)) * z_; \
        row_online1(m, s, z_);                             \
    } while (0)
    if (sp.vec) {
        if (tid < sp.head) CE_ONE(tid, opf_to_acc(xr[tid]));
        const row_pack *xp = (const row_pack *)(xr + sp.head);
        int64_t q = tid;
        for (; q + (U - 1) * (int64_t)G < sp.npk; q += U * (int64_t)G) {
            row_pack pk[U];
#pragma unroll
            for (int u = 0; u < U; u++) pk[u] = xp[q + u * (int64_t)G];
            A z[U * V];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int v = 0; v < V; v++) {
                    z[u * V + v] = ce_z<EXTRA>(row_io<T>::get(pk[u], v), cap);
                    if (EXTRA && smooth) t += ce_w(w, g.ws, sp.head + (q + u * (int64_t)G) * V + v) * z[u * V + v];
                }
            ce_online<U * V>(m, s, z);
        }
        for (; q < sp.npk; q += G) {
            const row_pack pk = xp[q];
            A z[V];
#pragma unroll
            for (int v = 0; v < V; v++) {
                z[v] = ce_z<EXTRA>(row_io<T>::get(pk, v), cap);
                if (EXTRA && smooth) t += ce_w(w, g.ws, sp.head + q * V + v) * z[v];
            }
            ce_online<V>(m, s, z);
        }
        if (sp.tail0 + tid < g.C) CE_ONE(sp.tail0 + tid, opf_to_acc(xr[sp.tail0 + tid]));
    } else {
        for (int64_t j = tid; j < g.C; j += G) CE_ONE(j, opf_to_acc(xr[j * g.cs]));
    }
#undef CE_ONE
}

template <class T, bool WARP, bool EXTRA>
__global__ void __launch_bounds__(WARP ? 32 * CE_WARP_ROWS : 512)
    ce_fwd_rows(T *__restrict__ losses, double *__restrict__ lse, double *__restrict__ partials,
                const T *__restrict__ x, const int64_t *__restrict__ target, const T *__restrict__ w,
                const double *__restrict__ prep, ce_geom g) {
    typedef typename opf_acc<T>::type A;
    __shared__ A scratch[96];
    __shared__ double warp_sums[2][CE_WARP_ROWS];
    int64_t row, step;
    int tid, G;
    row_group_first<WARP>(row, step, tid, G);
    const double C = (double)g.C, eps = g.eps, wc = prep ? prep[1] : C;
    const bool smooth = eps > 0;
    double lsum = 0, wsum = 0; /* the group's leader's, in its rows' order */
    for (; row < g.nrows; row += step) {
        const int64_t t = target[opf_cuda_offset(g.rows, 2, row)];
        double loss = 0, lse_row = 0;
        if (t != g.ignore) { /* the same for the whole group: its reductions are reached by all */
            double wt = (double)NAN;
            loss = lse_row = (double)NAN;
            if (t >= 0 && t < g.C) {
                const T *xr = x + opf_cuda_offset(g.rows, 1, row);
                A m, s, wz;
                ce_row_fwd<T, EXTRA>(xr, w, g, smooth, tid, G, m, s, wz);
                ce_group_reduce<WARP>(m, s, wz, scratch);
                /* a row of -inf only: exp(-inf - -inf) summed, NaN, as the reference */
                lse_row = m == (A)-INFINITY ? (double)NAN : (double)m + log((double)s);
                const double zt = (double)ce_z<EXTRA>(opf_to_acc(xr[t * g.cs]), (A)g.cap);
                wt = (double)ce_w(w, g.ws, t);
                loss = (1 - eps) * wt * (lse_row - zt);
                if (smooth) loss += eps / C * (lse_row * wc - (double)wz);
            }
            wsum += wt;
        }
        if (tid == 0) {
            losses[row] = opf_from_acc<T>((A)loss);
            lse[row] = lse_row;
        }
        lsum += loss;
    }
    if constexpr (WARP) {
        const int warp = threadIdx.x >> 5;
        if (tid == 0) warp_sums[0][warp] = lsum, warp_sums[1][warp] = wsum;
        __syncthreads();
        if (threadIdx.x == 0) {
            lsum = wsum = 0;
            for (int k = 0; k < (int)(blockDim.x >> 5); k++) lsum += warp_sums[0][k], wsum += warp_sums[1][k];
        }
    }
    if (threadIdx.x == 0) partials[2 * blockIdx.x] = lsum, partials[2 * blockIdx.x + 1] = wsum;
}

/* loss = the blocks' sums added in order (a fixed tree over the block's threads), / W for the mean */
template <class T>
__global__ void __launch_bounds__(CE_FINISH_THREADS)
    ce_finish(T *__restrict__ loss, const double *__restrict__ partials, int64_t nparts, int mean) {
    typedef typename opf_acc<T>::type A;
    __shared__ double scratch[32];
    double l = 0, wt = 0;
    for (int64_t p = threadIdx.x; p < nparts; p += blockDim.x) l += partials[2 * p], wt += partials[2 * p + 1];
    l = opf_block_sum(l, scratch);
    wt = opf_block_sum(wt, scratch);
    if (threadIdx.x == 0) loss[0] = opf_from_acc<T>((A)(mean ? l / wt : l));
}

/* out[0]: the backward's scale of grad_loss (grad_loss / W for a mean, W the targets' weights as the
 * forward adds them; grad_loss itself when it is 0 or the reduction is not the mean); out[1]: the
 * weights' sum (C without weight). One block. */
template <class T>
__global__ void __launch_bounds__(CE_PREP_THREADS)
    ce_prep(double *__restrict__ out, const int64_t *__restrict__ target, const T *__restrict__ w,
            const T *__restrict__ grad_loss, ce_geom g, int need_w, int need_wc) {
    __shared__ double scratch[32];
    double W = 0, wc = 0;
    if (need_w)
        for (int64_t i = threadIdx.x; i < g.nrows; i += blockDim.x) {
            const int64_t t = target[opf_cuda_offset(g.rows, 2, i)];
            if (t != g.ignore) W += t >= 0 && t < g.C ? (double)ce_w(w, g.ws, t) : (double)NAN;
        }
    if (need_wc)
        for (int64_t j = threadIdx.x; j < g.C; j += blockDim.x) wc += (double)opf_to_acc(w[j * g.ws]);
    W = opf_block_sum(W, scratch);
    wc = opf_block_sum(wc, scratch);
    if (threadIdx.x == 0) {
        const double gl = grad_loss ? (double)opf_to_acc(grad_loss[0]) : 0.0;
        out[0] = g.reduction == CE_MEAN && gl != 0 ? gl / W : gl;
        out[1] = need_wc ? wc : (double)g.C;
    }
}

/* ---- backward -------------------------------------------------------------------- */

/* dx_j = (a p_j - b w_j - ct [j == t]) (1 - (z_j / c)^2 with a softcap), p_j = exp(z_j - lse) */
template <bool EXTRA, class T, class A>
__device__ __forceinline__ A ce_grad(A xv, int64_t j, int64_t t, A a, A b, A ct, A lse, A cap, const T *w, int64_t ws) {
    const A z = ce_z<EXTRA>(xv, cap);
    A gv = a * row_exp(z - lse) - (j == t ? ct : (A)0);
    if constexpr (EXTRA) {
        gv -= b * ce_w(w, ws, j);
        if (cap > (A)0) gv *= (A)1 - (z / cap) * (z / cap);
    }
    return gv;
}

template <class T, bool WARP, bool EXTRA>
__global__ void __launch_bounds__(WARP ? 32 * CE_WARP_ROWS : 512)
    ce_bwd_rows(T *__restrict__ dx, const T *__restrict__ x, const int64_t *__restrict__ target,
                const T *__restrict__ w, const T *__restrict__ grad_losses, const T *__restrict__ grad_loss,
                const void *__restrict__ lse_saved, int lse_f32, const double *__restrict__ prep, ce_geom g) {
    typedef typename opf_acc<T>::type A;
    const int V = row_io<T>::V, U = 4;
    int64_t row, step;
    int tid, G;
    row_group_first<WARP>(row, step, tid, G);
    const double C = (double)g.C, eps = g.eps;
    const double coef = prep ? prep[0] : (double)opf_to_acc(grad_loss[0]), wc = prep ? prep[1] : C;
    const A cap = (A)g.cap;
    for (; row < g.nrows; row += step) {
        int64_t t = target[opf_cuda_offset(g.rows, 2, row)];
        double a = 0, b = 0, ct = 0;
        if (t == g.ignore) {
            t = -1;
        } else if (t < 0 || t >= g.C) {
            t = -1, a = (double)NAN; /* the whole row NaN */
        } else {
            const double s = coef + (double)opf_to_acc(grad_losses[opf_cuda_offset(g.rows, 3, row)]);
            const double wt = (double)ce_w(w, g.ws, t);
            a = s * ((1 - eps) * wt + eps / C * wc);
            b = s * eps / C;
            ct = s * (1 - eps) * wt;
        }
        const bool zero = a == 0 && b == 0 && ct == 0; /* exact zeros, as the reference */
        const A lse = (A)(lse_f32 ? (double)((const float *)lse_saved)[row] : ((const double *)lse_saved)[row]);
        const A af = (A)a, bf = (A)b, cf = (A)ct;
        const T *xr = x + opf_cuda_offset(g.rows, 1, row);
        T *dr = dx + row * g.C;
        const row_span sp = row_span_of(xr, (const T *)dr, (const T *)dr, g.C, g.cs == 1);
#define CE_GRAD(j, xv) (zero ? (A)0 : ce_grad<EXTRA>((A)(xv), (j), t, af, bf, cf, lse, cap, w, g.ws))
        if (sp.vec) {
            if (tid < sp.head) dr[tid] = opf_from_acc<T>(CE_GRAD(tid, opf_to_acc(xr[tid])));
            const row_pack *xp = (const row_pack *)(xr + sp.head);
            row_pack *dp = (row_pack *)(dr + sp.head);
            int64_t q = tid;
            for (; q + (U - 1) * (int64_t)G < sp.npk; q += U * (int64_t)G) {
                row_pack pk[U];
#pragma unroll
                for (int u = 0; u < U; u++) pk[u] = xp[q + u * (int64_t)G];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int64_t j0 = sp.head + (q + u * (int64_t)G) * V;
#pragma unroll
                    for (int v = 0; v < V; v++) row_io<T>::set(pk[u], v, CE_GRAD(j0 + v, row_io<T>::get(pk[u], v)));
                    dp[q + u * (int64_t)G] = pk[u];
                }
            }
            for (; q < sp.npk; q += G) {
                row_pack pk = xp[q];
                const int64_t j0 = sp.head + q * V;
#pragma unroll
                for (int v = 0; v < V; v++) row_io<T>::set(pk, v, CE_GRAD(j0 + v, row_io<T>::get(pk, v)));
                dp[q] = pk;
            }
            const int64_t j = sp.tail0 + tid;
            if (j < g.C) dr[j] = opf_from_acc<T>(CE_GRAD(j, opf_to_acc(xr[j])));
        } else {
            for (int64_t j = tid; j < g.C; j += G) dr[j] = opf_from_acc<T>(CE_GRAD(j, opf_to_acc(xr[j * g.cs])));
        }
#undef CE_GRAD
    }
}

/* ---- launchers ---------------------------------------------------------------- */

static ce_geom ce_geom_of(const cross_entropy_cuda_problem *p) {
    ce_geom g;
    g.rows = p->rows;
    g.nrows = p->nrows, g.C = p->classes, g.cs = p->class_stride, g.ws = p->weight_stride;
    g.ignore = p->ignore_index, g.eps = p->label_smoothing, g.cap = p->softcap, g.reduction = p->reduction;
    return g;
}

/* warp per row (short rows) or block per row, its threads and blocks */
static int ce_warp_path(const cross_entropy_cuda_problem *p) { return p->classes <= CE_WARP_MAX; }
static unsigned ce_block(const cross_entropy_cuda_problem *p) {
    return ce_warp_path(p) ? 32 * CE_WARP_ROWS : p->classes >= CE_WIDE ? 512 : 256;
}
static unsigned ce_grid(const cross_entropy_cuda_problem *p) {
    return opf_cuda_blocks(p->nrows, ce_warp_path(p) ? CE_WARP_ROWS : 1, CE_MAX_BLOCKS);
}
static int ce_extra(const cross_entropy_cuda_problem *p) { return p->label_smoothing > 0 || p->softcap > 0; }

extern "C" int64_t cross_entropy_cuda_fwd_workspace(opf_dtype dt, const cross_entropy_cuda_problem *p, int has_weight) {
    (void)dt, (void)has_weight;
    /* doubles: 2 per block, then the prep's 2 */
    return 2 * (2 * (int64_t)(p->nrows > 0 ? ce_grid(p) : 0) + 2);
}

extern "C" int64_t cross_entropy_cuda_bwd_workspace(opf_dtype dt, const cross_entropy_cuda_problem *p, int has_weight) {
    (void)dt;
    const int need = p->reduction == CE_MEAN || (has_weight && p->label_smoothing > 0);
    return need && p->nrows > 0 && p->classes > 0 ? 4 : 0;
}

template <class T>
static void ce_fwd_launch(T *losses, T *loss, double *lse, const T *x, const int64_t *target, const T *w, double *ws,
                          const cross_entropy_cuda_problem *p, cudaStream_t s, cross_entropy_cuda_launch *r) {
    typedef void (*fn)(T *, double *, double *, const T *, const int64_t *, const T *, const double *, ce_geom);
    const ce_geom g = ce_geom_of(p);
    const unsigned nparts = p->nrows > 0 ? ce_grid(p) : 0;
    double *prep = ws + 2 * (int64_t)nparts;
    const int need_wc = w && p->label_smoothing > 0;
    if (need_wc) OPF_LAUNCH(ce_prep<T>, 1, CE_PREP_THREADS, 0, s, prep, target, w, (const T *)NULL, g, 0, 1);
    if (nparts) {
        const int warp = ce_warp_path(p), extra = ce_extra(p);
        const fn k = warp ? (extra ? ce_fwd_rows<T, true, true> : ce_fwd_rows<T, true, false>)
                          : (extra ? ce_fwd_rows<T, false, true> : ce_fwd_rows<T, false, false>);
        r->grid = nparts;
        r->block = ce_block(p);
        r->kernel = warp ? "cross_entropy_fwd_warp" : "cross_entropy_fwd_block";
        OPF_LAUNCH(k, r->grid, r->block, 0, s, losses, lse, ws, x, target, w, need_wc ? (const double *)prep : NULL, g);
    } else {
        r->grid = 1, r->block = CE_FINISH_THREADS, r->kernel = "cross_entropy_fwd_finish";
    }
    OPF_LAUNCH(ce_finish<T>, 1, CE_FINISH_THREADS, 0, s, loss, (const double *)ws, (int64_t)nparts,
               p->reduction == CE_MEAN);
}

template <class T>
static void ce_bwd_launch(T *dx, const T *x, const int64_t *target, const T *w, const T *gls, const T *gl,
                          const void *lse, int lse_f32, double *ws, const cross_entropy_cuda_problem *p, cudaStream_t s,
                          cross_entropy_cuda_launch *r) {
    typedef void (*fn)(T *, const T *, const int64_t *, const T *, const T *, const T *, const void *, int,
                       const double *, ce_geom);
    const ce_geom g = ce_geom_of(p);
    const int need_w = p->reduction == CE_MEAN, need_wc = w && p->label_smoothing > 0;
    if (need_w || need_wc) OPF_LAUNCH(ce_prep<T>, 1, CE_PREP_THREADS, 0, s, ws, target, w, gl, g, need_w, need_wc);
    const int warp = ce_warp_path(p), extra = ce_extra(p);
    const fn k = warp ? (extra ? ce_bwd_rows<T, true, true> : ce_bwd_rows<T, true, false>)
                      : (extra ? ce_bwd_rows<T, false, true> : ce_bwd_rows<T, false, false>);
    r->grid = ce_grid(p);
    r->block = ce_block(p);
    r->kernel = warp ? "cross_entropy_bwd_warp" : "cross_entropy_bwd_block";
    OPF_LAUNCH(k, r->grid, r->block, 0, s, dx, x, target, w, gls, gl, lse, lse_f32,
               need_w || need_wc ? (const double *)ws : NULL, g);
}

extern "C" cross_entropy_cuda_launch cross_entropy_cuda_fwd(opf_dtype dt, void *losses, void *loss, double *lse,
                                                            const void *logits, const int64_t *target,
                                                            const void *weight, float *ws,
                                                            const cross_entropy_cuda_problem *p, void *stream) {
    cross_entropy_cuda_launch r = {0, 0, "cross_entropy_fwd"};
    cudaStream_t s = (cudaStream_t)stream;
    double *w64 = (double *)ws;
    switch (dt) {
    case OPF_F32:
        ce_fwd_launch((float *)losses, (float *)loss, lse, (const float *)logits, target, (const float *)weight, w64, p,
                      s, &r);
        break;
    case OPF_F64:
        ce_fwd_launch((double *)losses, (double *)loss, lse, (const double *)logits, target, (const double *)weight,
                      w64, p, s, &r);
        break;
    case OPF_BF16:
        ce_fwd_launch((__nv_bfloat16 *)losses, (__nv_bfloat16 *)loss, lse, (const __nv_bfloat16 *)logits, target,
                      (const __nv_bfloat16 *)weight, w64, p, s, &r);
        break;
    case OPF_F16:
        ce_fwd_launch((__half *)losses, (__half *)loss, lse, (const __half *)logits, target, (const __half *)weight,
                      w64, p, s, &r);
        break;
    default: break;
    }
    return r;
}

extern "C" cross_entropy_cuda_launch cross_entropy_cuda_bwd(opf_dtype dt, void *dlogits, const void *logits,
                                                            const int64_t *target, const void *weight,
                                                            const void *grad_losses, const void *grad_loss,
                                                            const void *lse, int lse_f32, float *ws,
                                                            const cross_entropy_cuda_problem *p, void *stream) {
    cross_entropy_cuda_launch r = {0, 0, "cross_entropy_bwd"};
    if (p->nrows == 0 || p->classes == 0) return r;
    cudaStream_t s = (cudaStream_t)stream;
    double *w64 = (double *)ws;
    switch (dt) {
    case OPF_F32:
        ce_bwd_launch((float *)dlogits, (const float *)logits, target, (const float *)weight,
                      (const float *)grad_losses, (const float *)grad_loss, lse, lse_f32, w64, p, s, &r);
        break;
    case OPF_F64:
        ce_bwd_launch((double *)dlogits, (const double *)logits, target, (const double *)weight,
                      (const double *)grad_losses, (const double *)grad_loss, lse, lse_f32, w64, p, s, &r);
        break;
    case OPF_BF16:
        ce_bwd_launch((__nv_bfloat16 *)dlogits, (const __nv_bfloat16 *)logits, target, (const __nv_bfloat16 *)weight,
                      (const __nv_bfloat16 *)grad_losses, (const __nv_bfloat16 *)grad_loss, lse, lse_f32, w64, p, s,
                      &r);
        break;
    case OPF_F16:
        ce_bwd_launch((__half *)dlogits, (const __half *)logits, target, (const __half *)weight,
                      (const __half *)grad_losses, (const __half *)grad_loss, lse, lse_f32, w64, p, s, &r);
        break;
    default: break;
    }
    return r;
}
