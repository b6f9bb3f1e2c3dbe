/*
 * The CUDA the kernels in csrc/cuda use, run on the CPU: the C tests compile a
 * .cu file as C++ with -DOPF_CUDA_EMULATE and check its kernels against the C
 * references on machines without a GPU (every machine but the lent one).
 *
 * Each thread of a block is a fiber with its own stack (started with ucontext, switched with
 * _setjmp/_longjmp, which save no signal mask: no system call per switch); the blocks
 * of a grid run one after the other. A fiber runs until it waits at a
 * barrier: __syncthreads() waits for every live thread of the block, a warp
 * operation (__shfl_*_sync, __syncwarp) for every live thread of its warp of
 * 32, as on the GPU, so a barrier reached by part of a block only is caught
 * (the run stops, naming it) instead of passing. __shared__ variables are
 * function statics (one block at a time shares them); dynamic shared memory
 * is one buffer per launch. Atomics are plain read-modify-writes: one fiber
 * runs at a time. Memory is the host's: a test passes host pointers.
 *
 * What it does not model: the order of atomics and of a race's writes (a
 * race the barriers do not order is not found here), and the GPU's own
 * arithmetic (__expf and friends are the C library's).
 */
#ifndef OPFORGE_CUDA_EMU_H
#define OPFORGE_CUDA_EMU_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <ucontext.h>

#include <functional>

#include "opforge/half.h"

/* everything below has internal linkage: each .cu file of a test binary has its own scheduler and
 * builtin coordinates */
namespace {

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned x, y, z;
};

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return float2{x, y}; }

/* 16-bit storage types, rounded as the CPU kernels round (csrc/include/opforge/half.h) */
struct __nv_bfloat16 {
    uint16_t x;
};
struct __half {
    uint16_t x;
};
static inline float __bfloat162float(__nv_bfloat16 h) { return opf_bf16_to_f32(h.x); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16{opf_f32_to_bf16(f)}; }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{opf_f32_to_bf16(f)}; }
static inline float __half2float(__half h) { return opf_f16_to_f32(h.x); }
static inline __half __float2half(float f) { return __half{opf_f32_to_f16(f)}; }
static inline __half __float2half_rn(float f) { return __half{opf_f32_to_f16(f)}; }

static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
/* glibc's <math.h> has functions named __expf and __logf of its own: the CUDA intrinsics are macros here */
static inline float opf_emu_expf(float x) { return expf(x); }
static inline float opf_emu_logf(float x) { return logf(x); }
#define __expf opf_emu_expf
#define __logf opf_emu_logf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
template <class T>
static inline T __ldg(const T *p) {
    return *p;
}

static inline float atomicAdd(float *p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
static inline double atomicAdd(double *p, double v) {
    double old = *p;
    *p = old + v;
    return old;
}
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
static inline int atomicAdd(int *p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}

/* ---- the scheduler ------------------------------------------------------------- */

namespace opf_emu {

enum { RUNNING, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
constexpr int WARP = 32;
constexpr size_t STACK = 64 * 1024;

struct Fiber {
    ucontext_t ctx; /* its first start */
    jmp_buf env;    /* where it waits */
    int state, started;
    uint3 tid;
};

struct Launch {
    Fiber *fibers = nullptr;
    char *stacks = nullptr;
    int nthreads = 0, current = 0;
    ucontext_t scheduler;
    jmp_buf scheduler_env;
    const std::function<void()> *body = nullptr;
    const char *name = "";
    /* the warp exchange: each lane's value, read by its partner after a warp barrier */
    double lanes[1024];
};

inline Launch &launch() {
    static Launch l;
    return l;
}

inline void wait(int state) {
    Launch &l = launch();
    Fiber &f = l.fibers[l.current];
    f.state = state;
    if (!_setjmp(f.env)) _longjmp(l.scheduler_env, 1);
}

inline void fiber_main() {
    Launch &l = launch();
    (*l.body)();
    l.fibers[l.current].state = DONE;
    _longjmp(l.scheduler_env, 1); /* never returns: the scheduler goes on from where it resumed this fiber */
}

}  // namespace opf_emu

/* the builtin coordinates, set for the fiber that runs */
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static const int warpSize = opf_emu::WARP;

static inline void __syncthreads(void) { opf_emu::wait(opf_emu::AT_BLOCK_BARRIER); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    opf_emu::wait(opf_emu::AT_WARP_BARRIER);
}
static inline void __threadfence(void) {}

namespace opf_emu {
inline int linear_tid() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

/* lane `src_lane(lane)` of the caller's warp: every live lane writes, waits, reads, waits */
template <class T, class F>
inline T exchange(T v, F src_lane) {
    Launch &l = launch();
    const int me = linear_tid(), base = me / WARP * WARP, lane = me - base;
    l.lanes[me] = 0;
    memcpy(&l.lanes[me], &v, sizeof v);
    __syncwarp();
    int src = src_lane(lane);
    T out = v;
    if (src >= 0 && src < WARP && base + src < l.nthreads) memcpy(&out, &l.lanes[base + src], sizeof out);
    __syncwarp();
    return out;
}
}  // namespace opf_emu

template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)mask;
    return opf_emu::exchange(v, [&](int lane) { return (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)); });
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    return opf_emu::exchange(v, [&](int lane) {
        int in_group = (lane & (width - 1)) + (int)delta;
        return in_group < width ? lane + (int)delta : lane;
    });
}
template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    (void)mask;
    return opf_emu::exchange(v, [&](int lane) { return (lane & ~(width - 1)) + (src & (width - 1)); });
}

namespace opf_emu {

/* Runs body once per thread of every block of the grid, as a launch would. */
inline void run(dim3 grid, dim3 block, size_t dyn_smem, void *&dyn_smem_ptr, const char *name,
                const std::function<void()> &body) {
    Launch &l = launch();
    const int n = (int)(block.x * block.y * block.z);
    if (n < 1 || n > 1024 || grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
        fprintf(stderr, "cuda_emu: launch of %s with grid (%u, %u, %u) block (%u, %u, %u): invalid configuration\n",
                name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        abort();
    }
    l.fibers = new Fiber[n];
    l.stacks = (char *)malloc(STACK * (size_t)n);
    l.nthreads = n;
    l.body = &body;
    l.name = name;
    dyn_smem_ptr = dyn_smem ? calloc(1, dyn_smem) : nullptr;
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = uint3{bx, by, bz};
                for (int t = 0; t < n; t++) {
                    Fiber &f = l.fibers[t];
                    f.tid = uint3{(unsigned)t % block.x, (unsigned)t / block.x % block.y,
                                  (unsigned)t / (block.x * block.y)};
                    f.state = RUNNING;
                    f.started = 0;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = l.stacks + STACK * (size_t)t;
                    f.ctx.uc_stack.ss_size = STACK;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, (void (*)())fiber_main, 0);
                }
                for (;;) {
                    int live = 0;
                    for (int t = 0; t < n; t++) {
                        if (l.fibers[t].state != RUNNING) continue;
                        l.current = t;
                        threadIdx = l.fibers[t].tid;
                        Fiber &f = l.fibers[t];
                        if (!_setjmp(l.scheduler_env)) {
                            if (f.started) _longjmp(f.env, 1);
                            f.started = 1;
                            swapcontext(&l.scheduler, &f.ctx); /* runs until its first wait or its end */
                        }
                    }
                    /* nobody runs: release a warp whose live lanes all wait at a warp barrier, else the
                     * block when every live thread waits at __syncthreads */
                    int released = 0, at_block = 0, at_warp = 0;
                    for (int w = 0; w * WARP < n; w++) {
                        int waiting = 0, alive = 0;
                        for (int t = w * WARP; t < n && t < (w + 1) * WARP; t++) {
                            alive += l.fibers[t].state != DONE;
                            waiting += l.fibers[t].state == AT_WARP_BARRIER;
                        }
                        const int lanes = (w + 1) * WARP <= n ? WARP : n - w * WARP;
                        if (alive && waiting == alive && alive != lanes) {
                            /* a full-mask shuffle or __syncwarp with lanes that returned: undefined in CUDA */
                            fprintf(stderr,
                                    "cuda_emu: %s, block (%u, %u, %u): warp %d: %d lanes at a warp operation after "
                                    "%d returned\n",
                                    name, bx, by, bz, w, alive, lanes - alive);
                            abort();
                        }
                        if (alive && waiting == alive) {
                            for (int t = w * WARP; t < n && t < (w + 1) * WARP; t++) l.fibers[t].state = RUNNING;
                            released = 1;
                        }
                    }
                    if (released) continue;
                    for (int t = 0; t < n; t++) {
                        live += l.fibers[t].state != DONE;
                        at_block += l.fibers[t].state == AT_BLOCK_BARRIER;
                        at_warp += l.fibers[t].state == AT_WARP_BARRIER;
                    }
                    if (live == 0) break;
                    if (at_block == live) {
                        /* CUDA leaves a barrier after some threads returned undefined (what they would have
                         * written before it, e.g. a warp's partial sum, is missing): refused here */
                        if (live != n) {
                            fprintf(stderr,
                                    "cuda_emu: %s, block (%u, %u, %u): %d threads wait at __syncthreads after %d "
                                    "returned: a barrier reached by part of a block\n",
                                    name, bx, by, bz, at_block, n - live);
                            abort();
                        }
                        for (int t = 0; t < n; t++)
                            if (l.fibers[t].state == AT_BLOCK_BARRIER) l.fibers[t].state = RUNNING;
                        continue;
                    }
                    fprintf(stderr,
                            "cuda_emu: %s, block (%u, %u, %u): %d threads wait at __syncthreads and %d at a warp "
                            "operation whose warp has lanes elsewhere: a barrier reached by part of a block or warp\n",
                            name, bx, by, bz, at_block, at_warp);
                    abort();
                }
            }
    free(dyn_smem_ptr);
    dyn_smem_ptr = nullptr;
    free(l.stacks);
    delete[] l.fibers;
    l.fibers = nullptr;
}

inline void *&dyn_smem() {
    static void *p;
    return p;
}

}  // namespace opf_emu

}  // namespace

typedef void *cudaStream_t;

/* OPF_LAUNCH(kernel, grid, block, dynamic shared bytes, stream, args...) */
#define OPF_LAUNCH(kernel, grid, block, smem, stream, ...)                                   \
    do {                                                                                     \
        (void)(stream);                                                                      \
        opf_emu::run((grid), (block), (smem), opf_emu::dyn_smem(), #kernel,                  \
                     [&]() { kernel(__VA_ARGS__); });                                        \
    } while (0)
#define OPF_DYNAMIC_SHARED(type, name) type *name = (type *)opf_emu::dyn_smem()

#endif
