/*
 * What a C-style CUDA kernel file of opforge includes (opforge's own in
 * csrc/cuda, and a user's `my_op.cu`): the CUDA headers, a launch macro that
 * the C tests' CPU emulation understands too, and the element and reduction
 * helpers every memory-bound kernel needs. No torch header: a kernel file
 * sees raw pointers, sizes and strides, and exports extern "C" launchers that
 * the C glue calls with torch's current stream.
 *
 *   OPF_LAUNCH(kernel, grid, block, shared_bytes, stream, args...)
 *       kernel<<<grid, block, shared_bytes, stream>>>(args...) on the GPU;
 *       with -DOPF_CUDA_EMULATE (tests/emu/cuda_emu.h), the same kernel run
 *       on the CPU, a fiber per thread. A template with several arguments needs a name first
 *       (the commas would split the macro's arguments): auto k = kern<T, 4>; OPF_LAUNCH(k, ...).
 *   OPF_DYNAMIC_SHARED(type, name)   extern __shared__ type name[]
 *   opf_ld(p, i) / opf_st(p, i, v)   element i of a float/double/bf16/fp16 array, as the
 *                                    compute type (float; double for double)
 *   opf_warp_sum / opf_block_sum / opf_warp_max / opf_block_max   reductions of a block's threads (the
 *                                    maxima keep NaN)
 */
#ifndef OPFORGE_CUDA_KERNEL_CUH
#define OPFORGE_CUDA_KERNEL_CUH

#include <stdint.h>

#ifdef OPF_CUDA_EMULATE
#include "cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define OPF_LAUNCH(kernel, grid, block, smem, stream, ...) \
    kernel<<<(grid), (block), (smem), (cudaStream_t)(stream)>>>(__VA_ARGS__)
#define OPF_DYNAMIC_SHARED(type, name)                            \
    extern __shared__ __align__(16) unsigned char name##_bytes[]; \
    type *name = (type *)name##_bytes
#endif

#include "opforge/cuda_types.h"
#include "opforge/half.h"

/* The compute type of a storage type: float, and double for double. */
template <class T> struct opf_acc { typedef float type; };
template <> struct opf_acc<double> { typedef double type; };

__device__ __forceinline__ float opf_to_acc(float v) { return v; }
__device__ __forceinline__ double opf_to_acc(double v) { return v; }
__device__ __forceinline__ float opf_to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float opf_to_acc(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T opf_from_acc(float v);
template <> __device__ __forceinline__ float opf_from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 opf_from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half opf_from_acc<__half>(float v) { return __float2half_rn(v); }
template <class T> __device__ __forceinline__ T opf_from_acc(double v) { return (T)v; }

template <class T> __device__ __forceinline__ typename opf_acc<T>::type opf_ld(const T *p, int64_t i) {
    return opf_to_acc(p[i]);
}
template <class T, class A> __device__ __forceinline__ void opf_st(T *p, int64_t i, A v) { p[i] = opf_from_acc<T>(v); }

/* The offset in operand k of flat element i (row-major over nd's merged sizes). */
__device__ __forceinline__ int64_t opf_cuda_offset(const opf_cuda_nd &nd, int k, int64_t i) {
    int64_t off = 0;
    for (int d = nd.ndim - 1; d >= 0; d--) {
        const int64_t n = nd.size[d];
        off += (i % n) * nd.stride[k][d];
        i /= n;
    }
    return off;
}

template <class A> __device__ __forceinline__ A opf_warp_sum(A v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
/* The larger of a and b, NaN when either is (a max that dropped a NaN would hide it from a row's result,
 * where torch's max returns it). */
template <class A> __device__ __forceinline__ A opf_max(A a, A b) { return (a > b || a != a) ? a : b; }

template <class A> __device__ __forceinline__ A opf_warp_max(A v) {
    for (int m = 16; m > 0; m >>= 1) v = opf_max(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

/* The sum over the block's threads (blockDim.x a multiple of 32, at most 1024), returned to every
 * thread. scratch: 32 values of shared memory, free again when it returns. Every thread of the
 * block calls it. */
template <class A> __device__ __forceinline__ A opf_block_sum(A v, A *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = opf_warp_sum(v);
    if (warps == 1) return v;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A t = lane < warps ? scratch[lane] : (A)0;
    t = opf_warp_sum(t);
    __syncthreads();
    return t;
}
template <class A> __device__ __forceinline__ A opf_block_max(A v, A *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = opf_warp_max(v);
    if (warps == 1) return v;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A t = lane < warps ? scratch[lane] : scratch[0];
    t = opf_warp_max(t);
    __syncthreads();
    return t;
}

/* Blocks for n items of `per_block` each, capped at what keeps every multiprocessor busy (a
 * grid-stride loop covers the rest). */
static inline unsigned opf_cuda_blocks(int64_t n, int64_t per_block, unsigned cap) {
    int64_t b = (n + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return (unsigned)(b < (int64_t)cap ? b : cap);
}

#endif
