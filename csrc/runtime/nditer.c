/* Strided n-d iteration shared by elementwise kernels (see runtime.h). */
#include <stdio.h>
#include <string.h>

#include "opforge/runtime.h"

void opf_nd_init(opf_nd *nd, int ndim, const int64_t *sizes, int nops, const int64_t *const *strides) {
    int perm[OPF_MAX_DIMS], n = 0;
    nd->nops = nops;
    nd->numel = 1;
    for (int d = 0; d < ndim; d++) {
        nd->numel *= sizes[d];
        if (sizes[d] != 1) perm[n++] = d;
    }
    /* Stable insertion sort: the output's (operand 0) largest stride outermost. */
    for (int i = 1; i < n; i++) {
        int d = perm[i], j = i;
        while (j > 0 && strides[0][perm[j - 1]] < strides[0][d]) {
            perm[j] = perm[j - 1];
            j--;
        }
        perm[j] = d;
    }
    /* Merge an outer dim into the inner one when every operand steps through
     * them as one: stride[outer] == stride[inner] * size[inner]. */
    int m = 0;
    for (int i = 0; i < n; i++) {
        int d = perm[i];
        int merge = m > 0;
        for (int k = 0; k < nops && merge; k++) merge = nd->stride[k][m - 1] == strides[k][d] * sizes[d];
        if (merge) {
            nd->size[m - 1] *= sizes[d];
            for (int k = 0; k < nops; k++) nd->stride[k][m - 1] = strides[k][d];
        } else {
            nd->size[m] = sizes[d];
            for (int k = 0; k < nops; k++) nd->stride[k][m] = strides[k][d];
            m++;
        }
    }
    if (m == 0) { /* 0-dim or all sizes 1: one element */
        nd->size[0] = 1;
        for (int k = 0; k < nops; k++) nd->stride[k][0] = 1;
        m = 1;
    }
    nd->ndim = m;
}

void opf_nd_segments(const opf_nd *nd, int64_t begin, int64_t end, opf_segment_fn fn, void *ctx) {
    if (begin >= end) return;
    const int in = nd->ndim - 1;
    int64_t idx[OPF_MAX_DIMS], off[OPF_MAX_OPERANDS] = {0}, step[OPF_MAX_OPERANDS];
    int64_t rest = begin;
    for (int d = in; d >= 0; d--) {
        idx[d] = rest % nd->size[d];
        rest /= nd->size[d];
        for (int k = 0; k < nd->nops; k++) off[k] += idx[d] * nd->stride[k][d];
    }
    for (int k = 0; k < nd->nops; k++) step[k] = nd->stride[k][in];
    int64_t pos = begin;
    for (;;) {
        int64_t n = nd->size[in] - idx[in];
        if (n > end - pos) n = end - pos;
        fn(ctx, off, step, n);
        pos += n;
        if (pos >= end) return;
        /* odometer: finish this row, carry into the outer dims */
        idx[in] += n;
        for (int k = 0; k < nd->nops; k++) off[k] += n * step[k];
        for (int d = in; d > 0 && idx[d] == nd->size[d]; d--) {
            for (int k = 0; k < nd->nops; k++) off[k] += nd->stride[k][d - 1] - nd->size[d] * nd->stride[k][d];
            idx[d] = 0;
            idx[d - 1]++;
        }
    }
}

typedef struct nd_job {
    const opf_nd *nd;
    opf_segment_fn fn;
    void *ctx;
} nd_job;

static void nd_range(int64_t begin, int64_t end, void *ctx) {
    const nd_job *j = ctx;
    opf_nd_segments(j->nd, begin, end, j->fn, j->ctx);
}

void opf_nd_parallel(const opf_nd *nd, int64_t grain, opf_segment_fn fn, void *ctx) {
    nd_job j = {nd, fn, ctx};
    opf_parallel_for(0, nd->numel, grain, nd_range, &j);
}

void opf_nd_log(const char *op, const opf_nd *nd, int64_t grain) {
    if (!opf_log_enabled(OPF_LOG_DEBUG)) return;
    char dims[256], strides[256];
    size_t a = 0, b = 0;
    for (int d = 0; d < nd->ndim && a < sizeof dims; d++)
        a += (size_t)snprintf(dims + a, sizeof dims - a, d ? "x%lld" : "%lld", (long long)nd->size[d]);
    for (int k = 0; k < nd->nops && b < sizeof strides; k++)
        b += (size_t)snprintf(strides + b, sizeof strides - b, k ? ",%lld" : "%lld",
                              (long long)nd->stride[k][nd->ndim - 1]);
    int64_t chunks = (nd->numel + grain - 1) / (grain > 0 ? grain : 1);
    int threads = opf_num_threads();
    opf_log(OPF_LOG_DEBUG,
            "%s layout: %d dim(s) %s after merging, inner strides (out,in...) %s, %s path, "
            "grain %lld -> %lld chunk(s) on %d thread(s)",
            op, nd->ndim, dims, strides, nd->ndim == 1 && nd->stride[0][0] == 1 ? "flat" : "strided", (long long)grain,
            (long long)(chunks < threads ? chunks : threads), threads);
}

int opf_is_dense(int ndim, const int64_t *sizes, const int64_t *strides) {
    int dims[OPF_MAX_DIMS], n = 0;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] == 0) return 0;
        if (sizes[d] != 1) dims[n++] = d;
    }
    for (int i = 1; i < n; i++) { /* ascending stride */
        int d = dims[i], j = i;
        while (j > 0 && strides[dims[j - 1]] > strides[d]) {
            dims[j] = dims[j - 1];
            j--;
        }
        dims[j] = d;
    }
    int64_t expected = 1;
    for (int i = 0; i < n; i++) {
        if (strides[dims[i]] != expected) return 0;
        expected *= sizes[dims[i]];
    }
    return 1;
}

void opf_output_strides(int ndim, const int64_t *sizes, const int64_t *like_strides, int64_t *out_strides) {
    if (like_strides && opf_is_dense(ndim, sizes, like_strides)) {
        memcpy(out_strides, like_strides, sizeof(int64_t) * (size_t)ndim);
        return;
    }
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        out_strides[d] = s;
        s *= sizes[d] > 1 ? sizes[d] : 1;
    }
}
