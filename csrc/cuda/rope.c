/*
 * CUDA glue of rope and rope_backward: check, guard, stream, allocate through
 * torch, launch (csrc/cuda/rope.cu). The schema, fake kernel, autograd and
 * autocast are the CPU op's (csrc/torch/rope.c), and so are the checks, the
 * messages and the outputs' layout: q_out and k_out take the strides of q and
 * k when those are dense, else they are contiguous (opf_empty_like). q, k,
 * cos and sin of any strides are read in place.
 *
 * One difference: the CPU op checks every position id against the rows of
 * the cos / sin table before it writes anything; here the ids live on the
 * GPU and reading them would synchronise the stream (and break CUDA graph
 * capture), so the kernel checks each id as it reads it instead, reads no
 * table row for an id outside [0, P), and writes NaN to every element of q_out
 * and k_out at that position.
 */
#include "rope.h"

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char FWD[] = OPF_QUALNAME("rope");
static const char BWD[] = OPF_QUALNAME("rope_backward");

typedef struct rope_args {
    const char *op, *qname, *kname;
    opf_tensor q, k, cos, sin, pos;
    int has_pos;
    opf_dtype dt;
    rope_cuda_problem p;
} rope_args;

/* q (already checked on the GPU by OPF_CUDA_CALL) or k */
static void check_head(const rope_args *a, const char *arg, const opf_tensor *t) {
    opf_check_cuda(a->op, arg, t, a->qname, &a->q);
    opf_check_float(a->op, arg, t);
    if (t != &a->q) opf_check_same_dtype(a->op, arg, t, a->qname, &a->q);
    if (t->ndim != 4)
        opf_fail(a->op, "argument '%s' must be 4-d (batch, heads, length, head_dim), got %lld-d", arg,
                 (long long)t->ndim);
}

/* cos or sin: the strides (batch, position, rotary) of an accepted layout; returns R */
static int64_t check_table(const rope_args *a, const char *arg, const opf_tensor *t, int64_t st[3]) {
    opf_check_cuda(a->op, arg, t, a->qname, &a->q);
    opf_check_same_dtype(a->op, arg, t, a->qname, &a->q);
    char got[128];
    opf_shape_str(got, sizeof got, t);
    const int64_t *sz = t->sizes, nd = t->ndim;
    if (a->has_pos) {
        if (nd != 2)
            opf_fail(a->op,
                     "argument '%s' must be a 2-d table (positions, rotary_dim) when position_ids is given, got "
                     "shape %s",
                     arg, got);
        st[0] = 0, st[1] = t->strides[0], st[2] = t->strides[1];
        return sz[1];
    }
    const int64_t bsz = a->q.sizes[0], n = a->q.sizes[2];
    const int layout = nd == 2 || nd == 3 || (nd == 4 && sz[1] == 1);
    const int64_t tb = layout && nd >= 3 ? sz[0] : 1, tn = layout ? sz[nd - 2] : -1;
    if (!layout || (tb != 1 && tb != bsz) || tn != n)
        opf_fail(a->op,
                 "argument '%s' must have shape (N, R), (B or 1, N, R) or (B or 1, 1, N, R) with B = %lld and N = "
                 "%lld (the sizes of '%s'), got shape %s",
                 arg, (long long)bsz, (long long)n, a->qname, got);
    st[0] = nd >= 3 && tb != 1 ? t->strides[0] : 0;
    st[1] = t->strides[nd - 2];
    st[2] = t->strides[nd - 1];
    return sz[nd - 1];
}

/* The CPU op's checks in its order, q's device excepted (OPF_CUDA_CALL checked it first). */
static rope_args check_rope(const char *op, const char *qname, const char *kname, const opf_tensor *q,
                            AtenTensorHandle k_h, AtenTensorHandle cos_h, AtenTensorHandle sin_h,
                            AtenTensorHandle pos_h, int interleaved, int inverse) {
    rope_args a = {.op = op,
                   .qname = qname,
                   .kname = kname,
                   .q = *q,
                   .k = opf_tensor_info(op, kname, k_h),
                   .cos = opf_tensor_info(op, "cos", cos_h),
                   .sin = opf_tensor_info(op, "sin", sin_h),
                   .has_pos = pos_h != NULL};
    check_head(&a, qname, &a.q);
    check_head(&a, kname, &a.k);
    const int64_t *qs = a.q.sizes, *ks = a.k.sizes;
    if (ks[0] != qs[0])
        opf_fail(op, "argument '%s' must have the batch size of '%s' (%lld), got %lld", kname, qname, (long long)qs[0],
                 (long long)ks[0]);
    if (ks[2] != qs[2])
        opf_fail(op, "argument '%s' must have the sequence length of '%s' (%lld), got %lld", kname, qname,
                 (long long)qs[2], (long long)ks[2]);
    if (ks[3] != qs[3])
        opf_fail(op, "argument '%s' must have the head_dim of '%s' (%lld), got %lld", kname, qname, (long long)qs[3],
                 (long long)ks[3]);
    int64_t cst[3], sst[3];
    const int64_t r = check_table(&a, "cos", &a.cos, cst);
    check_table(&a, "sin", &a.sin, sst);
    opf_check_same_shape(op, "sin", &a.sin, "cos", &a.cos);
    if (r > qs[3])
        opf_fail(op,
                 "argument 'cos' must have a rotary dim (last size) of at most the head_dim of '%s' (%lld), got %lld",
                 qname, (long long)qs[3], (long long)r);
    if (r % 2 != 0) opf_fail(op, "argument 'cos' must have an even rotary dim (last size), got %lld", (long long)r);
    a.dt = opf_check_float(op, qname, &a.q);
    a.p = (rope_cuda_problem){.b = qs[0],
                              .hq = qs[1],
                              .hk = ks[1],
                              .n = qs[2],
                              .d = qs[3],
                              .r = r,
                              .interleaved = interleaved,
                              .inverse = inverse,
                              .q = a.q.data,
                              .k = a.k.data,
                              .cos = a.cos.data,
                              .sin = a.sin.data,
                              .cb = cst[0],
                              .cn = cst[1],
                              .cr = cst[2],
                              .sb = sst[0],
                              .sn = sst[1],
                              .sr = sst[2]};
    for (int d = 0; d < 4; d++) a.p.qs[d] = a.q.strides[d], a.p.ks[d] = a.k.strides[d];
    if (pos_h) {
        a.pos = opf_tensor_info(op, "position_ids", pos_h);
        opf_check_cuda(op, "position_ids", &a.pos, qname, &a.q);
        if (a.pos.dtype != aoti_torch_dtype_int64())
            opf_fail(op, "argument 'position_ids' must be an int64 tensor, got %s", opf_dtype_name(a.pos.dtype));
        char got[128];
        opf_shape_str(got, sizeof got, &a.pos);
        if (a.pos.ndim != 2 || (a.pos.sizes[0] != 1 && a.pos.sizes[0] != qs[0]) || a.pos.sizes[1] != qs[2])
            opf_fail(op, "argument 'position_ids' must have shape (B or 1, N) with B = %lld and N = %lld, got %s",
                     (long long)qs[0], (long long)qs[2], got);
        a.p.pos = a.pos.data;
        a.p.pb = a.pos.sizes[0] == 1 ? 0 : a.pos.strides[0];
        a.p.pn = a.pos.strides[1];
        a.p.table_rows = a.cos.sizes[0]; /* each id checked against it in the kernel (see above) */
    }
    return a;
}

/* The boxed body of both ops: the backward is the forward's transpose (inverse = 1). */
static void rope_call(const char *op, const char *qname, const char *kname, StableIValue *stack, int inverse) {
    OPF_ARG_TENSOR(q, stack, 0);
    OPF_ARG_TENSOR(k, stack, 1);
    OPF_ARG_TENSOR(cos, stack, 2);
    OPF_ARG_TENSOR(sin, stack, 3);
    /* unboxed before the first check that can throw: unboxing frees torch's box */
    OPF_OWNED AtenTensorHandle pos_h = opf_arg_optional_tensor(stack[4]);
    const int interleaved = opf_arg_bool(stack[5]);
    const opf_tensor q = opf_tensor_info(op, qname, q_h);
    OPF_CUDA_CALL(call, op, &q, qname);
    rope_args a = check_rope(op, qname, kname, &q, k_h, cos_h, sin_h, pos_h, interleaved, inverse);
    OPF_OWNED AtenTensorHandle oq_h = opf_empty_like(op, &a.q);
    OPF_OWNED AtenTensorHandle ok_h = opf_empty_like(op, &a.k);
    opf_tensor oq = opf_tensor_info(op, "q_out", oq_h), ok = opf_tensor_info(op, "k_out", ok_h);
    a.p.oq = oq.data, a.p.ok = ok.data;
    for (int d = 0; d < 4; d++) a.p.oqs[d] = oq.strides[d], a.p.oks[d] = ok.strides[d];
    const int vec = rope_cuda_vector(a.dt, &a.p);
    unsigned grid = rope_cuda(a.dt, &a.p, call.stream);
    opf_cuda_done(&call, NULL, vec ? "rope_rows_vec" : "rope_rows", grid, ROPE_CUDA_THREADS, 4,
                  (opf_tensor[]){a.q, a.k, a.cos, oq});
    OPF_RETURN(stack, 0, oq_h);
    OPF_RETURN(stack, 1, ok_h);
}

/* rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved) -> (Tensor, Tensor) */
static void rope_cuda_kernel(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(FWD, "q", "k", stack, 0);
}

/* rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved)
 *   -> (Tensor, Tensor) */
static void rope_backward_cuda_kernel(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(BWD, "grad_q", "grad_k", stack, 1);
}

OPF_REGISTER_CUDA(rope, rope_cuda_kernel);
OPF_REGISTER_CUDA(rope_backward, rope_backward_cuda_kernel);
