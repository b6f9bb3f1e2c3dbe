/*
 * What a CUDA op's C glue hands its .cu launcher besides pointers: shared by
 * opforge/cuda.h (C) and opforge/cuda_kernel.cuh (CUDA), so plain C types only.
 */
#ifndef OPFORGE_CUDA_TYPES_H
#define OPFORGE_CUDA_TYPES_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

#define OPF_CUDA_MAX_DIMS 8

/* An elementwise op's operands after opf_nd_init merged their dims (operand 0 the output), passed to a
 * kernel by value: element i's offset in operand k is opf_cuda_offset(nd, k, i). flat = 1 when every
 * operand is one dense run of stride 1 (the kernel then walks plain arrays, vectorised). */
typedef struct opf_cuda_nd {
    int ndim, nops, flat;
    int64_t numel;
    int64_t size[OPF_CUDA_MAX_DIMS]; /* innermost last */
    int64_t stride[OPF_MAX_OPERANDS][OPF_CUDA_MAX_DIMS];
} opf_cuda_nd;

/* The merged walk of an elementwise op's operands (opf_nd_init: dims of size 1 dropped, neighbours
 * contiguous in every operand merged), or -1 when more than OPF_CUDA_MAX_DIMS dims remain or there are more than OPF_MAX_OPERANDS operands. */
static inline int opf_cuda_nd_make(opf_cuda_nd *out, int ndim, const int64_t *sizes, int nops,
                                   const int64_t *const *strides) {
    opf_nd nd;
    if (nops > OPF_MAX_OPERANDS) return -1;
    opf_nd_init(&nd, ndim, sizes, nops, strides);
    if (nd.ndim > OPF_CUDA_MAX_DIMS) return -1;
    out->ndim = nd.ndim;
    out->nops = nops;
    out->numel = nd.numel;
    out->flat = 1;
    for (int d = 0; d < nd.ndim; d++) out->size[d] = nd.size[d];
    for (int k = 0; k < nops; k++)
        for (int d = 0; d < nd.ndim; d++) {
            out->stride[k][d] = nd.stride[k][d];
            if (nd.ndim > 1 || nd.stride[k][d] != 1) out->flat = 0;
        }
    return 0;
}

#endif
