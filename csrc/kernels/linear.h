/*
 * Fused linear, forward and backward, on the blocked GEMM of gemm.h:
 *     forward:  preact = x weight^T + bias          out = act(preact)
 *     backward: g' = grad * act'(preact)            (grad itself for "none")
 *               dx = g' weight    dweight = g'^T x    dbias = sum_rows g'
 * x (..., K) of any strides, weight (N, K) of any strides, bias (N) of any
 * stride; out, preact, dx (M, ...), dweight (N, K) and dbias (N) contiguous,
 * with M the product of x's leading dims. float32 computes in float32;
 * bfloat16 and float16 accumulate in float32 and round once; float64 runs the
 * reference (gemm_ref_f64), which is the C tests' oracle and the op's path for
 * gradcheck.
 *
 * x's leading dims are merged into one row dim where their strides allow
 * (contiguous, row slices, broadcast); the ones that do not merge are looped
 * over as separate matrices.
 *
 * Backward strategies:
 *   in place: g' overwrites a preact its caller donates, in one threaded pass
 *     that also sums dbias; then dx and dweight are one GEMM each over all M
 *     rows (no g' scratch, and dweight's sum over M stays in the GEMM's
 *     registers instead of being re-read and re-written per row chunk).
 *   chunked: g' is made a row chunk (~8 MiB) at a time, for any dtype, strides
 *     and activation, so the scratch is (chunk, N), not (M, N): the peak
 *     memory stays below eager PyTorch's, which materialises the whole
 *     gradient of the pre-activation. An absent preact with an activation (a
 *     forward run without saving it) is recomputed a chunk at a time into the
 *     g' scratch: one more GEMM and no (M, N) tensor kept between the passes.
 *
 * Kernels never allocate: each entry point has a workspace function, and its
 * size and the carving of it come from one layout per plan. Entry points
 * return 0, or LINEAR_ERR_WORKSPACE when the workspace is smaller than the
 * plan (a caller that sized for another problem); they never print or fail.
 */
#ifndef OPFORGE_KERNELS_LINEAR_H
#define OPFORGE_KERNELS_LINEAR_H

#include <stdint.h>

#include "gemm.h"
#include "opforge/half.h"

enum { LINEAR_ERR_WORKSPACE = -1 };

/* A (..., cols) array: element (i_0, ..., i_{ndim-2}, j) at data + sum_d i_d
 * strides[d] + j strides[ndim-1] (elements). sizes and strides are borrowed. */
typedef struct linear_view {
    void *data;
    int64_t ndim;
    const int64_t *sizes, *strides;
} linear_view;

typedef struct linear_problem {
    int64_t m, in_features, out_features; /* M rows (x's leading dims), K, N */
    opf_dtype dt;                         /* of every tensor below */
    int act;                              /* act_kind */
    linear_view x;                        /* (..., K) */
    const void *weight;                   /* (N, K): weight[o * weight_strides[0] + i * weight_strides[1]] */
    int64_t weight_strides[2];
    const void *bias; /* (N) via bias_stride, or NULL */
    int64_t bias_stride;
    /* forward: out (M, N) contiguous; preact (M, N) contiguous or NULL (not stored) */
    void *out, *preact;
    /* backward: grad (..., N); saved_preact (..., N), data NULL (or numel 0)
     * with an activation: recomputed; dx (M, K), dweight (N, K) contiguous;
     * dbias (N) contiguous, or NULL without bias */
    linear_view grad, saved_preact;
    void *dx, *dweight, *dbias;
} linear_problem;

typedef enum linear_bwd_strategy { LINEAR_BWD_CHUNKED = 0, LINEAR_BWD_IN_PLACE } linear_bwd_strategy;

/* Floats of workspace linear_fwd needs (0 for float64). */
int64_t linear_fwd_workspace(const gemm_kernels *gemm, const linear_problem *p);
int linear_fwd(const gemm_kernels *gemm, const linear_problem *p, float *ws, int64_t ws_floats);

/* The strategy of the backward: in place where the caller donates saved_preact
 * (preact_donated: free to overwrite it) and the problem allows it (float32,
 * bfloat16 or float16, an activation, a stored preact and grad that are single
 * matrices of unit column stride, preact contiguous, x one matrix or more (one
 * for 16-bit types)), else chunked. */
linear_bwd_strategy linear_bwd_plan(const linear_problem *p, int preact_donated);
int64_t linear_bwd_workspace(const gemm_kernels *gemm, const linear_problem *p, linear_bwd_strategy strategy);
/* LINEAR_BWD_IN_PLACE overwrites saved_preact with g'. */
int linear_bwd(const gemm_kernels *gemm, const linear_problem *p, linear_bwd_strategy strategy, float *ws,
               int64_t ws_floats);

/* Rows per chunk when a row chunk of an (rows, n) float32 scratch is made at
 * a time: ~8 MiB, at least 64 rows, at most all of them. */
int64_t linear_chunk_rows(int64_t rows, int64_t n);

/* A product with results of any float32-computed type, out = act(A B + bias),
 * as the linear ops and matmul run it: float32 results and 16-bit ones whose
 * K fits one GEMM slice are written by the GEMM's epilogue in one call; 16-bit
 * results over several slices keep float32 partial sums in a C of `chunk`
 * rows at a time. gemm_floats: the GEMM's workspace, for the full chunk and
 * the last one (it is not monotonic in the rows); ws_floats: that and the C. */
typedef struct linear_gemm_plan {
    int64_t chunk, gemm_floats, ws_floats;
    int c_scratch;
} linear_gemm_plan;

linear_gemm_plan linear_gemm_plan_for(const gemm_kernels *gemm, opf_dtype dt, int64_t m, int64_t n, int64_t kdim);
/* out (m, n; row stride n) = act(A (m, kdim) B (kdim, n) + bias), its
 * pre-activation to pre when not NULL, both of type dt (A and B of the same
 * type; float32 bias or NULL). ws: plan->ws_floats floats. */
int linear_gemm(const gemm_kernels *gemm, const linear_gemm_plan *plan, int64_t m, int64_t n, int64_t kdim,
                const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb, int64_t csb, void *out, void *pre,
                opf_dtype dt, const float *bias, int act, float *ws);

#endif
