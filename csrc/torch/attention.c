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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/attention.h"
#include "aoti.h"
#include "attention.h"
#include "namespace.h"
#include "opforge/op.h"
#include "provider.h"

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

/* ---- torch's fused CPU attention as the provider of the plain cases ---------------
 *
 * Where torch's own flash attention (aten::_scaled_dot_product_flash_attention_for_cpu and its
 * backward, through their AOTInductor C shims: oneDNN/AMX for bfloat16 on Intel) is the faster one
 * for a class of problem (provider.h: OPFORGE_GEMM=own|torch|auto), the op runs it: float32 and
 * bfloat16, no mask, key/value heads that divide the query heads (grouped-query attention: torch's
 * kernel reads K and V per group, unrepeated, as the op's does), one head dim, causal only with as many
 * keys as queries (torch's causal mask is aligned top-left). Its output has opforge's layout
 * ((B, N, H, Dv) in memory) and is returned as it is; its log-sum-exp ((B, N, H) in memory) is
 * copied into the contiguous (B, H, N) one of the op's schema. Either backward runs on either
 * forward's out and lse: both are the output and the natural log-sum-exp of the scaled scores. */

enum { SDPA_MIN_WORK = 1 << 22 }; /* B H N S D multiply-adds at least */

/* The cases torch's kernel computes as the op does */
static int sdpa_covers(const attention_problem *p) {
    return (p->dt == OPF_F32 || p->dt == OPF_BF16) && !p->mask && p->hkv > 0 && p->h % p->hkv == 0 &&
           p->d_qk == p->d_v && (!p->causal || p->n == p->s);
}

static double sdpa_work(const attention_problem *p) { return (double)p->b * p->h * p->n * p->s * p->d_qk; }

static int sdpa_takes(const attention_problem *p) { return sdpa_covers(p) && sdpa_work(p) >= SDPA_MIN_WORK; }

static void sdpa_key(char *key, size_t len, const char *pass, const attention_problem *p) {
    snprintf(key, len, "sdpa %s %s %c%s t%lld bh%d g%lld n%d s%d d%lld", pass,
             attention_kernels_for(opf_isa_current())->name, p->dt == OPF_F32 ? 'f' : 'b', p->causal ? " causal" : "",
             (long long)opf_num_threads(), opf_provider_log2_up(p->b * p->h), (long long)(p->h / p->hkv),
             opf_provider_log2_up(p->n), opf_provider_log2_up(p->s), (long long)p->d_qk);
}

typedef struct sdpa_copy_job {
    char *dst;
    const char *src;
    int64_t s4[4], d4[4], z4[4];
    size_t elem;
} sdpa_copy_job;

/* rows [begin, end) of the flattened leading three dims */
static void sdpa_copy_rows(int64_t begin, int64_t end, void *ctx) {
    const sdpa_copy_job *j = ctx;
    const int64_t *s4 = j->s4, *d4 = j->d4, *z4 = j->z4, e = (int64_t)j->elem;
    for (int64_t r = begin; r < end; r++) {
        const int64_t c = r % z4[2], b = r / z4[2] % z4[1], a = r / z4[2] / z4[1];
        const char *from = j->src + (a * s4[0] + b * s4[1] + c * s4[2]) * e;
        char *to = j->dst + (a * d4[0] + b * d4[1] + c * d4[2]) * e;
        if (s4[3] == 1 && d4[3] == 1)
            memcpy(to, from, (size_t)(z4[3] * e));
        else
            for (int64_t i = 0; i < z4[3]; i++) memcpy(to + i * d4[3] * e, from + i * s4[3] * e, (size_t)e);
    }
}

/* dst (ndim <= 4 dims, strides ds) = src (a tensor of the same sizes, any strides), elements of elem
 * bytes; rows of the last dim spread over the threads (an output of torch's kernel into the op's
 * layout: 8 MiB took 3.5 ms one row at a time on one thread) */
static void sdpa_copy(void *dst, const int64_t *ds, AtenTensorHandle src, const int64_t *sz, int ndim, size_t elem) {
    void *sp = NULL;
    int64_t *ss = NULL;
    aoti_torch_get_data_ptr(src, &sp);
    aoti_torch_get_strides(src, &ss);
    sdpa_copy_job j = {.dst = dst, .src = sp, .s4 = {0, 0, 0, 0}, .d4 = {0, 0, 0, 0}, .z4 = {1, 1, 1, 1}, .elem = elem};
    for (int d = 0; d < ndim; d++) j.s4[4 - ndim + d] = ss[d], j.d4[4 - ndim + d] = ds[d], j.z4[4 - ndim + d] = sz[d];
    const int64_t rows = j.z4[0] * j.z4[1] * j.z4[2], row_bytes = j.z4[3] * (int64_t)elem;
    opf_parallel_for(0, rows, 1 + (64 << 10) / (row_bytes > 0 ? row_bytes : 1), sdpa_copy_rows, &j);
}

static int same_strides(AtenTensorHandle t, const int64_t *want, int ndim) {
    int64_t *st = NULL;
    aoti_torch_get_strides(t, &st);
    for (int d = 0; d < ndim; d++)
        if (st[d] != want[d]) return 0;
    return 1;
}

/* q, k, v, and for the backward dout, out and lse, as tensors for torch's kernels: in[0..3) q, k, v;
 * in[3..6) dout, out, lse when backward. 0, or -1 (those made are the caller's to release). */
static int sdpa_inputs(const attention_problem *p, int backward, AtenTensorHandle *in) {
    const void *data[6] = {p->q, p->k, p->v, p->dout, p->out, p->lse};
    const int64_t *st[6] = {p->qs, p->ks, p->vs, p->dos, p->os, NULL}, lst[3] = {p->h * p->n, p->n, 1};
    for (int i = 0; i < (backward ? 6 : 3); i++) {
        const int kv = i == 1 || i == 2;
        const int64_t sz[4] = {p->b, kv ? p->hkv : p->h, kv ? p->s : p->n, p->d_qk};
        if (!(in[i] = i == 5 ? opf_provider_wrap(data[i], 3, sz, lst, OPF_F32)
                             : opf_provider_wrap(data[i], 4, sz, st[i], p->dt)))
            return -1;
    }
    return 0;
}

/* The forward on torch's kernel: lse written as attention_problem's, *theirs receives torch's out
 * (the caller's), which the caller keeps where it has the op's strides and copies from otherwise:
 * the op's own out is made only then, so that the two are never both held. 0 or -1. */
static int sdpa_fwd(const attention_problem *p, AtenTensorHandle *theirs) {
    AtenTensorHandle in[3] = {NULL, NULL, NULL}, res[2] = {NULL, NULL};
    int rc = -1;
    if (sdpa_inputs(p, 0, in) != 0) goto done;
    double scale = p->scale;
    if (aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(in[0], in[1], in[2], 0.0, p->causal, NULL, &scale,
                                                                   &res[0], &res[1]) != OPF_AOTI_SUCCESS)
        goto done;
    const int64_t lsz[3] = {p->b, p->h, p->n}, lst[3] = {p->h * p->n, p->n, 1};
    sdpa_copy(p->lse, lst, res[1], lsz, 3, sizeof(float));
    *theirs = res[0];
    res[0] = NULL;
    rc = 0;
done:
    opf_provider_release(in, 3);
    opf_provider_release(res, 2);
    return rc;
}

/* The backward on torch's kernel: grads[0..3) receive its dq, dk, dv (the caller's, who keeps each
 * where it has the strides of the op's and copies from it otherwise). 0 or -1. */
static int sdpa_bwd(const attention_problem *p, AtenTensorHandle *grads) {
    AtenTensorHandle in[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    int rc = -1;
    if (sdpa_inputs(p, 1, in) != 0) goto done;
    double scale = p->scale;
    if (aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu_backward(in[3], in[0], in[1], in[2], in[4], in[5],
                                                                            0.0, p->causal, NULL, &scale, &grads[0],
                                                                            &grads[1], &grads[2]) == OPF_AOTI_SUCCESS)
        rc = 0;
done:
    opf_provider_release(in, 6);
    return rc;
}

/* The op's output for a result of torch's kernel: theirs itself where it has the strides the op
 * gives (want), else a new tensor of them holding a copy (theirs released). */
static AtenTensorHandle sdpa_keep(const char *op, AtenTensorHandle theirs, const int64_t *sz, const int64_t *want,
                                  int32_t dtype, const opf_tensor *like) {
    if (same_strides(theirs, want, 4)) return theirs;
    OPF_OWNED AtenTensorHandle from = theirs;
    AtenTensorHandle mine = opf_empty_strided(op, 4, sz, want, dtype, like);
    void *data = NULL;
    aoti_torch_get_data_ptr(mine, &data);
    sdpa_copy(data, want, from, sz, 4, aoti_torch_dtype_element_size(dtype));
    return mine;
}

/* This call's kernel (provider.h): torch's where the mode or the class's choice says so; the class
 * is timed on its first calls (the op's whole call, per B H N S D). */
static int sdpa_begin(const attention_problem *p, int backward, opf_provider_turn *turn) {
    turn->measuring = turn->torch = 0;
    if (opf_provider_mode() == OPF_PROVIDER_OWN || !sdpa_takes(p)) return 0;
    char key[160];
    sdpa_key(key, sizeof key, backward ? "bwd" : "fwd", p);
    return opf_provider_begin(key, turn);
}

/* Whether an eager call of these operands (no mask; strides aside) runs torch's fused attention for
 * its forward and, when a gradient is needed, its backward: 1 (the mode torch: the Python wrapper then
 * calls F.scaled_dot_product_attention itself, which runs the same kernel without the op's autograd
 * hop and copies), 3 (the same for classes auto mode decided for torch, which it re-checks: ask again at
 * the re-checks' call numbers, 32, 64, ... 2048, with `routed` the calls sent to torch's function since
 * last asked), 0 (final: not), -1 (auto mode still measures a class, or waits for a re-check's sample
 * of opforge's kernel: ask again), 2 (auto mode, a case torch's kernel covers below the work the op
 * offers it: the op's fixed costs, its autograd hop through Python among them, weigh most there, so
 * the wrapper times whole calls of both instead). */
OPF_EXPORT int opforge_attention_on_torch(int64_t b, int64_t h, int64_t hkv, int64_t n, int64_t s, int64_t d_qk,
                                          int64_t d_v, int bf16, int causal, int needs_grad, int64_t routed) {
    const attention_problem p = {.b = b,
                                 .h = h,
                                 .hkv = hkv,
                                 .n = n,
                                 .s = s,
                                 .d_qk = d_qk,
                                 .d_v = d_v,
                                 .dt = bf16 ? OPF_BF16 : OPF_F32,
                                 .causal = causal};
    const int mode = opf_provider_mode();
    if (mode == OPF_PROVIDER_OWN || !sdpa_covers(&p)) return 0;
    if (mode == OPF_PROVIDER_TORCH) return 1;
    if (!sdpa_takes(&p)) return 2;
    int answer = 3;
    for (int pass = 0; pass < 1 + (needs_grad != 0); pass++) {
        char key[160];
        sdpa_key(key, sizeof key, pass ? "bwd" : "fwd", &p);
        opf_provider_routed(key, routed);
        int torch = 0;
        if (!opf_provider_decided(key, &torch)) {
            answer = -1;
        } else if (!torch) {
            return 0;
        }
    }
    return answer;
}

/* The work (B H N S D multiply-adds) from which the op offers a call to torch's kernel */
OPF_EXPORT int64_t opforge_attention_torch_min_work(void) { return SDPA_MIN_WORK; }

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
    OPF_OWNED AtenTensorHandle lse_h = opf_empty(ATTENTION, 3, lsz, aoti_torch_dtype_float32(), &a.q);
    OPF_OWNED AtenTensorHandle out_h = NULL; /* made after torch's kernel declines: never two outputs at once */
    opf_tensor lse = opf_tensor_info(ATTENTION, "lse", lse_h);
    p->lse = lse.data;
    for (int d = 0; d < 4; d++) p->os[d] = ost[d];
    int on_torch = 0;
    opf_provider_turn turn = {0};
    if (!opf_is_meta(&a.q) && sdpa_begin(p, 0, &turn)) { /* torch's kernel, where it is the faster one */
        AtenTensorHandle theirs = NULL;
        on_torch = sdpa_fwd(p, &theirs) == 0;
        /* the sample ends with torch's kernel (or its failure): an eager call the class sends to
         * torch's kernel is F.scaled_dot_product_attention itself, which returns torch's layout
         * without the copy sdpa_keep may make */
        opf_provider_end(&turn, on_torch ? sdpa_work(p) : 0, !on_torch), turn.measuring = 0;
        if (on_torch) out_h = sdpa_keep(ATTENTION, theirs, osz, ost, a.q.dtype, &a.q);
        if (on_torch && opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick("attention", "torch_sdpa", opf_isa_current());
    }
    if (!out_h) out_h = opf_empty_strided(ATTENTION, 4, osz, ost, a.q.dtype, &a.q);
    opf_tensor out = opf_tensor_info(ATTENTION, "out", out_h);
    p->out = out.data;
    if (!opf_is_meta(&a.q) && !on_torch) { /* the fake kernel's meta stand-ins are checked and shaped */
        const attention_kernels *kern = attention_kernels_for(opf_isa_current());
        const attention_fwd_plan plan = attention_fwd_plan_make(kern, p, opf_num_threads());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(ATTENTION, attention_fwd_workspace(&plan), &a.q, &ws);
        attention_fwd(kern, &plan, p, ws);
    }
    opf_provider_end(&turn, sdpa_work(p), 0);
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
    p->out = out.data, p->lse = lse.data, p->dout = g.data;
    for (int d = 0; d < 4; d++) p->os[d] = out.strides[d], p->dos[d] = g.strides[d];
    /* the gradients are made after torch's kernel declines, or from its where it ran: never two sets
     * at once */
    const opf_tensor *like[3] = {&a.q, &a.k, &a.v};
    int64_t grad_st[3][4];
    for (int i = 0; i < 3; i++) opf_output_strides(4, like[i]->sizes, like[i]->strides, grad_st[i]);
    OPF_OWNED AtenTensorHandle dq_h = NULL;
    OPF_OWNED AtenTensorHandle dk_h = NULL;
    OPF_OWNED AtenTensorHandle dv_h = NULL;
    AtenTensorHandle *ours[3] = {&dq_h, &dk_h, &dv_h};
    int on_torch = 0;
    opf_provider_turn turn = {0};
    if (!opf_is_meta(&a.q) && sdpa_begin(p, 1, &turn)) { /* torch's kernel, where it is the faster one */
        AtenTensorHandle grads[3] = {NULL, NULL, NULL};
        on_torch = sdpa_bwd(p, grads) == 0;
        opf_provider_end(&turn, on_torch ? sdpa_work(p) : 0, !on_torch), turn.measuring = 0; /* as the forward's */
        for (int i = 0; on_torch && i < 3; i++) {
            *ours[i] = sdpa_keep(ATTENTION_BACKWARD, grads[i], like[i]->sizes, grad_st[i], a.q.dtype, like[i]);
            grads[i] = NULL;
        }
        opf_provider_release(grads, 3);
        if (on_torch && opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick("attention", "torch_sdpa", opf_isa_current());
    }
    for (int i = 0; i < 3; i++)
        if (!*ours[i])
            *ours[i] = opf_empty_strided(ATTENTION_BACKWARD, 4, like[i]->sizes, grad_st[i], a.q.dtype, like[i]);
    opf_tensor dq = opf_tensor_info(ATTENTION_BACKWARD, "dq", dq_h),
               dk = opf_tensor_info(ATTENTION_BACKWARD, "dk", dk_h),
               dv = opf_tensor_info(ATTENTION_BACKWARD, "dv", dv_h);
    p->dq = dq.data, p->dk = dk.data, p->dv = dv.data;
    for (int d = 0; d < 4; d++) p->dqs[d] = dq.strides[d], p->dks[d] = dk.strides[d], p->dvs[d] = dv.strides[d];
    if (!opf_is_meta(&a.q) && !on_torch) { /* the fake kernel's meta stand-ins are checked and shaped */
        const attention_bwd_plan plan = attention_bwd_plan_make(p, opf_num_threads());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(ATTENTION_BACKWARD, attention_bwd_workspace(&plan), &a.q, &ws);
        attention_bwd(attention_kernels_for(opf_isa_current()), &plan, p, ws);
    }
    opf_provider_end(&turn, sdpa_work(p), 0);
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

/* How attention's plans split a problem of contiguous float32 (B, H, N, D) tensors, no mask, at a thread
 * count (benchmarks/plan_table.py): the work of each task of the forward's plan (bwd 0) or the
 * backward's (bwd 1), in the order the workers pull them (attention_fwd_task_cost), the first `cap` into
 * costs; returns the tasks. */
OPF_EXPORT int64_t opforge_attention_plan_costs(int64_t b, int64_t h, int64_t hkv, int64_t n, int64_t s, int64_t d,
                                                int causal, int64_t threads, int bwd, int64_t *costs, int64_t cap) {
    const int64_t st[4] = {h * n * d, n * d, d, 1}, kst[4] = {hkv * s * d, s * d, d, 1};
    attention_problem p = {
        .b = b, .h = h, .hkv = hkv, .n = n, .s = s, .d_qk = d, .d_v = d, .dt = OPF_F32, .causal = causal, .scale = 1.0};
    for (int i = 0; i < 4; i++) p.qs[i] = p.os[i] = p.dos[i] = p.dqs[i] = st[i], p.ks[i] = p.vs[i] = kst[i];
    if (bwd) {
        const attention_bwd_plan g = attention_bwd_plan_make(&p, threads);
        for (int64_t t = 0; t < g.tasks && t < cap; t++) costs[t] = attention_bwd_task_cost(&g, &p, t);
        return g.tasks;
    }
    const attention_fwd_plan f = attention_fwd_plan_make(attention_kernels_for(opf_isa_current()), &p, threads);
    for (int64_t t = 0; t < f.tasks && t < cap; t++) costs[t] = attention_fwd_task_cost(&f, &p, t);
    return f.tasks;
}
