/*
 * dispersion_correction on the GPU: y = x * alpha + sqrt(x) and its backward
 * dx = g * alpha + g / (2 sqrt(x)), in the storage dtype's compute type
 * (float; double for float64). Memory-bound: a dense walk moves 16 bytes per
 * load (4 floats, 8 halves), grid-stride; any other layout takes the strided
 * walk over the merged dims the glue passes.
 */
#include "dispersion_correction.h"
#include "opforge/cuda_kernel.cuh"

#define DC_THREADS DISPERSION_CORRECTION_CUDA_THREADS
/* blocks per launch at most: 16 per multiprocessor of the largest GPUs (132 SMs), the rest by the
 * grid-stride loop */
#define DC_MAX_BLOCKS 4096

template <class T> struct alignas(16) dc_pack { T v[16 / sizeof(T)]; };

template <class A> __device__ __forceinline__ A dc_fwd(A x, A alpha) { return x * alpha + sqrt(x); }
template <class A> __device__ __forceinline__ A dc_bwd(A g, A x, A alpha) { return g * alpha + g / ((A)2 * sqrt(x)); }

/* y, x dense with the same layout; n elements. Vector packs where both are 16-byte aligned. */
template <class T>
__global__ void __launch_bounds__(DC_THREADS)
    dc_fwd_flat(T *__restrict__ y, const T *__restrict__ x, int64_t n, double alpha_) {
    typedef typename opf_acc<T>::type A;
    const A alpha = (A)alpha_;
    const int V = 16 / sizeof(T);
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t head = 0;
    if (((uintptr_t)x % 16) == 0 && ((uintptr_t)y % 16) == 0) {
        const int64_t packs = n / V;
        for (int64_t p = i0; p < packs; p += stride) {
            dc_pack<T> in = ((const dc_pack<T> *)x)[p], out;
#pragma unroll
            for (int k = 0; k < V; k++) out.v[k] = opf_from_acc<T>(dc_fwd(opf_to_acc(in.v[k]), alpha));
            ((dc_pack<T> *)y)[p] = out;
        }
        head = packs * V;
    }
    for (int64_t i = head + i0; i < n; i += stride) y[i] = opf_from_acc<T>(dc_fwd(opf_to_acc(x[i]), alpha));
}

template <class T>
__global__ void __launch_bounds__(DC_THREADS)
    dc_bwd_flat(T *__restrict__ dx, const T *__restrict__ g, const T *__restrict__ x, int64_t n, double alpha_) {
    typedef typename opf_acc<T>::type A;
    const A alpha = (A)alpha_;
    const int V = 16 / sizeof(T);
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t head = 0;
    if (((uintptr_t)x % 16) == 0 && ((uintptr_t)g % 16) == 0 && ((uintptr_t)dx % 16) == 0) {
        const int64_t packs = n / V;
        for (int64_t p = i0; p < packs; p += stride) {
            dc_pack<T> gv = ((const dc_pack<T> *)g)[p], xv = ((const dc_pack<T> *)x)[p], out;
#pragma unroll
            for (int k = 0; k < V; k++)
                out.v[k] = opf_from_acc<T>(dc_bwd(opf_to_acc(gv.v[k]), opf_to_acc(xv.v[k]), alpha));
            ((dc_pack<T> *)dx)[p] = out;
        }
        head = packs * V;
    }
    for (int64_t i = head + i0; i < n; i += stride)
        dx[i] = opf_from_acc<T>(dc_bwd(opf_to_acc(g[i]), opf_to_acc(x[i]), alpha));
}

template <class T>
__global__ void __launch_bounds__(DC_THREADS) dc_fwd_strided(T *y, const T *x, opf_cuda_nd nd, double alpha_) {
    typedef typename opf_acc<T>::type A;
    const A alpha = (A)alpha_;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nd.numel; i += (int64_t)gridDim.x * blockDim.x)
        y[opf_cuda_offset(nd, 0, i)] = opf_from_acc<T>(dc_fwd(opf_to_acc(x[opf_cuda_offset(nd, 1, i)]), alpha));
}

template <class T>
__global__ void __launch_bounds__(DC_THREADS)
    dc_bwd_strided(T *dx, const T *g, const T *x, opf_cuda_nd nd, double alpha_) {
    typedef typename opf_acc<T>::type A;
    const A alpha = (A)alpha_;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nd.numel; i += (int64_t)gridDim.x * blockDim.x)
        dx[opf_cuda_offset(nd, 0, i)] = opf_from_acc<T>(
            dc_bwd(opf_to_acc(g[opf_cuda_offset(nd, 1, i)]), opf_to_acc(x[opf_cuda_offset(nd, 2, i)]), alpha));
}

template <class T>
static void dc_fwd_launch(void *y, const void *x, const opf_cuda_nd *nd, double alpha, cudaStream_t s, unsigned *grid) {
    const int V = nd->flat ? 16 / (int)sizeof(T) : 1;
    *grid = opf_cuda_blocks(nd->numel, (int64_t)DC_THREADS * V, DC_MAX_BLOCKS);
    if (nd->flat)
        OPF_LAUNCH(dc_fwd_flat<T>, *grid, DC_THREADS, 0, s, (T *)y, (const T *)x, nd->numel, alpha);
    else
        OPF_LAUNCH(dc_fwd_strided<T>, *grid, DC_THREADS, 0, s, (T *)y, (const T *)x, *nd, alpha);
}

template <class T>
static void dc_bwd_launch(void *dx, const void *g, const void *x, const opf_cuda_nd *nd, double alpha, cudaStream_t s,
                          unsigned *grid) {
    const int V = nd->flat ? 16 / (int)sizeof(T) : 1;
    *grid = opf_cuda_blocks(nd->numel, (int64_t)DC_THREADS * V, DC_MAX_BLOCKS);
    if (nd->flat)
        OPF_LAUNCH(dc_bwd_flat<T>, *grid, DC_THREADS, 0, s, (T *)dx, (const T *)g, (const T *)x, nd->numel, alpha);
    else
        OPF_LAUNCH(dc_bwd_strided<T>, *grid, DC_THREADS, 0, s, (T *)dx, (const T *)g, (const T *)x, *nd, alpha);
}

/* The launchers the glue calls: operands as opf_cuda_nd (0: the output). They return the number of
 * blocks launched (0 when there was nothing to do), for the log line; the glue reads the runtime's
 * error. */
extern "C" unsigned dispersion_correction_cuda_fwd(opf_dtype dt, void *y, const void *x, const opf_cuda_nd *nd,
                                                   double alpha, void *stream) {
    unsigned grid = 0;
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {
    case OPF_F32: dc_fwd_launch<float>(y, x, nd, alpha, s, &grid); break;
    case OPF_F64: dc_fwd_launch<double>(y, x, nd, alpha, s, &grid); break;
    case OPF_BF16: dc_fwd_launch<__nv_bfloat16>(y, x, nd, alpha, s, &grid); break;
    case OPF_F16: dc_fwd_launch<__half>(y, x, nd, alpha, s, &grid); break;
    default: break;
    }
    return grid;
}

extern "C" unsigned dispersion_correction_cuda_bwd(opf_dtype dt, void *dx, const void *g, const void *x,
                                                   const opf_cuda_nd *nd, double alpha, void *stream) {
    unsigned grid = 0;
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {
    case OPF_F32: dc_bwd_launch<float>(dx, g, x, nd, alpha, s, &grid); break;
    case OPF_F64: dc_bwd_launch<double>(dx, g, x, nd, alpha, s, &grid); break;
    case OPF_BF16: dc_bwd_launch<__nv_bfloat16>(dx, g, x, nd, alpha, s, &grid); break;
    case OPF_F16: dc_bwd_launch<__half>(dx, g, x, nd, alpha, s, &grid); break;
    default: break;
    }
    return grid;
}
