/* The launchers of csrc/cuda/norm.cu: rms_norm (with or without a residual), layer_norm and their
 * backward, over rows of x (..., H) read in place (any strides), outputs contiguous. Formulas and
 * numerics as the CPU kernels' (csrc/kernels/norm.h). */
#ifndef OPFORGE_CUDA_NORM_H
#define OPFORGE_CUDA_NORM_H

#include "opforge/cuda_types.h"
#include "opforge/half.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Threads per block: the fast forward kernels (more where a row needs more threads), the fast
 * backward kernels, and at most, for any of them and for the generic kernels. */
#define NORM_CUDA_FWD_THREADS 256
#define NORM_CUDA_BWD_THREADS 512
#define NORM_CUDA_MAX_THREADS 1024
/* Backward blocks at most when the weight or bias gradient is wanted (2 per multiprocessor of a
 * 132-SM GPU): they bound the workspace of partial sums. */
#define NORM_CUDA_BWD_SLOTS 264

/* One call's operands. Rows r = 0 .. rows-1 in row-major order of the leading dims; row inputs
 * in[k] (NULL: absent) start row r at lead's offset of operand k + 1 and step in_cs[k] along the
 * hidden dim; lead's operand 0 is the contiguous outputs' row index (strides in rows). */
typedef struct norm_cuda_args {
    opf_dtype dt;
    int64_t rows, hidden;
    double eps;
    int offset; /* rms: w' = 1 + w */
    opf_cuda_nd lead;
    /* forward: x, residual; backward: grad, x (the sum for add_rms_norm), grad_sum */
    const void *in[3];
    int64_t in_cs[3];
    const void *w, *b; /* H-vectors, NULL: absent */
    int64_t wcs, bcs;
    void *out, *out2;   /* forward: y, sum (add_rms_norm); backward: dx, dresidual (add_rms_norm) */
    float *mean, *rstd; /* forward: written (rows floats); backward: read (float64 recomputes them) */
    void *dw, *db;      /* backward: the weight / bias gradients (H, contiguous), NULL: not wanted */
    float *ws;          /* backward: norm_cuda_bwd_workspace floats */
} norm_cuda_args;

/* What a launcher ran, for the log line: the main kernel's name, grid and block (grid 0: nothing). */
typedef struct norm_cuda_launch {
    unsigned grid;
    int block;
    const char *kernel;
} norm_cuda_launch;

/* Floats of workspace the backward of a (every field but ws set) needs: slots of H partial sums (two
 * floats each for float64) for dw and for db; 0 without either. */
int64_t norm_cuda_bwd_workspace(const norm_cuda_args *a);

/* in[1] (the residual) given: add_rms_norm, out2 the sum. */
norm_cuda_launch norm_cuda_rms_fwd(const norm_cuda_args *a, void *stream);
/* in[2] (grad_sum) and out2 (dresidual) given: add_rms_norm's backward. */
norm_cuda_launch norm_cuda_rms_bwd(const norm_cuda_args *a, void *stream);
norm_cuda_launch norm_cuda_ln_fwd(const norm_cuda_args *a, void *stream);
norm_cuda_launch norm_cuda_ln_bwd(const norm_cuda_args *a, void *stream);

#ifdef __cplusplus
}
#endif

#endif
