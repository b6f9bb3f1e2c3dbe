/* The launchers of csrc/cuda/dispersion_correction.cu: operands as one merged walk (opf_cuda_nd,
 * operand 0 the output); each returns the blocks it launched (0: nothing to do). */
#ifndef OPFORGE_CUDA_DISPERSION_CORRECTION_H
#define OPFORGE_CUDA_DISPERSION_CORRECTION_H

#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DISPERSION_CORRECTION_CUDA_THREADS 256

unsigned dispersion_correction_cuda_fwd(opf_dtype dt, void *y, const void *x, const opf_cuda_nd *nd, double alpha,
                                        void *stream);
unsigned dispersion_correction_cuda_bwd(opf_dtype dt, void *dx, const void *g, const void *x, const opf_cuda_nd *nd,
                                        double alpha, void *stream);

#ifdef __cplusplus
}
#endif

#endif
