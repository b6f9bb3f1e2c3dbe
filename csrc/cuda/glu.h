/* The launchers of csrc/cuda/glu.cu: operands as one merged walk (opf_cuda_nd; forward: 0 = out,
 * 1 = gate, 2 = up; backward: 0 = dgate and dup (one set of strides), 1 = grad, 2 = gate, 3 = up);
 * act is an act_kind of csrc/kernels/act.h (ACT_GELU, ACT_GELU_TANH, ACT_SILU). Each returns the
 * blocks it launched (0: nothing to do). */
#ifndef OPFORGE_CUDA_GLU_H
#define OPFORGE_CUDA_GLU_H

#include "../kernels/act.h"
#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GLU_CUDA_THREADS 256

/* Which kernel a launch with these operands takes: 1 when every operand's innermost dim is a
 * unit-stride run starting 16-byte aligned (the vector kernel), 0 for the scalar one. */
int glu_cuda_vector(opf_dtype dt, const opf_cuda_nd *nd, const void *const *ptrs, int nptrs);

unsigned glu_cuda_fwd(opf_dtype dt, void *out, const void *gate, const void *up, const opf_cuda_nd *nd, int act,
                      void *stream);
unsigned glu_cuda_bwd(opf_dtype dt, void *dgate, void *dup, const void *grad, const void *gate, const void *up,
                      const opf_cuda_nd *nd, int act, void *stream);

#ifdef __cplusplus
}
#endif

#endif
