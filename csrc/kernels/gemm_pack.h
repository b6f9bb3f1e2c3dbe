/*
 * What the GEMM driver (gemm.c) and its packing (gemm_pack.c) share: the job
 * of one product and the packing entry points. Private to those two files.
 */
#ifndef OPFORGE_KERNELS_GEMM_PACK_H
#define OPFORGE_KERNELS_GEMM_PACK_H

#include "gemm.h"

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static inline const void *elem_ptr(const void *p, int64_t i, opf_dtype dt) {
    return (const char *)p + i * (int64_t)opf_dtype_size(dt);
}

typedef struct gemm_job {
    const gemm_kernels *kern;
    const gemm_epilogue *ep;
    int64_t m, nc, depth, jc, pc, k; /* depth: of the current K slice, from pc */
    const void *a, *b;
    opf_dtype ta, tb;
    int64_t rsa, csa, rsb, csb, rsc;
    float *c, *ap, *bp;
    gemm_plan plan;  /* the caller's, workers set per column panel */
    int64_t ntn;     /* column chunks per row block in the compute phase (1 when plan.own_a) */
    int pairs;       /* packed as bfloat16 pairs for kern->ukernel_pairs */
    int64_t kp;      /* packed depth of the K slice: depth, or its pairs */
    int64_t b_parts; /* K runs each B sliver's packing is cut into (gemm_pack_b_parts) */
} gemm_job;

/* A slivers [begin, end) of the K slice into dst (sliver s at (s - base) * mr * kp) */
void gemm_pack_a(const gemm_job *job, float *dst, int64_t base, int64_t begin, int64_t end);
/* opf_range_fn over slivers: A's into job->ap (the whole of A, shared), B's into job->bp */
void gemm_pack_a_range(int64_t begin, int64_t end, void *ctx);
void gemm_pack_b_range(int64_t begin, int64_t end, void *ctx);
/* opf_range_fn over B's slivers times job->b_parts: a run of one sliver's K slice each */
void gemm_pack_b_parts_range(int64_t begin, int64_t end, void *ctx);

#endif
