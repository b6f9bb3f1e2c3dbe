/*
 * GEMM, float32, BLIS-style:
 *     C (M,N) = act( alpha * A (M,K) . B (K,N) + beta * C + bias )
 * A(i,k) = a[i*rsa + k*csa] and B(k,j) = b[k*rsb + j*csb]: any strides, so a
 * transposed operand is read in place (packing reorders it). C(i,j) =
 * c[i*rsc + j] (unit column stride). beta = 0 never reads C; alpha is 1
 * unless the epilogue points at one.
 *
 * Blocking: for each NC-wide panel of B and KC-deep slice of K, B is packed
 * into NR-wide slivers and A into MR-tall slivers (zero padded), then an
 * MR x NR micro-kernel sweeps the panel. Bias, activation and the optional
 * pre-activation store run in the micro-kernel on the last K slice, while the
 * tile is in registers. Block sizes per ISA live in the gemm_kernels tables.
 *
 * Skinny products (up to GEMM_SKINNY_M rows of A, B read along K: a linear's
 * weight as nn.Linear stores it, at decoding's few tokens) skip the packing:
 * A's rows are converted once, and each output is a dot product streamed from
 * B's row (gemm_skinny_fn), the weight read once from memory; where the
 * blocked kernels pack B first, that costs as much as the product. On Zen 4
 * (2 threads) against torch's F.linear: float32 2-7x at 1-16 tokens, bfloat16
 * 1.1-2.6x (benchmarks/results/linear_decode.md).
 *
 * A product runs under a plan made once per call (gemm_plan_make): the table
 * whose micro-kernel multiplies, the blocking over the thread count the
 * caller read once, and the workspace that blocking carves. The caller sizes
 * the workspace from that plan (gemm_workspace) and runs the same plan
 * (gemm_run): sizing and running cannot disagree on the thread count.
 * Kernels never allocate or start threads: threads come from
 * opf_parallel_for.
 *
 * Files by job, as BLIS separates them: gemm_ref.c (the oracles, the scalar
 * epilogue and micro-kernel, the reference table), gemm_pack.c (packing),
 * gemm.c (plan, workspace layout, driver), gemm_<isa>.c (micro-kernels and
 * their tables). Activations are act.h's, dtype conversions convert.h's.
 */
#ifndef OPFORGE_KERNELS_GEMM_H
#define OPFORGE_KERNELS_GEMM_H

#include <stdint.h>

#include "act.h"
#include "convert.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

typedef enum gemm_bias_kind {
    GEMM_BIAS_NONE = 0,
    GEMM_BIAS_ROW, /* bias[j], added to every row of C (nn.Linear) */
    GEMM_BIAS_COL  /* bias[i], added to every column */
} gemm_bias_kind;

typedef struct gemm_epilogue {
    float beta;
    const float *alpha; /* the product's factor; NULL: 1 (a zeroed epilogue multiplies by 1) */
    const float *bias;
    gemm_bias_kind bias_kind;
    act_kind act;
    float *preact; /* optional (M,N), row stride rsp: the value before the activation */
    int64_t rsp;
    /* 16-bit results: with out16 set, the last K slice writes act(v) to out16
     * (row stride rsc) and v to pre16 (row stride rsp; optional), rounded to
     * out_dt (OPF_BF16 / OPF_F16), instead of to C and preact. C then only
     * holds the partial sums of earlier K slices, and may be NULL when K fits
     * one slice (k <= gemm_slice_depth). beta must be 0. */
    void *out16, *pre16;
    opf_dtype out_dt;
} gemm_epilogue;

/* What one micro-kernel call finishes: C tile (m <= MR rows, n <= NR cols).
 * acc is first multiplied by *alpha where alpha is set (every K slice: each
 * adds its share). load_c: C = beta * C + acc, else C = acc. On the last K slice also bias
 * (bias_n: per column, bias_m: per row; already offset to the tile), the
 * activation, and the pre-activation store (pre, rsp). With c16 the result
 * goes to c16 (row stride rsc) and the pre-activation to pre16 (rsp), both
 * rounded to dt16; C is then read only when load_c. */
typedef struct gemm_tile {
    int load_c;
    float beta;
    const float *alpha;
    const float *bias_n, *bias_m;
    act_kind act;
    float *pre;
    int64_t rsp;
    uint16_t *c16, *pre16;
    opf_dtype dt16;
} gemm_tile;

/* acc = Ap (MR x depth, packed column by column) . Bp (depth x NR, packed row by row) */
typedef void (*gemm_ukernel_fn)(int64_t depth, const float *ap, const float *bp, float *c, int64_t rsc, int m, int n,
                                const gemm_tile *t);

/* The bfloat16 pair micro-kernel: the same tile from kp K pairs. A pair is
 * one 32-bit word holding two bfloat16 values, k = 2p in the low half and
 * 2p + 1 in the high half: Ap[p*MR + r] pairs A(r, 2p), A(r, 2p+1) and
 * Bp[p*NR + j] pairs B(2p, j), B(2p+1, j). Products are exact in float32 and
 * summed in float32 (the AVX512-BF16 dot product; it flushes denormals). */
typedef void (*gemm_ukernel_pairs_fn)(int64_t kp, const uint32_t *ap, const uint32_t *bp, float *c, int64_t rsc, int m,
                                      int n, const gemm_tile *t);

/* The pair micro-kernel over a strip of `count` A slivers (packed one after another, MR * kp pairs
 * apart; rows m in all, the last sliver may be short) against one B sliver: C tile s at c + s * MR * rsc
 * (c NULL: each tile's c16 alone), with tiles[s]'s epilogue; the same sums, bit for bit, as the pair
 * kernel sliver by sliver. (AMX: the products of the whole strip before any epilogue.) */
typedef void (*gemm_ukernel_strip_fn)(int64_t kp, const uint32_t *ap, int count, int64_t m, const uint32_t *bp,
                                      float *c, int64_t rsc, int n, const gemm_tile *tiles);
enum { GEMM_STRIP_MAX = 8 }; /* A slivers of one strip call, at most */

/* The skinny product: few rows of A against a B read along K (a linear's weight, rows of K contiguous
 * elements), as dot products streamed from memory without packing B (decoding's products: a few tokens
 * against a weight read once, where the blocked kernels' packing of B costs as much as the product):
 * out(i, j) = sum_kk a[i * k + kk] * B(kk, j) for i < m <= GEMM_SKINNY_M and j in [j0, j1), where
 * B(kk, j) = b[j * ldb + kk] is float32 or bfloat16 (b16); a is float32, rows of k. Each sum in a fixed
 * order whatever the columns' split: the same bits at any thread count. */
typedef void (*gemm_skinny_fn)(int64_t m, int64_t k, const float *a, const void *b, int b16, int64_t ldb, int64_t j0,
                               int64_t j1, float *out, int64_t ldo);
enum { GEMM_SKINNY_M = 16 }; /* rows of A, at most, of a skinny product */
/* A skinny kernel's loops (with m, j0, j1, out and ldo in scope): the column groups of [j0, j1), CN
 * columns each (j the first, cn how many), each against the rows of A four at a time (the group's B
 * rows stay in L1 across them): BLOCK(R, ai, oi) runs one block of R rows from A's row ai = a_row(i)
 * into oi = out + i * ldo, R a constant in each of its four instantiations. */
#define GEMM_SKINNY_ROWS(CN, BLOCK, a_row)               \
    for (int64_t j = j0; j < j1; j += CN) {              \
        const int cn = j1 - j < CN ? (int)(j1 - j) : CN; \
        for (int64_t i = 0; i < m; i += 4) {             \
            float *oi = out + i * ldo;                   \
            switch (m - i < 4 ? m - i : 4) {             \
            case 1: BLOCK(1, a_row(i), oi); break;       \
            case 2: BLOCK(2, a_row(i), oi); break;       \
            case 3: BLOCK(3, a_row(i), oi); break;       \
            default: BLOCK(4, a_row(i), oi); break;      \
            }                                            \
        }                                                \
    }
/* The same product on bfloat16 pairs (a plan that multiplies pairs, B bfloat16): a16 rows of k bfloat16
 * (row stride lda, even), B(kk, j) = b[j * ldb + kk]; consecutive elements of a row are the pairs, each
 * pair's two products exact in float32 and summed in float32, as the pair micro-kernel sums them */
typedef void (*gemm_skinny_pairs_fn)(int64_t m, int64_t k, const uint16_t *a16, int64_t lda, const uint16_t *b,
                                     int64_t ldb, int64_t j0, int64_t j1, float *out, int64_t ldo);

typedef struct gemm_kernels {
    OPF_VARIANT_HEAD;   /* "ref_4x4", "avx2_6x16", "avx512_12x32", "avx512bf16_12x32", "amx_32x32" */
    int mr, nr;         /* register block (of the pair kernel, where `f32` is set) */
    int64_t mc, kc, nc; /* cache blocks: A block MC x KC in L2, B panel KC x NC in L3 */
    gemm_ukernel_fn ukernel;
    gemm_ukernel_pairs_fn ukernel_pairs; /* NULL: bfloat16 operands are converted to float32 */
    gemm_ukernel_strip_fn ukernel_strip; /* the pair kernel over a strip of A slivers; NULL: one at a time */
    /* The conversions of the same ISA (16-bit operands are converted while
     * packed), and the activations whose derivatives match this epilogue's
     * activations (the linear backward takes them from here) */
    const convert_kernels *cvt;
    const act_kernels *act;
    /* Tile layout of the pair kernel (AMX): 0, or the pairs of one tile row
     * (16). Then A slivers are packed a tile at a time, row-major:
     * Ap[(p / tile_pairs) * MR * tile_pairs + r * tile_pairs + p % tile_pairs]
     * pairs A(r, 2p), A(r, 2p+1); B keeps the layout above; and the packed
     * depth of both is padded with zero pairs to a multiple of tile_pairs. */
    int tile_pairs;
    /* The table products that are not multiplied as pairs run on, and the
     * one the log names for them: a pair kernel's table names an ISA (AMX,
     * AVX512-BF16) that the float32 kernel does not use, and AMX's MR / NR
     * are not the float32 kernel's; NULL: this one */
    const struct gemm_kernels *f32;
    /* Called by each worker after its micro-kernel calls of a pass (AMX:
     * releases the tiles); NULL: nothing to do */
    void (*release)(void);
    /* The micro-kernel's epilogue alone, from a full MR x NR accumulator of
     * row stride NR: the same operations, tile for tile, as the micro-kernel
     * finishes a tile with (K slices run at once are added onto C through it,
     * bit for bit as one after another; gemm_finish runs the float32 table's
     * on a product another GEMM made); NULL: the scalar gemm_tile_store, which
     * the micro-kernel then finishes with too */
    void (*store)(const float *acc, float *c, int64_t rsc, int m, int n, const gemm_tile *t);
    /* The skinny product (gemm_skinny_fn); NULL: every product runs blocked. skinny_pairs: the product of
     * a plan on pairs with a bfloat16 B (gemm_skinny_pairs_fn); NULL: such plans run blocked. A pair
     * table sets skinny_pairs alone: its other products are planned on its `f32` table, and run that
     * table's skinny product */
    gemm_skinny_fn skinny;
    gemm_skinny_pairs_fn skinny_pairs;
    /* the names the log gives those two paths (the table's own name where NULL) */
    const char *skinny_name, *skinny_pairs_name;
} gemm_kernels;

extern const gemm_kernels gemm_kernels_ref;
extern const gemm_kernels gemm_kernels_avx2;        /* gemm_avx2.c */
extern const gemm_kernels gemm_kernels_avx512;      /* gemm_avx512.c */
extern const gemm_kernels gemm_kernels_avx512_bf16; /* gemm_avx512.c: the pair kernel, else avx512 */
extern const gemm_kernels gemm_kernels_amx;         /* gemm_amx.c: AMX-BF16 tiles for pairs, else avx512 */
extern const opf_variants gemm_variants;

/* The table for isa (opf_variant_best). It notes no pick for the log: at
 * OPFORGE_LOG_LEVEL=info gemm_run notes the table whose micro-kernel runs
 * for its operand types (the pair table or its `f32` one), and gemm_ref_f64
 * notes "ref_f64", so that a call's log line names the kernel that ran. */
const gemm_kernels *gemm_kernels_for(opf_isa isa);

/* The K depth one slice covers for these operand types: a product with
 * k <= this and 16-bit results (gemm_epilogue.out16) needs no float32 C. */
int64_t gemm_slice_depth(const gemm_kernels *kern, opf_dtype ta, opf_dtype tb);

/* How one M x N x K product with operands of types ta and tb is split at a
 * thread count: MC-row blocks (at most the ISA's MC, as many as a multiple
 * of the threads so each thread gets equal ones), and whether each worker
 * packs its own blocks of A (enough blocks for every thread: the block stays
 * in that core's L2, and the workspace holds one block per worker) or A is
 * packed whole and shared by all (few, short blocks: gemm_col_chunks); then where
 * the packed operands go: A's region (the whole of A, or one block per
 * worker) at the start, then one KC x NC panel of B. The one statement of
 * the workspace a product carves. Not monotonic in M: a caller that runs a
 * product in row chunks makes a plan for each chunk length it runs (the full
 * chunk and the last, shorter one) and sizes for the larger. */
typedef struct gemm_plan {
    const gemm_kernels *kern; /* the table whose micro-kernel runs: a pair table or its `f32` one */
    int64_t m, n, k;
    opf_dtype ta, tb;
    int pairs;                /* packed as bfloat16 pairs for kern->ukernel_pairs */
    int64_t threads;          /* the thread count the plan is for */
    int64_t mc;               /* rows of the largest block */
    int64_t slivers, mblocks; /* block b: MR-row slivers [slivers * b / mblocks, slivers * (b + 1) / mblocks),
                                 the blocks workers pack with own_a (shared A: only what decided own_a) */
    int64_t workers, kc_max;
    int own_a;
    int64_t b_offset, floats; /* workspace: B's panel at b_offset; floats in all (0: nothing to pack) */
    /* m <= GEMM_SKINNY_M on a table with a skinny kernel (the pair form for a plan on pairs, B bfloat16;
     * else B float32 or bfloat16):
     * a B of unit stride along K runs the skinny product (A converted to float32 rows, or bfloat16 rows for
     * skinny_pairs, then the products, into C or scratch finished by gemm_finish: m * (k + n) + k floats,
     * within `floats`), any other blocked */
    int skinny;
    /* K slices run at once (chosen in gemm_plan_make), 1: one after another. A shared A whose pass has fewer than
     * GEMM_KSPLIT_TILES tiles a thread (few rows and columns, deep K) leaves threads idle slice after
     * slice; then ksplit slices of a panel are packed, multiplied into scratch of their own (each tile's
     * sum over its slice, from zero, as a micro-kernel call makes it) and added onto C in slice order
     * through the epilogue each slice would have had: the same operations in the same order as one slice
     * after another, so the same bits on any thread count. ksplit is the least count that leaves the
     * busiest worker the fewest tiles, within GEMM_KSPLIT_MAX slices and GEMM_KSPLIT_FLOATS of
     * workspace; slices beyond it run in further rounds. The workspace then holds, slice by slice of a
     * round, its A packed whole and its B panel, then the slices' partial sums (m x the panel each). */
    int64_t ksplit;
} gemm_plan;

gemm_plan gemm_plan_make(const gemm_kernels *kern, int64_t m, int64_t n, int64_t k, opf_dtype ta, opf_dtype tb,
                         int64_t threads);
/* The column chunks a panel of nslivers NR-wide slivers is cut into when A is shared (1 when each
 * worker packs its own A blocks). A pass's units are a row sliver by a chunk, dealt to the threads in
 * contiguous runs (chunk by chunk, rows in order), so a worker runs at most one unit more than another:
 * of the chunk counts that divide nslivers (units of equal work), those within GEMM_IDLE_SLACK of the
 * least idle share, and of them the one whose runs read the least packed A and B per tile (wide chunks
 * reuse a row's A sliver, long runs of rows a chunk's B slivers). 2048 x 512 at 64 threads: 171 row
 * slivers x 4 chunks of 4 slivers, 10.7 units per thread, 3% idle, where row blocks of 2 or 3 slivers x
 * 2 chunks left 11%. */
#define GEMM_IDLE_SLACK 0.03
int64_t gemm_col_chunks(const gemm_plan *plan, int64_t nslivers);
/* A pass's units, as the driver deals them: each worker packs its own A blocks (plan->own_a): the row
 * blocks; else row slivers x ntn column chunks, chunk by chunk and rows in order within a chunk. Worker w
 * of gemm_pass_workers runs units [units * w / workers, units * (w + 1) / workers). */
int64_t gemm_pass_units(const gemm_plan *plan, int64_t ntn);
int64_t gemm_pass_workers(const gemm_plan *plan, int64_t ntn);
/* The most MR x NR tiles one worker runs in a pass over a panel of nslivers B slivers in ntn chunks
 * (the plan table's idle share: 1 - slivers x nslivers / (threads x this)) */
int64_t gemm_pass_most_tiles(const gemm_plan *plan, int64_t nslivers, int64_t ntn);
/* Slivers (w rows of kp packed words each: MR for A, NR for B) per packing task of a K slice: ~32 KiB
 * written at least, so a slice of a few deep slivers is still packed by as many threads as it has
 * slivers (a pass packs B before any thread multiplies it; one thread packing it all idles the rest). */
int64_t gemm_pack_grain(int w, int64_t kp);
/* K runs each B sliver's packing is cut into: 1 where the panel has a sliver for every thread; else as
 * many as leave no thread without one, each at least GEMM_PACK_PART_MIN bytes written (a 512-wide panel
 * is 16 slivers: 64 threads packed it 16 at a time, 48 waiting) */
enum { GEMM_PACK_PART_MIN = 16384 };
int64_t gemm_pack_b_parts(const gemm_plan *plan, int64_t nslivers, int64_t kp);
/* The packed words per sliver row of a K slice `depth` deep: depth floats, or on pairs its pairs, padded
 * to whole tiles where the pair kernel works in tiles (tile_pairs) */
int64_t gemm_slice_kp(const gemm_plan *plan, int64_t depth);

/* A pass runs K slices at once where its panel has fewer MR x NR tiles than this many a thread */
enum { GEMM_KSPLIT_TILES = 4 };
/* The most floats of workspace a plan takes for slices run at once (packed A and B and the partial sums
 * of each): 16 MiB */
enum { GEMM_KSPLIT_FLOATS = 1 << 22 };
/* K slices one round runs at once, at most */
enum { GEMM_KSPLIT_MAX = 64 };

/* Floats of workspace the plan's product needs. */
int64_t gemm_workspace(const gemm_plan *plan);

/* C (plan->m, plan->n) = act(A B + beta C + bias): A and B of the plan's
 * types (float32, bfloat16 or float16); C stays float32 and the product
 * accumulates in float32. With a pair kernel (kern->ukernel_pairs) and a
 * bfloat16 operand whose partner is bfloat16 or float32, both are packed as
 * bfloat16 pairs (a float32 partner rounded to nearest even, as PyTorch
 * rounds a bfloat16 op's intermediate results) and multiplied by the pair
 * kernel. Otherwise both are converted to float32 while packed. Returns 0,
 * or -1 without touching anything when ws_floats is smaller than the plan
 * needs (a caller that sized for another product). */
int gemm_run(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb, int64_t csb,
             float *c, int64_t rsc, const gemm_epilogue *ep, float *workspace, int64_t ws_floats);

/* ---- another library's GEMM (a provider) ----
 *
 * The op library's glue may install a provider: torch's own GEMM
 * (csrc/torch/gemm_torch.c), which is near the machine's peak where MKL and
 * oneDNN are (Intel, AMX). gemm_run offers it each product first; it computes
 * the product (alpha A B, then beta C) by its own means and finishes it with
 * gemm_finish, so every epilogue (bias, activation, pre-activation, 16-bit
 * results) and every caller's fusion around the GEMM stays the same; or it
 * declines (its choice for the product's class, or a product it cannot take)
 * and opforge's kernels run it. Offered from the thread that called gemm_run,
 * never from a worker. The C tests install none, or one of their own. */
typedef struct gemm_call {
    const gemm_plan *plan;
    const void *a;
    int64_t rsa, csa;
    const void *b;
    int64_t rsb, csb;
    float *c;
    int64_t rsc;
    const gemm_epilogue *ep;
    float *workspace; /* gemm_run's: what a provider hands gemm_run_own when it runs opforge's kernels itself */
    int64_t ws_floats;
    int claimed;     /* gemm_run_claimed's (no workspace): run on the provider's own GEMM, or declined */
    int64_t class_m; /* a claimed call's: the rows of the products whose class was claimed (a caller that merged
                        row chunks into this one product), or 0: plan->m */
} gemm_call;

typedef struct gemm_provider {
    const char *name;
    int (*run)(const gemm_call *call); /* 1: computed and finished (by whichever GEMM); 0: declined */
    /* 1 where run() puts every call like this one (operand types and layouts, sizes, epilogue, thread
     * count: its class) on its own GEMM, a choice it has settled (its mode, or a class it measured: not
     * one it is still measuring); the call's data pointers are not read. run() must then take a call
     * marked claimed onto its own GEMM, whatever its class (the caller may have merged several products
     * of the claimed class into one), or decline it. NULL: never. */
    int (*claims)(const gemm_call *call);
    /* 1 where claims()' answer for calls like this one stands: its mode puts every call on one GEMM, it
     * never takes such a class, or it has decided the class (a decision a later re-check may still
     * change); 0 while it is in question (a class still measured, or one in a re-check that needs the
     * caller's calls). NULL: never. */
    int (*settled)(const gemm_call *call);
} gemm_provider;

/* Installs p (NULL: none); products are offered to it from then on. */
void gemm_provider_set(const gemm_provider *p);
const gemm_provider *gemm_provider_get(void);

/* Whether the installed provider claims products like this one (its `claims`). ep: the epilogue the
 * call will have (which fields are set is read: any non-NULL out16 / pre16 / preact will do). */
int gemm_provider_claims(const gemm_plan *plan, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                         const gemm_epilogue *ep);
/* Whether that answer is final for the process (the provider's `settled`; no provider: never claimed). */
int gemm_provider_settled(const gemm_plan *plan, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                          const gemm_epilogue *ep);

/* A claimed product (gemm_provider_claims said so for its class), with no workspace: offered to the
 * provider alone, marked claimed. class_m: the rows of the products the caller asked the claim about
 * where it merged their row chunks into this one (0: the plan's own). 0, or -1 when it declines after
 * all (its mode changed since, or its GEMM failed), possibly after writing part of C or of the
 * results: the caller runs it again with a workspace. */
int gemm_run_claimed(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb,
                     int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep, int64_t class_m);

/* gemm_run on opforge's kernels, the provider not asked (what it compares itself with) */
int gemm_run_own(const gemm_plan *plan, const void *a, int64_t rsa, int64_t csa, const void *b, int64_t rsb,
                 int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep, float *workspace, int64_t ws_floats);

/* Finishes a product another GEMM made as gemm_run's epilogue would: prod
 * (plan->m, plan->n), row stride rs_prod, float32 or 16-bit (prod_dt), is
 * A B, or already beta C + A B when with_c is 0; with_c: beta C is added here
 * (ep->beta); ep->alpha, where set, multiplies prod first (a provider whose GEMM
 * applied it clears it). Then bias, the pre-activation store and the activation, into C
 * or ep->out16 / ep->pre16, through the ISA's micro-kernel epilogue (the
 * `store` of plan->kern's float32 table), threaded over row blocks. prod may
 * be C or ep->out16 itself (each tile is read before it is written). */
void gemm_finish(const gemm_plan *plan, const void *prod, opf_dtype prod_dt, int64_t rs_prod, int with_c, float *c,
                 int64_t rsc, const gemm_epilogue *ep);

/* Whether gemm_finish has anything to do after a product made straight into
 * its destination (C, or out16 with beta 0): a bias, an activation or a
 * pre-activation store. */
int gemm_epilogue_needed(const gemm_epilogue *ep);

/* Naive triple loop with the same epilogue, accumulating in double: the oracle. */
void gemm_ref_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                  int64_t rsb, int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep);

/* float64 oracle (and the float64 path of the ops, for gradcheck): the same
 * contract in double, activations from libm; the bias of any stride. */
void gemm_ref_f64(int64_t m, int64_t n, int64_t k, const double *a, int64_t rsa, int64_t csa, const double *b,
                  int64_t rsb, int64_t csb, double *c, int64_t rsc, double beta, const double *bias,
                  int64_t bias_stride, gemm_bias_kind bias_kind, act_kind act, double *preact, int64_t rsp);

/* The scalar epilogue of one tile from a full MR x NR accumulator (row stride
 * nr): what micro-kernels use for partial tiles. */
void gemm_tile_store(const float *acc, int nr, float *c, int64_t rsc, int m, int n, const gemm_tile *t);

#endif
