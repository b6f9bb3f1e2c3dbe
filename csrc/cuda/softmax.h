/* The launchers of csrc/cuda/softmax.cu: softmax and log_softmax along one dim and their backwards
 * (formulas in csrc/kernels/softmax.h). The glue plans the lines once (softmax_cuda_plan, the CPU
 * driver's choice of paths) and hands the plan to a launcher, which returns what it launched (grid 0:
 * nothing to do). */
#ifndef OPFORGE_CUDA_SOFTMAX_H
#define OPFORGE_CUDA_SOFTMAX_H

#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The lines of a problem. Row path (lane_path 0): one line per outer index, n elements apart by
 * nstride[k] in operand k (0: the output, 1: the input x or dy, 2: the saved y); a group of threads
 * (a warp, or a block for long rows) per line. Lane path (lane_path 1): the reduced dim is not of
 * stride 1 in every operand but another dim (of `lanes` elements) is: 32 adjacent lanes of it per
 * tile, the reduction strided. `outer` walks the remaining dims (operand k's offsets). */
typedef struct softmax_cuda_lines {
    opf_cuda_nd outer;
    int64_t n, nstride[3];
    int64_t lanes;
    int lane_path;
} softmax_cuda_lines;

/* What a launcher ran: blocks (0: nothing), threads per block and the kernel's name, for the log. */
typedef struct softmax_cuda_launch {
    unsigned grid, block;
    const char *kernel;
} softmax_cuda_launch;

/* Plans an ndim tensor of `sizes` reduced along `dim`, with nops operands' strides (2 forward,
 * 3 backward, in the order above): the row path when dim has stride 1 in every operand (and n > 1),
 * else the lane path over the innermost other dim of stride 1 in every operand, else the row path
 * with strided rows. -1 when the outer dims do not merge into OPF_CUDA_MAX_DIMS. */
int softmax_cuda_plan(softmax_cuda_lines *l, int ndim, int dim, const int64_t *sizes, int nops,
                      const int64_t *const *strides);

softmax_cuda_launch softmax_cuda_fwd(opf_dtype dt, void *y, const void *x, const softmax_cuda_lines *l, int log,
                                     void *stream);
softmax_cuda_launch softmax_cuda_bwd(opf_dtype dt, void *dx, const void *dy, const void *y, const softmax_cuda_lines *l,
                                     int log, void *stream);

#ifdef __cplusplus
}
#endif

#endif
