/*
 * Device helpers of the kernels that reduce along rows (softmax.cu,
 * cross_entropy.cu): 16-byte packs of a row and their elements, the max that
 * keeps a NaN, the exponential, the online (max, sum of exponentials) pair,
 * the row or line a group of threads starts at, and the split of a row into
 * elements one by one and packs.
 */
#ifndef OPFORGE_CUDA_ROWS_CUH
#define OPFORGE_CUDA_ROWS_CUH

#include <math.h>
#include <string.h>

#include "opforge/cuda_kernel.cuh"

/* 16 bytes of a row as they are in memory (4 floats, 2 doubles, 8 halves), in 32-bit words so that
 * two halves share a register; row_io<T> reads and writes element i as the compute type. */
struct alignas(16) row_pack {
    uint32_t w[4];
};
__device__ __forceinline__ float row_u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
__device__ __forceinline__ uint32_t row_f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
template <class T> struct row_io;
template <> struct row_io<float> {
    static const int V = 4;
    static __device__ __forceinline__ float get(const row_pack &r, int i) { return row_u2f(r.w[i]); }
    static __device__ __forceinline__ void set(row_pack &r, int i, float v) { r.w[i] = row_f2u(v); }
};
template <> struct row_io<double> {
    static const int V = 2;
    static __device__ __forceinline__ double get(const row_pack &r, int i) {
        double d;
        memcpy(&d, &r.w[2 * i], 8);
        return d;
    }
    static __device__ __forceinline__ void set(row_pack &r, int i, double v) { memcpy(&r.w[2 * i], &v, 8); }
};
template <class H> __device__ __forceinline__ uint32_t row_half_bits(H h) {
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}
template <class H> __device__ __forceinline__ H row_bits_half(uint32_t u) {
    const uint16_t b = (uint16_t)u;
    H h;
    memcpy(&h, &b, 2);
    return h;
}
template <class H> __device__ __forceinline__ void row_set_half(row_pack &r, int i, H h) {
    const uint32_t b = row_half_bits(h), w = r.w[i >> 1];
    r.w[i >> 1] = (i & 1) ? (w & 0xffffu) | (b << 16) : (w & 0xffff0000u) | b;
}
template <> struct row_io<__nv_bfloat16> {
    static const int V = 8;
    static __device__ __forceinline__ float get(const row_pack &r, int i) {
        const uint32_t w = r.w[i >> 1];
        return row_u2f((i & 1) ? (w & 0xffff0000u) : (w << 16));
    }
    static __device__ __forceinline__ void set(row_pack &r, int i, float v) {
        row_set_half(r, i, __float2bfloat16_rn(v));
    }
};
template <> struct row_io<__half> {
    static const int V = 8;
    static __device__ __forceinline__ float get(const row_pack &r, int i) {
        const uint32_t w = r.w[i >> 1];
        return __half2float(row_bits_half<__half>((i & 1) ? w >> 16 : w));
    }
    static __device__ __forceinline__ void set(row_pack &r, int i, float v) { row_set_half(r, i, __float2half_rn(v)); }
};

/* exp as the hardware's base-2 exponential of v log2(e): relative error a few 1e-7 where the result
 * matters (near the row's max) */
__device__ __forceinline__ float row_exp(float v) { return exp2f(v * 1.4426950408889634f); }
__device__ __forceinline__ double row_exp(double v) { return exp(v); }

/* Online max m and sum s of exp(v - m). -inf entries add nothing (a row of -inf only keeps s = 0
 * and m = -inf); a +inf makes s NaN (inf - inf), a NaN too, as the reference's sum of
 * exp(v - max). */
template <class A> __device__ __forceinline__ void row_online1(A &m, A &s, A v) {
    if (v > m) {
        s = s * row_exp(m - v) + (v - v + (A)1); /* v - v: NaN for +inf */
        m = v;
    } else if (m != (A)-INFINITY || v != v) {
        s += row_exp(v - m);
    }
}
/* (m, s) and (m2, s2) of two parts as the pair of the whole */
template <class A> __device__ __forceinline__ void row_merge(A &m, A &s, A m2, A s2) {
    const A mn = opf_max(m, m2);
    s = (m == mn ? s : s * row_exp(m - mn)) + (m2 == mn ? s2 : s2 * row_exp(m2 - mn));
    m = mn;
}

/* The first row (or line) of this group, the step between its rows, the thread's rank in the group
 * and the group's size: a warp per row (WARP), or a block. */
template <bool WARP> __device__ __forceinline__ void row_group_first(int64_t &row, int64_t &step, int &tid, int &G) {
    if constexpr (WARP) {
        row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        step = (int64_t)gridDim.x * (blockDim.x >> 5);
        tid = threadIdx.x & 31;
        G = 32;
    } else {
        row = blockIdx.x;
        step = gridDim.x;
        tid = threadIdx.x;
        G = blockDim.x;
    }
}

/* A row's elements [0, head) and [tail0, n) one by one and npk packs in between, when its operands
 * have stride 1 (unit) and lie equally far from a 16-byte boundary (vec); else none in packs. */
struct row_span {
    bool vec;
    int64_t head, npk, tail0;
};
template <class T>
__device__ __forceinline__ row_span row_span_of(const T *a, const T *b, const T *c, int64_t n, bool unit) {
    const int V = row_io<T>::V;
    row_span sp;
    const uintptr_t off = (uintptr_t)a & 15;
    sp.vec = unit && ((uintptr_t)b & 15) == off && ((uintptr_t)c & 15) == off;
    sp.head = sp.vec ? (int64_t)(((16 - off) & 15) / sizeof(T)) : 0;
    if (sp.head > n) sp.head = n;
    sp.npk = sp.vec ? (n - sp.head) / V : 0;
    sp.tail0 = sp.head + sp.npk * V;
    return sp;
}

#endif
