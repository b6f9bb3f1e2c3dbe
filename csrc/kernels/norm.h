/*
 * Normalisation over the last dimension (hidden, H) of x (..., H), rows R = numel / H.
 *
 *   rms_norm:      rstd = 1 / sqrt(mean(x^2) + eps);  y = x * rstd * w'      w' = w, 1 + w (offset), or 1
 *   add_rms_norm:  s = x + residual (rounded to x's dtype);  y = rms_norm(s)
 *   layer_norm:    mean = mean(x); rstd = 1 / sqrt(mean((x - mean)^2) + eps);  y = (x - mean) * rstd * w + b
 *
 * Backward, with xh = (x - mean) * rstd (mean = 0 for RMS), gw = g * w':
 *   rms:    dx = rstd * (gw - xh * mean(gw * xh))                   dw = sum_rows g * xh
 *   add:    ds = rstd * (gw - sh * mean(gw * sh)) + grad_s;  dx = dresidual = ds
 *   layer:  dx = rstd * (gw - mean(gw) - xh * mean(gw * xh))        dw = sum_rows g * xh, db = sum_rows g
 *
 * Numerics: float32, bfloat16 and float16 compute in float32 (16-bit values
 * converted on load, results rounded once); float64 in double. The forward
 * saves rstd (and mean) per row as float32 (R floats), never x-hat. The
 * float64 backward recomputes them in double from x (the float32 copies are
 * only shaped), so that gradcheck sees exact derivatives.
 *
 * Weight and bias gradients are deterministic: rows are cut into fixed blocks
 * (norm_bwd_block_rows: a function of R alone), each block's partial sums go
 * to a workspace slot of its own, and the slots are summed in block order.
 * Thread count changes which thread runs a block, never a bit of the result.
 *
 * Layout: every input is read in place through a norm_mat (a data pointer, the
 * strides of its leading dims and of its hidden dim, any values incl. 0);
 * outputs and the saved rstd / mean are contiguous. Row kernels of the ISA
 * variants vectorise rows whose hidden stride is 1 and hand the others to the
 * reference. Pure functions: no allocation, no threads of their own.
 */
#ifndef OPFORGE_KERNELS_NORM_H
#define OPFORGE_KERNELS_NORM_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

/* ---- one row: what each ISA variant provides ------------------------------------- */

/* y (n), s (n, NULL without a residual), *rstd; x, residual (NULL: rms_norm), w (NULL: none) with their
 * hidden strides. offset: w' = 1 + w. */
typedef void (*norm_rms_fwd_fn)(void *y, void *s, float *rstd, const void *x, int64_t xcs, const void *res, int64_t rcs,
                                const void *w, int64_t wcs, int64_t n, double eps, int offset);
/* dx (n), dres (n, NULL: none), dw += g * xh (n accumulators of the compute type, NULL: none); g, gs (the
 * gradient of s, NULL: none), x (or s), rstd saved by the forward (recomputed for float64), w. */
typedef void (*norm_rms_bwd_fn)(void *dx, void *dres, void *dw, const void *g, int64_t gcs, const void *gs,
                                int64_t gscs, const void *x, int64_t xcs, float rstd, const void *w, int64_t wcs,
                                int64_t n, double eps, int offset);
typedef void (*norm_ln_fwd_fn)(void *y, float *mean, float *rstd, const void *x, int64_t xcs, const void *w,
                               int64_t wcs, const void *b, int64_t bcs, int64_t n, double eps);
/* dw += g * xh, db += g (accumulators of the compute type, NULL: none) */
typedef void (*norm_ln_bwd_fn)(void *dx, void *dw, void *db, const void *g, int64_t gcs, const void *x, int64_t xcs,
                               float mean, float rstd, const void *w, int64_t wcs, int64_t n, double eps);

/* A NULL entry (the ISA variants' float64) runs the reference's. */
typedef struct norm_kernels {
    OPF_VARIANT_HEAD;
    norm_rms_fwd_fn rms_fwd[OPF_DTYPE_COUNT];
    norm_rms_bwd_fn rms_bwd[OPF_DTYPE_COUNT];
    norm_ln_fwd_fn ln_fwd[OPF_DTYPE_COUNT];
    norm_ln_bwd_fn ln_bwd[OPF_DTYPE_COUNT];
} norm_kernels;

extern const norm_kernels norm_kernels_ref;
extern const norm_kernels norm_kernels_avx2;   /* norm_avx2.c */
extern const norm_kernels norm_kernels_avx512; /* norm_avx512.c */
extern const opf_variants norm_variants;

/* Kernels for isa; an ISA this build lacks falls back to the next one below. */
const norm_kernels *norm_kernels_for(opf_isa isa);

/* ---- whole tensors ------------------------------------------------------------------ */

/* The rows of a tensor (..., H): lead sizes shared by every operand of a call. */
typedef struct norm_shape {
    int64_t rows, hidden;
    int nlead; /* ndim - 1 */
    int64_t lead[OPF_MAX_DIMS];
    opf_dtype dt;
    double eps;
    int offset; /* rms: w' = 1 + w */
} norm_shape;

/* An operand (..., H) read in place, or a vector (H) when used as w / b. data NULL: absent. Strides in
 * elements: rs[d] of leading dim d, cs of the hidden dim. */
typedef struct norm_mat {
    const void *data;
    int64_t cs;
    int64_t rs[OPF_MAX_DIMS];
} norm_mat;

/* Elements of hidden per forward task: a task outlasts the pool hand-off. */
#define NORM_GRAIN 16384
/* Backward blocks: at least NORM_BLOCK_MIN rows, at most NORM_MAX_BLOCKS blocks (bounds the workspace). */
#define NORM_BLOCK_MIN 32
#define NORM_MAX_BLOCKS 256

int64_t norm_bwd_block_rows(int64_t rows);
/* Floats of workspace the backward needs: one slot of H accumulators per block for dw and for db (double
 * accumulators, two floats each, for float64); 0 without weight and bias. */
int64_t norm_bwd_workspace(const norm_shape *sh, int has_dw, int has_db);

/* y, s (NULL: rms_norm) and rstd (R floats) are contiguous. */
void norm_rms_fwd(const norm_kernels *k, const norm_shape *sh, void *y, void *s, float *rstd, const norm_mat *x,
                  const norm_mat *res, const norm_mat *w);
/* dx, dres (NULL: rms_norm), dw (H, NULL when w is absent) contiguous; gs->data NULL: no gradient of s. */
void norm_rms_bwd(const norm_kernels *k, const norm_shape *sh, void *dx, void *dres, void *dw, const norm_mat *g,
                  const norm_mat *gs, const norm_mat *x, const float *rstd, const norm_mat *w, float *ws);
void norm_ln_fwd(const norm_kernels *k, const norm_shape *sh, void *y, float *mean, float *rstd, const norm_mat *x,
                 const norm_mat *w, const norm_mat *b);
/* dw / db: NULL where the weight / bias is absent. */
void norm_ln_bwd(const norm_kernels *k, const norm_shape *sh, void *dx, void *dw, void *db, const norm_mat *g,
                 const norm_mat *x, const float *mean, const float *rstd, const norm_mat *w, float *ws);

#endif
