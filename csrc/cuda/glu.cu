/*
 * Gated linear units on the GPU: out = act(gate) * up and its backward
 * dgate = grad * up * act'(gate), dup = grad * act(gate), act = silu, gelu or
 * gelu_tanh with the formulas of csrc/kernels/act.c, in the storage dtype's
 * compute type (float; double for float64). Memory-bound: each input is read
 * once and each output written once.
 *
 * One kernel per direction walks rows: the innermost merged dim of the
 * operands (of length F) is a row, the outer merged dims number the rows (a
 * dense tensor is one row; the packed (..., 2F) form split by chunk is rows of
 * F at a row stride of 2F). A row is cut into packs (16 bytes: 4 floats, 8
 * halves, when every operand's row is a 16-byte aligned unit-stride run, else
 * one element) and a power-of-two group of threads covers a row's packs: short
 * rows put several rows in a block, long rows take several blocks (one work
 * item = one chunk of a group of rows), grid-stride over the items.
 */
#include "glu.h"
#include "opforge/cuda_kernel.cuh"

#define GLU_THREADS GLU_CUDA_THREADS
/* blocks per launch at most: 16 per multiprocessor of the largest GPUs (132 SMs), the rest by the
 * grid-stride loop */
#ifdef OPF_CUDA_EMULATE
#define GLU_MAX_BLOCKS 5 /* the C tests' emulation: a few blocks, so that they run the grid-stride loop */
#else
#define GLU_MAX_BLOCKS 4096
#endif

template <class T> struct alignas(16) glu_pack { T v[16 / sizeof(T)]; };

/* How the threads of a launch cover rows of f elements as packs of V. */
struct glu_rows {
    int64_t rows, f, ppr; /* rows, elements per row, packs per row (the last may be partial) */
    int64_t cpr, items;   /* chunks of a row (one thread group's packs each), work items */
    int shift, rpi;       /* log2 of the threads per row, rows per item */
    int narrow;           /* items fit 32 bits: 32-bit divisions */
};

/* ---- activations, as csrc/kernels/act.c writes them ---- */

template <int ACT> __device__ __forceinline__ float glu_act(float x) {
    if (ACT == ACT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    if (ACT == ACT_GELU_TANH) return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return x / (1.0f + expf(-x));
}
template <int ACT> __device__ __forceinline__ double glu_act(double x) {
    if (ACT == ACT_GELU) return 0.5 * x * (1.0 + erf(x * 0.70710678118654752));
    if (ACT == ACT_GELU_TANH) return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    return x / (1.0 + exp(-x));
}

/* act(x) and act'(x), sharing the one transcendental both need */
template <int ACT> __device__ __forceinline__ void glu_act_grad(float x, float &a, float &da) {
    if (ACT == ACT_GELU) {
        const float e = erff(x * 0.70710678118654752f);
        a = 0.5f * x * (1.0f + e);
        const float cdf = 0.5f * (1.0f + e), pdf = expf(-0.5f * x * x) * 0.3989422804014327f;
        da = cdf + x * pdf;
    } else if (ACT == ACT_GELU_TANH) {
        const float k = 0.7978845608028654f, c = 0.044715f;
        const float t = tanhf(k * (x + c * x * x * x));
        a = 0.5f * x * (1.0f + t);
        da = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
    } else {
        const float d = 1.0f + expf(-x), s = 1.0f / d;
        a = x / d;
        da = s * (1.0f + x * (1.0f - s));
    }
}
template <int ACT> __device__ __forceinline__ void glu_act_grad(double x, double &a, double &da) {
    if (ACT == ACT_GELU) {
        const double e = erf(x * 0.70710678118654752);
        a = 0.5 * x * (1.0 + e);
        da = 0.5 * (1.0 + e) + x * exp(-0.5 * x * x) * 0.3989422804014327;
    } else if (ACT == ACT_GELU_TANH) {
        const double k = 0.7978845608028654, t = tanh(k * (x + 0.044715 * x * x * x));
        a = 0.5 * x * (1.0 + t);
        da = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
    } else {
        const double d = 1.0 + exp(-x), s = 1.0 / d;
        a = x / d;
        da = s * (1.0 + x * (1.0 - s));
    }
}

template <class T, int ACT> __device__ __forceinline__ T glu_fwd_elem(T x, T u) {
    return opf_from_acc<T>(glu_act<ACT>(opf_to_acc(x)) * opf_to_acc(u));
}
template <class T, int ACT> __device__ __forceinline__ void glu_bwd_elem(T g_, T x, T u, T &dg, T &du) {
    typedef typename opf_acc<T>::type A;
    const A g = opf_to_acc(g_);
    A a, da;
    glu_act_grad<ACT>(opf_to_acc(x), a, da);
    dg = opf_from_acc<T>(g * opf_to_acc(u) * da);
    du = opf_from_acc<T>(g * a);
}

/* The element offset of row `row` in each of the NOPS operands (the outer merged dims, row-major). */
template <int NOPS> __device__ __forceinline__ void glu_row_offsets(const opf_cuda_nd &nd, int64_t row, int64_t *off) {
#pragma unroll
    for (int k = 0; k < NOPS; k++) off[k] = 0;
    if (nd.ndim == 2) { /* one outer dim: no division */
#pragma unroll
        for (int k = 0; k < NOPS; k++) off[k] = row * nd.stride[k][0];
        return;
    }
    for (int d = nd.ndim - 2; d >= 0; d--) {
        const int64_t n = nd.size[d], i = row % n;
        row /= n;
#pragma unroll
        for (int k = 0; k < NOPS; k++) off[k] += i * nd.stride[k][d];
    }
}

/* This thread's row and pack in work item `it`; false when it has none there. */
__device__ __forceinline__ bool glu_item(const glu_rows &g, int64_t it, int64_t &row, int64_t &p) {
    int64_t rg = it, chunk = 0;
    if (g.cpr > 1) {
        rg = g.narrow ? (int64_t)((uint32_t)it / (uint32_t)g.cpr) : it / g.cpr;
        chunk = it - rg * g.cpr;
    }
    row = rg * g.rpi + (threadIdx.x >> g.shift);
    p = (chunk << g.shift) + (threadIdx.x & ((1u << g.shift) - 1));
    return row < g.rows && p < g.ppr;
}

/* V = 16 / sizeof(T): vector packs (unit-stride aligned rows; a row's partial last pack element by
 * element); V = 1: one element per pack at the operands' own inner strides. */
template <class T, int ACT, int V>
__global__ void __launch_bounds__(GLU_THREADS) glu_fwd_rows(T *__restrict__ out, const T *__restrict__ gate,
                                                            const T *__restrict__ up, opf_cuda_nd nd, glu_rows g) {
    const int in = nd.ndim - 1;
    for (int64_t it = blockIdx.x; it < g.items; it += gridDim.x) {
        int64_t row, p, off[3];
        if (!glu_item(g, it, row, p)) continue;
        glu_row_offsets<3>(nd, row, off);
        T *o = out + off[0];
        const T *x = gate + off[1], *u = up + off[2];
        if (V > 1) {
            const int64_t e0 = p * V;
            if (e0 + V <= g.f) {
                const glu_pack<T> xv = *(const glu_pack<T> *)(x + e0), uv = *(const glu_pack<T> *)(u + e0);
                glu_pack<T> ov;
#pragma unroll
                for (int k = 0; k < V; k++) ov.v[k] = glu_fwd_elem<T, ACT>(xv.v[k], uv.v[k]);
                *(glu_pack<T> *)(o + e0) = ov;
            } else {
                for (int64_t e = e0; e < g.f; e++) o[e] = glu_fwd_elem<T, ACT>(x[e], u[e]);
            }
        } else {
            o[p * nd.stride[0][in]] = glu_fwd_elem<T, ACT>(x[p * nd.stride[1][in]], u[p * nd.stride[2][in]]);
        }
    }
}

/* operands: 0 = dgate and dup, 1 = grad, 2 = gate, 3 = up */
template <class T, int ACT, int V>
__global__ void __launch_bounds__(GLU_THREADS)
    glu_bwd_rows(T *__restrict__ dgate, T *__restrict__ dup, const T *__restrict__ grad, const T *__restrict__ gate,
                 const T *__restrict__ up, opf_cuda_nd nd, glu_rows g) {
    const int in = nd.ndim - 1;
    for (int64_t it = blockIdx.x; it < g.items; it += gridDim.x) {
        int64_t row, p, off[4];
        if (!glu_item(g, it, row, p)) continue;
        glu_row_offsets<4>(nd, row, off);
        T *dg = dgate + off[0], *du = dup + off[0];
        const T *r = grad + off[1], *x = gate + off[2], *u = up + off[3];
        if (V > 1) {
            const int64_t e0 = p * V;
            if (e0 + V <= g.f) {
                const glu_pack<T> rv = *(const glu_pack<T> *)(r + e0), xv = *(const glu_pack<T> *)(x + e0),
                                  uv = *(const glu_pack<T> *)(u + e0);
                glu_pack<T> dgv, duv;
#pragma unroll
                for (int k = 0; k < V; k++) glu_bwd_elem<T, ACT>(rv.v[k], xv.v[k], uv.v[k], dgv.v[k], duv.v[k]);
                *(glu_pack<T> *)(dg + e0) = dgv;
                *(glu_pack<T> *)(du + e0) = duv;
            } else {
                for (int64_t e = e0; e < g.f; e++) glu_bwd_elem<T, ACT>(r[e], x[e], u[e], dg[e], du[e]);
            }
        } else {
            const int64_t od = p * nd.stride[0][in];
            glu_bwd_elem<T, ACT>(r[p * nd.stride[1][in]], x[p * nd.stride[2][in]], u[p * nd.stride[3][in]], dg[od],
                                 du[od]);
        }
    }
}

/* Rows of nd's innermost dim cut into packs of v; the grid it takes. */
static glu_rows glu_plan(const opf_cuda_nd *nd, int v, unsigned *grid) {
    glu_rows g;
    g.f = nd->size[nd->ndim - 1];
    g.rows = nd->numel / g.f;
    g.ppr = (g.f + v - 1) / v;
    int tpr = 1, shift = 0;
    while (tpr < g.ppr && tpr < GLU_THREADS) tpr <<= 1, shift++;
    g.shift = shift;
    g.rpi = GLU_THREADS / tpr;
    g.cpr = (g.ppr + tpr - 1) / tpr;
    g.items = (g.rows + g.rpi - 1) / g.rpi * g.cpr;
    g.narrow = g.items <= (int64_t)UINT32_MAX;
    *grid = opf_cuda_blocks(g.items, 1, GLU_MAX_BLOCKS);
    return g;
}

extern "C" int glu_cuda_vector(opf_dtype dt, const opf_cuda_nd *nd, const void *const *ptrs, int nptrs) {
    const int64_t v = 16 / (int64_t)opf_dtype_size(dt), in = nd->ndim - 1;
    for (int i = 0; i < nptrs; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0) return 0;
    for (int k = 0; k < nd->nops; k++) {
        if (nd->stride[k][in] != 1) return 0;
        for (int d = 0; d < in; d++)
            if (nd->stride[k][d] % v != 0) return 0;
    }
    return 1;
}

template <class T, int ACT>
static unsigned glu_fwd_launch(void *out, const void *gate, const void *up, const opf_cuda_nd *nd, int vec,
                               cudaStream_t s) {
    unsigned grid;
    if (vec) {
        const glu_rows g = glu_plan(nd, 16 / sizeof(T), &grid);
        auto kernel = glu_fwd_rows<T, ACT, 16 / sizeof(T)>;
        OPF_LAUNCH(kernel, grid, GLU_THREADS, 0, s, (T *)out, (const T *)gate, (const T *)up, *nd, g);
    } else {
        const glu_rows g = glu_plan(nd, 1, &grid);
        auto kernel = glu_fwd_rows<T, ACT, 1>;
        OPF_LAUNCH(kernel, grid, GLU_THREADS, 0, s, (T *)out, (const T *)gate, (const T *)up, *nd, g);
    }
    return grid;
}

template <class T, int ACT>
static unsigned glu_bwd_launch(void *dgate, void *dup, const void *grad, const void *gate, const void *up,
                               const opf_cuda_nd *nd, int vec, cudaStream_t s) {
    unsigned grid;
    if (vec) {
        const glu_rows g = glu_plan(nd, 16 / sizeof(T), &grid);
        auto kernel = glu_bwd_rows<T, ACT, 16 / sizeof(T)>;
        OPF_LAUNCH(kernel, grid, GLU_THREADS, 0, s, (T *)dgate, (T *)dup, (const T *)grad, (const T *)gate,
                   (const T *)up, *nd, g);
    } else {
        const glu_rows g = glu_plan(nd, 1, &grid);
        auto kernel = glu_bwd_rows<T, ACT, 1>;
        OPF_LAUNCH(kernel, grid, GLU_THREADS, 0, s, (T *)dgate, (T *)dup, (const T *)grad, (const T *)gate,
                   (const T *)up, *nd, g);
    }
    return grid;
}

template <class T>
static unsigned glu_fwd_act(void *out, const void *gate, const void *up, const opf_cuda_nd *nd, int act, int vec,
                            cudaStream_t s) {
    switch (act) {
    case ACT_GELU: return glu_fwd_launch<T, ACT_GELU>(out, gate, up, nd, vec, s);
    case ACT_GELU_TANH: return glu_fwd_launch<T, ACT_GELU_TANH>(out, gate, up, nd, vec, s);
    case ACT_SILU: return glu_fwd_launch<T, ACT_SILU>(out, gate, up, nd, vec, s);
    default: return 0;
    }
}

template <class T>
static unsigned glu_bwd_act(void *dgate, void *dup, const void *grad, const void *gate, const void *up,
                            const opf_cuda_nd *nd, int act, int vec, cudaStream_t s) {
    switch (act) {
    case ACT_GELU: return glu_bwd_launch<T, ACT_GELU>(dgate, dup, grad, gate, up, nd, vec, s);
    case ACT_GELU_TANH: return glu_bwd_launch<T, ACT_GELU_TANH>(dgate, dup, grad, gate, up, nd, vec, s);
    case ACT_SILU: return glu_bwd_launch<T, ACT_SILU>(dgate, dup, grad, gate, up, nd, vec, s);
    default: return 0;
    }
}

/* The launchers the glue calls. They return the number of blocks launched (0 when there was nothing
 * to do), for the log line; the glue reads the runtime's error. */
extern "C" unsigned glu_cuda_fwd(opf_dtype dt, void *out, const void *gate, const void *up, const opf_cuda_nd *nd,
                                 int act, void *stream) {
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    const void *ptrs[] = {out, gate, up};
    const int vec = glu_cuda_vector(dt, nd, ptrs, 3);
    switch (dt) {
    case OPF_F32: return glu_fwd_act<float>(out, gate, up, nd, act, vec, s);
    case OPF_F64: return glu_fwd_act<double>(out, gate, up, nd, act, vec, s);
    case OPF_BF16: return glu_fwd_act<__nv_bfloat16>(out, gate, up, nd, act, vec, s);
    case OPF_F16: return glu_fwd_act<__half>(out, gate, up, nd, act, vec, s);
    default: return 0;
    }
}

extern "C" unsigned glu_cuda_bwd(opf_dtype dt, void *dgate, void *dup, const void *grad, const void *gate,
                                 const void *up, const opf_cuda_nd *nd, int act, void *stream) {
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    const void *ptrs[] = {dgate, dup, grad, gate, up};
    const int vec = glu_cuda_vector(dt, nd, ptrs, 5);
    switch (dt) {
    case OPF_F32: return glu_bwd_act<float>(dgate, dup, grad, gate, up, nd, act, vec, s);
    case OPF_F64: return glu_bwd_act<double>(dgate, dup, grad, gate, up, nd, act, vec, s);
    case OPF_BF16: return glu_bwd_act<__nv_bfloat16>(dgate, dup, grad, gate, up, nd, act, vec, s);
    case OPF_F16: return glu_bwd_act<__half>(dgate, dup, grad, gate, up, nd, act, vec, s);
    default: return 0;
    }
}
