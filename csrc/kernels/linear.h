/*
 * Fused linear, forward and backward, and matmul, on the blocked GEMM of gemm.h:
 *     forward:  preact = x weight^T + bias          out = act(preact)
 *     backward: g' = grad * act'(preact)            (grad itself for "none")
 *               dx = g' weight    dweight = g'^T x    dbias = sum_rows g'
 *     matmul:   c = a b    (B, M, K) . (B, K, N) -> (B, M, N), or 2-d
 *               da = grad b^T    db = a^T grad
 * x (..., K) of any strides, weight (N, K) of any strides, bias (N) of any
 * stride; out, preact, dx (M, ...), dweight (N, K) and dbias (N) contiguous,
 * with M the product of x's leading dims. matmul's operands of any strides,
 * its results contiguous. float32 computes in float32; bfloat16 and float16
 * accumulate in float32 and round once; float64 runs the reference
 * (gemm_ref_f64), which is the C tests' oracle and the ops' path for
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
 *   direct: without an activation g' is grad itself: the same two GEMMs read
 *     it in place (dbias its column sums), no g' pass and no scratch.
 *   chunked: g' is made a row chunk (~8 MiB) at a time, for any dtype, strides
 *     and activation, so the scratch is (chunk, N), not (M, N): the peak
 *     memory stays below eager PyTorch's, which materialises the whole
 *     gradient of the pre-activation. An absent preact with an activation (a
 *     forward run without saving it) is recomputed a chunk at a time into the
 *     g' scratch: one more GEMM and no (M, N) tensor kept between the passes.
 *
 * Plans: each entry point runs under a plan made once per call from the
 * problem and the thread count (linear_fwd_plan_make, linear_bwd_plan_make,
 * matmul_fwd_plan_make, matmul_bwd_plan_make): the strategy, the GEMM plan of
 * every product it runs, and the workspace layout. The caller sizes the
 * workspace from the plan (the *_workspace functions) and runs the same plan.
 * Kernels never allocate. Entry points return 0, or LINEAR_ERR_WORKSPACE
 * when the workspace is smaller than the plan (a caller that sized for
 * another problem), or LINEAR_ERR_DECLINED (a claimed plan, below); they
 * never print or fail.
 */
#ifndef OPFORGE_KERNELS_LINEAR_H
#define OPFORGE_KERNELS_LINEAR_H

#include <stdint.h>

#include "gemm.h"
#include "opforge/half.h"

enum { LINEAR_ERR_WORKSPACE = -1, LINEAR_ERR_DECLINED = -2 };

/* A (..., cols) array: element (i_0, ..., i_{ndim-2}, j) at data + sum_d i_d
 * strides[d] + j strides[ndim-1] (elements). sizes and strides are borrowed. */
typedef struct linear_view {
    void *data;
    int64_t ndim;
    const int64_t *sizes, *strides;
} linear_view;

typedef struct linear_problem {
    int64_t n, k;       /* N (out_features), K (in_features); M, the rows, is the product of x's leading dims */
    opf_dtype dt;       /* of every tensor below */
    int act;            /* act_kind */
    linear_view x;      /* (..., K) */
    const void *weight; /* (N, K): weight[o * weight_strides[0] + i * weight_strides[1]] */
    int64_t weight_strides[2];
    const void *bias; /* (N) via bias_stride, or NULL */
    int64_t bias_stride;
    /* forward: out (M, N) contiguous; preact (M, N) contiguous or NULL (not stored) */
    void *out, *preact;
    /* backward: grad (..., N); saved_preact (..., N), data NULL (or numel 0)
     * with an activation: recomputed; dx (M, K), dweight (N, K) contiguous,
     * either NULL when not wanted (its GEMM is skipped); dbias (N)
     * contiguous, or NULL without bias */
    linear_view grad, saved_preact;
    void *dx, *dweight, *dbias;
} linear_problem;

/* Rows per chunk when a row chunk of an (rows, n) float32 scratch is made at
 * a time: ~8 MiB, at least 64 rows, at most all of them. */
int64_t linear_chunk_rows(int64_t rows, int64_t n);

/* A product with results of any float32-computed type, out = act(A B + bias),
 * as the forward, the in-place backward and matmul run it: float32 results
 * and 16-bit ones whose K fits one GEMM slice are written by the GEMM's
 * epilogue in one call; 16-bit results over several slices keep float32
 * partial sums in a C of `chunk` rows at a time. The workspace: the GEMM's
 * (gemm_floats: for the full chunk and the last one, as it is not monotonic
 * in the rows), then C. */
typedef struct linear_gemm_plan {
    opf_dtype dt; /* of A, B and the results */
    int64_t m, n, k, chunk;
    int64_t class_m; /* a claimed plan's: the rows of the products the claim was asked about (its chunk's) */
    int c_scratch;
    int claimed; /* the GEMM provider's (linear_*_plan_claim): one product, no workspace */
    int settled; /* after the claim: whether `claimed` stands (gemm_provider_settled) */
    const gemm_kernels *gemm;
    int64_t threads;
    gemm_plan full, last; /* chunk rows, and the m % chunk rows of the last chunk */
    int64_t gemm_floats, floats;
} linear_gemm_plan;

/* Where a GEMM provider is installed and claims a plan's products (gemm_provider_claims: it runs them
 * on its own GEMM, which writes the results itself), the plan is remade to run each as one product
 * with no workspace (no row chunks, no float32 partial sums, no packing). The *_claim functions do
 * that for the forward, the direct backward (no activation) and matmul; the in-place and chunked
 * backwards keep their plans (the in-place one overwrites the saved pre-activation before its GEMMs).
 * An entry point whose claimed product the provider then declines after all (its mode changed since,
 * or its GEMM failed) returns LINEAR_ERR_DECLINED before any output is final: the caller runs it again
 * under the unclaimed plan. */

/* ---- linear ---- */

/* The forward's plan: the product over one matrix of x's rows, then a
 * float32 copy of the bias in the workspace. float64 needs no workspace. */
typedef struct linear_fwd_plan {
    const gemm_kernels *gemm;
    linear_gemm_plan product;
    int64_t bias, floats;
} linear_fwd_plan;

linear_fwd_plan linear_fwd_plan_make(const gemm_kernels *gemm, const linear_problem *p, int64_t threads);
void linear_fwd_plan_claim(linear_fwd_plan *plan, const linear_problem *p);
int64_t linear_fwd_workspace(const linear_fwd_plan *plan);
int linear_fwd(const linear_fwd_plan *plan, const linear_problem *p, float *ws, int64_t ws_floats);

typedef enum linear_bwd_strategy { LINEAR_BWD_CHUNKED = 0, LINEAR_BWD_IN_PLACE, LINEAR_BWD_DIRECT } linear_bwd_strategy;

/* The backward's plan. The strategy, where grad is a single matrix of unit
 * column stride, the type float32, bfloat16 or float16 and x one matrix or
 * more (one for 16-bit types): without an activation direct; with one in
 * place where the caller donates saved_preact (preact_donated: free to
 * overwrite it), a single contiguous matrix. Else chunked. */
typedef struct linear_bwd_plan {
    const gemm_kernels *gemm;
    linear_bwd_strategy strategy;
    int64_t threads; /* g' and dbias in one threaded pass (act_grad_rows), in place */
    /* in place and direct: dx (M, K, N) and dweight (N, K, rows) over all M rows, or
     * dweight a float32 GEMM per matrix of x (dweight_each); the workspace:
     * the larger GEMM's, then a float32 dbias */
    struct {
        linear_gemm_plan dx, dweight;
        gemm_plan dweight_each;
        int64_t dbias;
    } in_place;
    /* chunked: row chunks of `chunk` rows of each matrix of x; the GEMMs of
     * the full chunk [0] and of the last one [1]: the recomputed preact
     * (rows, N, K), dx rows (rows, K, N), dweight (N, K, rows). The
     * workspace: g' (chunk x N, float32 or float64), the GEMMs', one float32
     * row of grad and of preact (converted or gathered), a float32 bias for
     * the recomputation, and for 16-bit types float32 dx rows, dweight and
     * dbias */
    struct {
        int64_t chunk;
        gemm_plan recompute[2], dx[2], dweight[2];
        int64_t gemm_floats, gemm_ws, grad_row, preact_row, bias, dx32, dweight32, dbias32;
    } chunked;
    int64_t floats;
} linear_bwd_plan;

linear_bwd_plan linear_bwd_plan_make(const gemm_kernels *gemm, const linear_problem *p, int preact_donated,
                                     int64_t threads);
void linear_bwd_plan_claim(linear_bwd_plan *plan, const linear_problem *p);
int64_t linear_bwd_workspace(const linear_bwd_plan *plan);
/* LINEAR_BWD_IN_PLACE overwrites saved_preact with g'. */
int linear_bwd(const linear_bwd_plan *plan, const linear_problem *p, float *ws, int64_t ws_floats);

/* ---- matmul ---- */

/* c (batch, m, n) contiguous = a (batch, m, k) . b (batch, k, n), a and b 3-d
 * views, or 2-d (batch = 1) ones; float64 needs no workspace. */
typedef struct matmul_fwd_plan {
    opf_dtype dt;
    int64_t batch, m, n, k;
    linear_gemm_plan product;
    int64_t floats;
} matmul_fwd_plan;

matmul_fwd_plan matmul_fwd_plan_make(const gemm_kernels *gemm, opf_dtype dt, int64_t batch, int64_t m, int64_t n,
                                     int64_t k, int64_t threads);
/* a and b: the operands' views (their layouts are part of what the provider claims) */
void matmul_fwd_plan_claim(matmul_fwd_plan *plan, const linear_view *a, const linear_view *b);
int64_t matmul_fwd_workspace(const matmul_fwd_plan *plan);
int matmul_fwd(const matmul_fwd_plan *plan, void *c, const linear_view *a, const linear_view *b, float *ws,
               int64_t ws_floats);

/* da (batch, m, k) = grad b^T and db (batch, k, n) = a^T grad, both
 * contiguous, from grad (batch, m, n), a and b as the forward's: two GEMMs
 * per batch that read grad, a and b in place through their strides, in one
 * workspace sized for the larger. da or db NULL: not wanted, its GEMM
 * skipped. */
typedef struct matmul_bwd_plan {
    opf_dtype dt;
    int64_t batch, m, n, k;
    linear_gemm_plan da, db;
    int64_t floats;
} matmul_bwd_plan;

matmul_bwd_plan matmul_bwd_plan_make(const gemm_kernels *gemm, opf_dtype dt, int64_t batch, int64_t m, int64_t n,
                                     int64_t k, int64_t threads);
void matmul_bwd_plan_claim(matmul_bwd_plan *plan, const linear_view *grad, const linear_view *a, const linear_view *b);
int64_t matmul_bwd_workspace(const matmul_bwd_plan *plan);
int matmul_bwd(const matmul_bwd_plan *plan, void *da, void *db, const linear_view *grad, const linear_view *a,
               const linear_view *b, float *ws, int64_t ws_floats);

#endif
