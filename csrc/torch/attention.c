/*
 * torch glue of the attention ops:
 *   attention(q (B,H,N,D), k (B,Hkv,S,D), v (B,Hkv,S,Dv), attn_mask?, causal, scale?)
 *       -> (out (B,H,N,Dv), lse (B,H,N) float32)
 *   attention_backward(grad, q, k, v, attn_mask?, out, lse, causal, scale?) -> (dq, dk, dv)
 * Checks, allocation and the calls: the driver (csrc/kernels/attention.c)
 * decides the path, the plan and its threads. float32 / bfloat16 / float16
 * run the flash kernels (16-bit inputs computed in float32, rounded once);
 * float64 the oracle (for gradcheck). Inputs of any strides are read in place. out is laid out as
 * (B, N, H, Dv) in memory and returned as its (B, H, N, Dv) view, so that
 * out.transpose(1, 2).reshape(B, N, H * Dv) is free; dq, dk, dv take the
 * strides of q, k, v when those are dense. attn_mask is bool (true = attend)
 * or the dtype of q (added to the scores), broadcastable to (B, H, N, S).
 */
#include <float.h>
#include <math.h>

#include "../kernels/attention.h"
#include "aoti.h"
#include "attention.h"
#include "namespace.h"
#include "opforge/op.h"

static const char ATTENTION[] = OPF_QUALNAME("attention");
static const char ATTENTION_BACKWARD[] = OPF_QUALNAME("attention_backward");

double attention_scale(const char *op, opf_dtype dt, int has_scale, double scale, int64_t head_dim) {
    const int f64 = dt == OPF_F64;
    if (has_scale && !(fabs(scale) <= (f64 ? DBL_MAX : FLT_MAX)))
        opf_fail(op, "argument 'scale' must be a finite %s number, got %g", f64 ? "float64" : "float32", scale);
    return has_scale ? scale : head_dim > 0 ? 1.0 / sqrt((double)head_dim) : 1.0;
}

typedef struct attention_args {
    opf_tensor q, k, v, mask;
    attention_problem p;
} attention_args;

static void check_qkv(const char *op, const char *arg, const opf_tensor *t, const opf_tensor *q) {
    opf_check_device(op, arg, t, "q", q);
    opf_check_float(op, arg, t);
    if (q != t) opf_check_same_dtype(op, arg, t, "q", q);
    opf_check_dims(op, arg, t, 4, "(batch, heads, length, head_dim)");
}

/* mask strides over (b, h, n, s): right-aligned broadcasting, 0 where broadcast */
static void check_mask(const char *op, attention_args *a) {
    const opf_tensor *m = &a->mask;
    opf_check_device(op, "attn_mask", m, "q", &a->q);
    const int32_t bool_t = aoti_torch_dtype_bool();
    if (m->dtype == bool_t) {
        a->p.mask_kind = ATTENTION_MASK_BOOL;
    } else if (m->dtype == a->q.dtype) {
        a->p.mask_kind = ATTENTION_MASK_ADD;
        a->p.mask_dt = a->p.dt;
    } else {
        opf_fail(
            op,
            "argument 'attn_mask' must be bool (true = attend) or %s (the dtype of 'q', added to the scores), got %s",
            opf_dtype_name(a->q.dtype), opf_dtype_name(m->dtype));
    }
    const int64_t full[4] = {a->p.b, a->p.h, a->p.n, a->p.s};
    if (m->ndim > 4)
        opf_fail(op, "argument 'attn_mask' must have at most 4 dims (B, H, N, S), got %lld-d", (long long)m->ndim);
    for (int d = 0; d < 4; d++) {
        int64_t md = d - (4 - m->ndim);
        if (md < 0) {
            a->p.ms[d] = 0;
            continue;
        }
        if (m->sizes[md] != full[d] && m->sizes[md] != 1) {
            char want[128], got[128];
            opf_shape_str(want, sizeof want, &(opf_tensor){.ndim = 4, .sizes = full});
            opf_shape_str(got, sizeof got, m);
            opf_fail(op, "argument 'attn_mask' must be broadcastable to (B, H, N, S) = %s, got shape %s", want, got);
        }
        a->p.ms[d] = m->sizes[md] == 1 ? 0 : m->strides[md];
    }
    a->p.mask = m->data;
}

/* scale: has_scale ? the given scale : None */
static attention_args check_attention(const char *op, AtenTensorHandle q_h, AtenTensorHandle k_h, AtenTensorHandle v_h,
                                      AtenTensorHandle mask_h, int causal, int has_scale, double scale) {
    attention_args a = {
        .q = opf_tensor_info(op, "q", q_h), .k = opf_tensor_info(op, "k", k_h), .v = opf_tensor_info(op, "v", v_h)};
    check_qkv(op, "q", &a.q, &a.q);
    check_qkv(op, "k", &a.k, &a.q);
    check_qkv(op, "v", &a.v, &a.q);
    const int64_t *qs = a.q.sizes, *ks = a.k.sizes, *vs = a.v.sizes;
    opf_check_size(op, "k", &a.k, 0, "q", &a.q, 0); /* batch */
    opf_check_size(op, "v", &a.v, 0, "q", &a.q, 0);
    opf_check_size(op, "v", &a.v, 1, "k", &a.k, 1); /* heads */
    /* no query head (H = 0) needs no key/value head: an empty result, as torch's */
    if (ks[1] < 1 ? qs[1] != 0 : qs[1] % ks[1] != 0)
        opf_fail(op,
                 "argument 'k' must have a number of heads dividing the %lld heads of 'q' (grouped-query attention), "
                 "got %lld",
                 (long long)qs[1], (long long)ks[1]);
    opf_check_size(op, "k", &a.k, 3, "q", &a.q, 3); /* head_dim */
    opf_check_size(op, "v", &a.v, 2, "k", &a.k, 2); /* key length */
    a.p = (attention_problem){.b = qs[0],
                              .h = qs[1],
                              .hkv = ks[1],
                              .n = qs[2],
                              .s = ks[2],
                              .d_qk = qs[3],
                              .d_v = vs[3],
                              .dt = opf_check_float(op, "q", &a.q),
                              .q = a.q.data,
                              .k = a.k.data,
                              .v = a.v.data,
                              .causal = causal};
    for (int d = 0; d < 4; d++) a.p.qs[d] = a.q.strides[d], a.p.ks[d] = a.k.strides[d], a.p.vs[d] = a.v.strides[d];
    a.p.scale = attention_scale(op, a.p.dt, has_scale, scale, qs[3]);
    if (mask_h) {
        a.mask = opf_tensor_info(op, "attn_mask", mask_h);
        check_mask(op, &a);
    }
    return a;
}

static void attention_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(q, stack, 0);
    OPF_ARG_TENSOR(k, stack, 1);
    OPF_ARG_TENSOR(v, stack, 2);
    /* every boxed optional is unboxed before the first check that can throw:
     * unboxing frees torch's box, which an error would leak */
    OPF_OWNED AtenTensorHandle mask_h = opf_arg_optional_tensor(stack[3]);
    double scale = 0.0;
    const int has_scale = opf_arg_optional_double(stack[5], &scale);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    attention_args a = check_attention(ATTENTION, q_h, k_h, v_h, mask_h, opf_arg_bool(stack[4]), has_scale, scale);
    attention_problem *p = &a.p;
    const int64_t osz[4] = {p->b, p->h, p->n, p->d_v}, ost[4] = {p->n * p->h * p->d_v, p->d_v, p->h * p->d_v, 1};
    const int64_t lsz[3] = {p->b, p->h, p->n};
    OPF_OWNED AtenTensorHandle out_h = opf_empty_strided(ATTENTION, 4, osz, ost, a.q.dtype, &a.q);
    OPF_OWNED AtenTensorHandle lse_h = opf_empty(ATTENTION, 3, lsz, aoti_torch_dtype_float32(), &a.q);
    opf_tensor out = opf_tensor_info(ATTENTION, "out", out_h), lse = opf_tensor_info(ATTENTION, "lse", lse_h);
    p->out = out.data, p->lse = lse.data;
    for (int d = 0; d < 4; d++) p->os[d] = out.strides[d];
    if (!opf_is_meta(&a.q)) { /* the fake kernel's meta stand-ins are checked and shaped, nothing to compute */
        const attention_fwd_plan plan = attention_fwd_plan_make(p, opf_num_threads());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(ATTENTION, attention_fwd_workspace(&plan), &a.q, &ws);
        attention_fwd(attention_kernels_for(opf_isa_current()), &plan, p, ws);
    }
    opf_log_call(ATTENTION, t0, 4, (opf_tensor[]){a.q, a.k, a.v, out});
    OPF_RETURN(stack, 0, out_h);
    OPF_RETURN(stack, 1, lse_h);
}

static void attention_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(q, stack, 1);
    OPF_ARG_TENSOR(k, stack, 2);
    OPF_ARG_TENSOR(v, stack, 3);
    OPF_ARG_TENSOR(out, stack, 5);
    OPF_ARG_TENSOR(lse, stack, 6);
    /* unboxed before the first check that can throw, as in attention_cpu */
    OPF_OWNED AtenTensorHandle mask_h = opf_arg_optional_tensor(stack[4]);
    double scale = 0.0;
    const int has_scale = opf_arg_optional_double(stack[8], &scale);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    attention_args a =
        check_attention(ATTENTION_BACKWARD, q_h, k_h, v_h, mask_h, opf_arg_bool(stack[7]), has_scale, scale);
    attention_problem *p = &a.p;
    opf_tensor g = opf_tensor_info(ATTENTION_BACKWARD, "grad", grad_h),
               out = opf_tensor_info(ATTENTION_BACKWARD, "out", out_h),
               lse = opf_tensor_info(ATTENTION_BACKWARD, "lse", lse_h);
    const int64_t osz[4] = {p->b, p->h, p->n, p->d_v}, lsz[3] = {p->b, p->h, p->n};
    opf_tensor want = {.ndim = 4, .sizes = osz}, want_lse = {.ndim = 3, .sizes = lsz};
    opf_check_device(ATTENTION_BACKWARD, "grad", &g, "q", &a.q);
    opf_check_device(ATTENTION_BACKWARD, "out", &out, "q", &a.q);
    opf_check_device(ATTENTION_BACKWARD, "lse", &lse, "q", &a.q);
    opf_check_same_dtype(ATTENTION_BACKWARD, "grad", &g, "q", &a.q);
    opf_check_same_shape(ATTENTION_BACKWARD, "grad", &g, "the output", &want);
    opf_check_same_dtype(ATTENTION_BACKWARD, "out", &out, "q", &a.q);
    opf_check_same_shape(ATTENTION_BACKWARD, "out", &out, "the output", &want);
    opf_check_same_shape(ATTENTION_BACKWARD, "lse", &lse, "(B, H, N)", &want_lse);
    /* strides matter only where there is an element to read (torch gives an
     * empty tensor's dims strides of its own) */
    if (lse.dtype != aoti_torch_dtype_float32() ||
        (lse.numel > 0 && ((p->n > 1 && lse.strides[2] != 1) || (p->h > 1 && lse.strides[1] != p->n) ||
                           (p->b > 1 && lse.strides[0] != p->h * p->n))))
        opf_fail(ATTENTION_BACKWARD, "argument 'lse' must be the contiguous float32 log-sum-exp returned by %s, got %s",
                 ATTENTION, opf_dtype_name(lse.dtype));
    OPF_OWNED AtenTensorHandle dq_h = opf_empty_like(ATTENTION_BACKWARD, &a.q);
    OPF_OWNED AtenTensorHandle dk_h = opf_empty_like(ATTENTION_BACKWARD, &a.k);
    OPF_OWNED AtenTensorHandle dv_h = opf_empty_like(ATTENTION_BACKWARD, &a.v);
    opf_tensor dq = opf_tensor_info(ATTENTION_BACKWARD, "dq", dq_h),
               dk = opf_tensor_info(ATTENTION_BACKWARD, "dk", dk_h),
               dv = opf_tensor_info(ATTENTION_BACKWARD, "dv", dv_h);
    p->out = out.data, p->lse = lse.data, p->dout = g.data, p->dq = dq.data, p->dk = dk.data, p->dv = dv.data;
    for (int d = 0; d < 4; d++) {
        p->os[d] = out.strides[d], p->dos[d] = g.strides[d];
        p->dqs[d] = dq.strides[d], p->dks[d] = dk.strides[d], p->dvs[d] = dv.strides[d];
    }
    if (!opf_is_meta(&a.q)) { /* the fake kernel's meta stand-ins are checked and shaped, nothing to compute */
        const attention_bwd_plan plan = attention_bwd_plan_make(p, opf_num_threads());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(ATTENTION_BACKWARD, attention_bwd_workspace(&plan), &a.q, &ws);
        attention_bwd(attention_kernels_for(opf_isa_current()), &plan, p, ws);
    }
    opf_log_call(ATTENTION_BACKWARD, t0, 4, (opf_tensor[]){g, a.q, a.k, a.v});
    OPF_RETURN(stack, 0, dq_h);
    OPF_RETURN(stack, 1, dk_h);
    OPF_RETURN(stack, 2, dv_h);
}

static const opf_op_desc opf_attention_ops[] = {
    {
        .schema = "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool causal, float? scale) "
                  "-> (Tensor, Tensor)",
        .cpu = attention_cpu,
        /* out as attention_cpu allocates it, (B, N, H, Dv), returned as its (B, H, N, Dv) view:
         * heads side by side in a row, so out.transpose(1, 2).reshape(B, N, H * Dv) is free */
        .shape = "[q[0], q[2], q[1], v[-1]] perm=0,2,1,3; [q[:3]] dtype=float32",
        .backward = "attention_backward",
        .backward_args = "grad0,q,k,v,attn_mask,out0,out1,causal,scale",
        .backward_grads = "q,k,v",
        .autocast = OPF_AUTOCAST_LOWER,
        .flops = "4*numel(q)*size(k,2)",
        .meta = 1,
    },
    {
        .schema = "attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor out, "
                  "Tensor lse, bool causal, float? scale) -> (Tensor, Tensor, Tensor)",
        .cpu = attention_backward_cpu,
        .shape = "like:q;like:k;like:v",
        .flops = "10*numel(q)*size(k,2)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_attention_ops);
OPF_REGISTER_FAMILY(attention_variants);

OPF_AOTI_SHIM(attention, 2,
              (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle *attn_mask, int32_t causal,
               double *scale),
              q, k, v, attn_mask, causal, scale);
OPF_AOTI_SHIM(attention_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
               AtenTensorHandle *attn_mask, AtenTensorHandle out, AtenTensorHandle lse, int32_t causal, double *scale),
              grad, q, k, v, attn_mask, out, lse, causal, scale);
