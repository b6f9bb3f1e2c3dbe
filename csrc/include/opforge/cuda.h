/*
 * The C glue of a CUDA op (opforge's own in csrc/cuda/<op>.c, or a user's
 * my_op.c beside my_op.cu): check, take a device guard, get torch's current
 * stream, allocate through torch (opf_empty_like & co. in op.h: torch's
 * caching allocator), call the .cu file's extern "C" launcher, then
 * opf_cuda_done, which turns a launch failure into a RuntimeError naming the
 * op and, at OPFORGE_LOG_LEVEL=info, logs the kernel, its grid and the
 * microseconds it took (CUDA events, recorded only when logging).
 *
 *     OPF_CUDA_CALL(call, FWD, &x);               guard + stream of x's device
 *     opf_check_cuda(FWD, "weight", &w, "x", &x); on x's GPU, or a clear error
 *     const char *e = myop_launch(..., call.stream);
 *     opf_cuda_done(&call, e, "myop_fwd", grid, block, 2, (opf_tensor[]){x, y});
 *
 * Header-only on purpose: the CUDA runtime is linked statically into each
 * library that launches kernels, and a launch's error is seen only by the
 * runtime that launched it, so these calls must live in that library.
 * Nothing here synchronises the stream or allocates outside torch, so an op
 * can be captured in a CUDA graph.
 */
#ifndef OPFORGE_CUDA_H
#define OPFORGE_CUDA_H

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>

#include "opforge/cuda_types.h"
#include "opforge/op.h"

typedef struct opf_cuda_call {
    const char *op;
    int32_t device;
    void *stream; /* torch's current stream of the device: a cudaStream_t */
    DeviceGuardHandle guard;
    cudaEvent_t start, stop; /* at info level only */
    double t0_us;
} opf_cuda_call;

static inline void opf_cuda_call_release_events(opf_cuda_call *c) {
    if (c->start) cudaEventDestroy(c->start);
    if (c->stop) cudaEventDestroy(c->stop);
    c->start = c->stop = NULL;
}

static inline void opf_cuda_call_release(opf_cuda_call *c) {
    opf_cuda_call_release_events(c);
    if (c->guard) aoti_torch_delete_device_guard(c->guard);
    c->guard = NULL;
}

/* torch's current CUDA stream of a device, through libtorch_cuda (which torch has loaded when it has a GPU). */
static inline void *opf_cuda_current_stream(const char *op, int32_t device) {
    static aoti_torch_get_current_cuda_stream_fn get;
    if (!get) {
        void *lib = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
        get = lib ? (aoti_torch_get_current_cuda_stream_fn)dlsym(lib, "aoti_torch_get_current_cuda_stream") : NULL;
        if (!get)
            opf_fail(op, "this torch has no CUDA (libtorch_cuda.so with aoti_torch_get_current_cuda_stream is not "
                         "loaded): install a CUDA build of torch");
    }
    void *stream = NULL;
    if (get(device, &stream) != OPF_AOTI_SUCCESS)
        opf_fail(op, "could not get torch's current stream of cuda:%d", device);
    return stream;
}

/* t on the GPU of ref (ref may be t itself), or a RuntimeError naming both. */
static inline void opf_check_cuda(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                                  const opf_tensor *ref) {
    const int32_t cuda = aoti_torch_device_type_cuda();
    int32_t ti = 0, ri = 0;
    if (t->device_type != cuda)
        opf_fail(op, "argument '%s' must be on a cuda device (this kernel is the CUDA one), got %s", arg,
                 opf_device_name(t->device_type));
    if (ref->device_type != cuda) return; /* ref's own check names it */
    aoti_torch_get_device_index(t->h, &ti);
    aoti_torch_get_device_index(ref->h, &ri);
    if (ti != ri)
        opf_fail(op, "argument '%s' must be on the device of '%s' (cuda:%d), got cuda:%d", arg, ref_arg, ri, ti);
}

/* The operands of an elementwise op (operand 0 the output) as one merged walk for a kernel: dims of
 * size 1 dropped, neighbours contiguous in every operand merged (opf_nd_init). */
static inline void opf_cuda_nd_init(const char *op, opf_cuda_nd *out, int ndim, const int64_t *sizes, int nops,
                                    const int64_t *const *strides) {
    if (opf_cuda_nd_make(out, ndim, sizes, nops, strides) != 0)
        opf_fail(op,
                 "the operands' strides leave more dims that cannot be merged than the CUDA kernel walks (%d): "
                 "pass contiguous tensors",
                 OPF_CUDA_MAX_DIMS);
}

/* Checks t, makes its device current for the call and takes torch's stream there. The runtime's
 * last error is cleared first, so that opf_cuda_done reports this call's launches only (an earlier
 * asynchronous fault can still surface here: the message says so). */
static inline void opf_cuda_begin(opf_cuda_call *c, const char *op, const opf_tensor *t, const char *arg) {
    opf_check_cuda(op, arg, t, arg, t);
    c->op = op;
    if (aoti_torch_get_device_index(t->h, &c->device) != OPF_AOTI_SUCCESS)
        opf_fail(op, "could not read the device of argument '%s'", arg);
    if (aoti_torch_create_device_guard(c->device, &c->guard) != OPF_AOTI_SUCCESS)
        opf_fail(op, "could not make cuda:%d the current device", c->device);
    c->stream = opf_cuda_current_stream(op, c->device);
    (void)cudaGetLastError();
    if (opf_log_enabled(OPF_LOG_INFO)) {
        c->t0_us = opf_now_us();
        /* no events inside a CUDA graph capture: waiting for one there would break the capture */
        enum cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing((cudaStream_t)c->stream, &capturing) == cudaSuccess &&
            capturing == cudaStreamCaptureStatusNone && cudaEventCreate(&c->start) == cudaSuccess) {
            if (cudaEventCreate(&c->stop) != cudaSuccess ||
                cudaEventRecord(c->start, (cudaStream_t)c->stream) != cudaSuccess) {
                opf_cuda_call_release_events(c);
            }
        }
        (void)cudaGetLastError(); /* a failed event call is not the kernel's error */
    }
}

/* An opf_cuda_call released on every path (the guard restores the device, the events are freed). */
#define OPF_CUDA_CALL(var, op, tensor, arg)                                  \
    __attribute__((cleanup(opf_cuda_call_release))) opf_cuda_call var = {0}; \
    opf_cuda_begin(&var, op, tensor, arg)

/* After the launcher: its error (NULL when it launched), else the runtime's last error, as a
 * RuntimeError naming op and kernel; at info level, one line with the kernel, grid, block, tensors
 * and the microseconds between events around it (this waits for the kernel: logging only). */
static inline void opf_cuda_done(opf_cuda_call *c, const char *launch_error, const char *kernel, int64_t grid,
                                 int block, int n, const opf_tensor *tensors) {
    cudaError_t e = cudaGetLastError();
    if (launch_error == NULL && e != cudaSuccess) launch_error = cudaGetErrorString(e);
    if (launch_error)
        opf_fail(c->op,
                 "CUDA kernel %s (grid %lld, block %d) on cuda:%d, or an earlier kernel on that device, failed: %s",
                 kernel, (long long)grid, block, c->device, launch_error);
    if (!opf_log_enabled(OPF_LOG_INFO)) return;
    float ms = -1.0f; /* -1: not timed (inside a graph capture) */
    if (c->start && cudaEventRecord(c->stop, (cudaStream_t)c->stream) == cudaSuccess &&
        cudaEventSynchronize(c->stop) == cudaSuccess)
        cudaEventElapsedTime(&ms, c->start, c->stop);
    (void)cudaGetLastError();
    char args[512];
    opf_tensors_str(args, sizeof args, n, tensors);
    char gpu[48];
    if (ms >= 0)
        snprintf(gpu, sizeof gpu, "%.1fus (gpu)", ms * 1000.0);
    else
        snprintf(gpu, sizeof gpu, "(captured in a CUDA graph: not timed)");
    opf_log(OPF_LOG_INFO, "%s %s device=cuda:%d kernel=%s grid=%lld block=%d %s %.1fus (call)", c->op, args, c->device,
            kernel, (long long)grid, block, gpu, opf_now_us() - c->t0_us);
}

#endif
