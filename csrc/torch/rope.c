/*
 * torch glue of the rotary position embedding:
 *   rope(q (B,Hq,N,D), k (B,Hk,N,D), cos, sin, position_ids?, interleaved) -> (q_out, k_out)
 *   rope_backward(grad_q, grad_k, cos, sin, position_ids?, interleaved) -> (dq, dk)
 * cos / sin as Hugging Face gives them: (N, R), (B or 1, N, R) or
 * (B or 1, 1, N, R); with position_ids (B or 1, N) (int64) a table (P, R)
 * whose rows the positions pick (each checked to lie in [0, P) before any
 * output is written). R <= D and even; dims R..D pass through. cos / sin have
 * q's dtype and get no gradient. q, k, cos and sin of any strides are read in
 * place; the outputs take the strides of q and k (of grad_q and grad_k) when
 * those are dense, so the usual (B, N, H, D) projection viewed as
 * (B, H, N, D) stays in that layout. Check, allocate, call; the arithmetic is
 * in csrc/kernels/rope*. The checks and the allocation (rope_prepare, rope.h)
 * serve the CUDA glue too.
 */
#include "rope.h"

#include "../kernels/rope.h"
#include "aoti.h"
#include "namespace.h"
#include "opforge/op.h"

static const char FWD[] = OPF_QUALNAME("rope");
static const char BWD[] = OPF_QUALNAME("rope_backward");

static void check_head(const rope_args *a, __typeof__(opf_check_device) *check_device, const char *arg,
                       const opf_tensor *t) {
    check_device(a->op, arg, t, a->qname, &a->q);
    opf_check_float(a->op, arg, t);
    if (t != &a->q) opf_check_same_dtype(a->op, arg, t, a->qname, &a->q);
    opf_check_dims(a->op, arg, t, 4, "(batch, heads, length, head_dim)");
}

/* cos or sin: the strides (batch, position, rotary) of an accepted layout; returns R */
static int64_t check_table(const rope_args *a, __typeof__(opf_check_device) *check_device, const char *arg,
                           const opf_tensor *t, int64_t st[3]) {
    check_device(a->op, arg, t, a->qname, &a->q);
    opf_check_same_dtype(a->op, arg, t, a->qname, &a->q);
    const int64_t *sz = t->sizes, nd = t->ndim;
    if (a->has_pos) {
        opf_check_dims(a->op, arg, t, 2, "(positions, rotary_dim) when position_ids is given");
        st[0] = 0, st[1] = t->strides[0], st[2] = t->strides[1];
        return sz[1];
    }
    const int64_t bsz = a->q.sizes[0], n = a->q.sizes[2];
    const int layout = nd == 2 || nd == 3 || (nd == 4 && sz[1] == 1);
    const int64_t tb = layout && nd >= 3 ? sz[0] : 1, tn = layout ? sz[nd - 2] : -1;
    if (!layout || (tb != 1 && tb != bsz) || tn != n) {
        char got[128];
        opf_shape_str(got, sizeof got, t);
        opf_fail(a->op,
                 "argument '%s' must have shape (N, R), (B or 1, N, R) or (B or 1, 1, N, R) with B = %lld and N = "
                 "%lld (the sizes of '%s'), got shape %s",
                 arg, (long long)bsz, (long long)n, a->qname, got);
    }
    st[0] = nd >= 3 && tb != 1 ? t->strides[0] : 0;
    st[1] = t->strides[nd - 2];
    st[2] = t->strides[nd - 1];
    return sz[nd - 1];
}

rope_args rope_prepare(const char *op, const char *qname, const char *kname, __typeof__(opf_check_device) *check_device,
                       AtenTensorHandle q_h, AtenTensorHandle k_h, AtenTensorHandle cos_h, AtenTensorHandle sin_h,
                       AtenTensorHandle pos_h, int interleaved, int inverse, AtenTensorHandle *oq_h,
                       AtenTensorHandle *ok_h) {
    rope_args a = {.op = op,
                   .qname = qname,
                   .kname = kname,
                   .q = opf_tensor_info(op, qname, q_h),
                   .k = opf_tensor_info(op, kname, k_h),
                   .cos = opf_tensor_info(op, "cos", cos_h),
                   .sin = opf_tensor_info(op, "sin", sin_h),
                   .has_pos = pos_h != NULL};
    check_head(&a, check_device, qname, &a.q);
    check_head(&a, check_device, kname, &a.k);
    const int64_t *qs = a.q.sizes, *ks = a.k.sizes;
    for (int d = 0; d < 4; d++) /* batch, length, head_dim: any number of heads (grouped-query) */
        if (d != 1) opf_check_size(op, kname, &a.k, d, qname, &a.q, d);
    int64_t cst[3], sst[3];
    const int64_t r = check_table(&a, check_device, "cos", &a.cos, cst);
    check_table(&a, check_device, "sin", &a.sin, sst);
    opf_check_same_shape(op, "sin", &a.sin, "cos", &a.cos);
    if (r > qs[3])
        opf_fail(op,
                 "argument 'cos' must have a rotary dim (last size) of at most the head_dim of '%s' (%lld), got %lld",
                 qname, (long long)qs[3], (long long)r);
    if (r % 2 != 0) opf_fail(op, "argument 'cos' must have an even rotary dim (last size), got %lld", (long long)r);
    a.p = (rope_problem){.dt = opf_check_float(op, qname, &a.q),
                         .b = qs[0],
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
        check_device(op, "position_ids", &a.pos, qname, &a.q);
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
        /* on the CPU only: meta tensors hold no ids, and reading ids on the GPU would synchronise the stream
         * (and break CUDA graph capture), so the CUDA kernel checks each id as it reads it instead */
        int64_t bad = 0, at = a.pos.device_type != aoti_torch_device_type_cpu()
                                  ? -1
                                  : rope_check_positions(a.p.pos, a.p.b, a.p.n, a.p.pb, a.p.pn, a.cos.sizes[0], &bad);
        if (at >= 0)
            opf_fail(op, "argument 'position_ids' must lie in [0, %lld) (the rows of 'cos'), got %lld at [%lld, %lld]",
                     (long long)a.cos.sizes[0], (long long)bad, (long long)(at / qs[2]), (long long)(at % qs[2]));
    }

    *oq_h = opf_empty_like(op, &a.q);
    *ok_h = opf_empty_like(op, &a.k);
    a.oq = opf_tensor_info(op, "q_out", *oq_h), a.ok = opf_tensor_info(op, "k_out", *ok_h);
    a.p.oq = a.oq.data, a.p.ok = a.ok.data;
    for (int d = 0; d < 4; d++) a.p.oqs[d] = a.oq.strides[d], a.p.oks[d] = a.ok.strides[d];
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
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    OPF_OWNED AtenTensorHandle oq_h = NULL;
    OPF_OWNED AtenTensorHandle ok_h = NULL;
    const rope_args a = rope_prepare(op, qname, kname, opf_check_device, q_h, k_h, cos_h, sin_h, pos_h, interleaved,
                                     inverse, &oq_h, &ok_h);
    if (!opf_is_meta(&a.q)) {
        rope_run(rope_kernels_for(opf_isa_current()), &a.p);
        opf_log_call(op, t0, 4, (opf_tensor[]){a.q, a.k, a.cos, a.oq});
    }
    OPF_RETURN(stack, 0, oq_h);
    OPF_RETURN(stack, 1, ok_h);
}

/* rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved) -> (Tensor, Tensor) */
static void rope_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(FWD, "q", "k", stack, 0);
}

/* rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved)
 *   -> (Tensor, Tensor) */
static void rope_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(BWD, "grad_q", "grad_k", stack, 1);
}

static const opf_op_desc opf_rope_ops[] = {
    {
        .schema = "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved) "
                  "-> (Tensor, Tensor)",
        .cpu = rope_cpu,
        .shape = "like:q;like:k",
        .backward = "rope_backward",
        .backward_args = "grad0,grad1,cos,sin,position_ids,interleaved",
        .backward_grads = "q,k",
        .autocast = OPF_AUTOCAST_PROMOTE, /* as eager q * cos + rotate_half(q) * sin under autocast */
        .meta = 1,
    },
    {
        .schema = "rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, Tensor? position_ids, "
                  "bool interleaved) -> (Tensor, Tensor)",
        .cpu = rope_backward_cpu,
        .shape = "like:grad_q;like:grad_k",
        .autocast = OPF_AUTOCAST_NONE,
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_rope_ops);
OPF_REGISTER_FAMILY(rope_variants);

OPF_AOTI_SHIM(rope, 2,
              (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle cos, AtenTensorHandle sin,
               AtenTensorHandle *position_ids, int32_t interleaved),
              q, k, cos, sin, position_ids, interleaved);
OPF_AOTI_SHIM(rope_backward, 2,
              (AtenTensorHandle grad_q, AtenTensorHandle grad_k, AtenTensorHandle cos, AtenTensorHandle sin,
               AtenTensorHandle *position_ids, int32_t interleaved),
              grad_q, grad_k, cos, sin, position_ids, interleaved);
