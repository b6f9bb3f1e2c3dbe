/*
 * torch glue of the decoding attention op (forward only, no derivative):
 *   attention_decode(q (B,H,N,D), k_cache (B,Hkv,S_max,D), v_cache (B,Hkv,S_max,Dv), seq_lens (B,) int32|int64,
 *                    scale?, causal) -> out (B,H,N,Dv)
 * Checks, allocation and the call: the driver (csrc/kernels/attention_decode.c) decides the path, the plan and
 * its threads. float32 / bfloat16 / float16 run the flash-decoding kernels (16-bit caches converted to float32
 * a block of keys at a time, one rounding of the output); float64 the oracle.
 * Every input is read in place, whatever its strides (the caches are usually slices of a larger buffer).
 * out is laid out as (B, N, H, Dv) in memory and returned as its (B, H, N, Dv) view, as attention's, so
 * out.transpose(1, 2).reshape(B, N, H * Dv) is free.
 */
#include "../kernels/attention_decode.h"
#include "aoti.h"
#include "attention.h"
#include "namespace.h"
#include "opforge/op.h"

static const char ATTENTION_DECODE[] = OPF_QUALNAME("attention_decode");

static void check_4d(const char *arg, const opf_tensor *t, const opf_tensor *q, const char *dims) {
    opf_check_device(ATTENTION_DECODE, arg, t, "q", q);
    opf_check_float(ATTENTION_DECODE, arg, t);
    if (q != t) opf_check_same_dtype(ATTENTION_DECODE, arg, t, "q", q);
    opf_check_dims(ATTENTION_DECODE, arg, t, 4, dims);
}

static void attention_decode_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(q, stack, 0);
    OPF_ARG_TENSOR(k, stack, 1);
    OPF_ARG_TENSOR(v, stack, 2);
    OPF_ARG_TENSOR(lens, stack, 3);
    /* the boxed optional is unboxed before the first check that can throw: an error would leak the box */
    double scale = 0.0;
    const int has_scale = opf_arg_optional_double(stack[4], &scale);
    const int causal = opf_arg_bool(stack[5]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    opf_tensor q = opf_tensor_info(ATTENTION_DECODE, "q", q_h), kc = opf_tensor_info(ATTENTION_DECODE, "k_cache", k_h),
               vc = opf_tensor_info(ATTENTION_DECODE, "v_cache", v_h),
               sl = opf_tensor_info(ATTENTION_DECODE, "seq_lens", lens_h);
    check_4d("q", &q, &q, "(batch, heads, new tokens, head_dim)");
    check_4d("k_cache", &kc, &q, "(batch, kv heads, max length, head_dim)");
    check_4d("v_cache", &vc, &q, "(batch, kv heads, max length, head_dim)");
    const int64_t *qs = q.sizes, *ks = kc.sizes, *vs = vc.sizes;
    opf_check_size(ATTENTION_DECODE, "k_cache", &kc, 0, "q", &q, 0); /* batch */
    opf_check_size(ATTENTION_DECODE, "v_cache", &vc, 0, "q", &q, 0);
    opf_check_size(ATTENTION_DECODE, "v_cache", &vc, 1, "k_cache", &kc, 1); /* kv heads */
    if (ks[1] < 1 ? qs[1] != 0 : qs[1] % ks[1] != 0)
        opf_fail(ATTENTION_DECODE,
                 "argument 'k_cache' must have a number of heads dividing the %lld heads of 'q' (grouped-query "
                 "attention), got %lld",
                 (long long)qs[1], (long long)ks[1]);
    opf_check_size(ATTENTION_DECODE, "k_cache", &kc, 3, "q", &q, 3);        /* head_dim */
    opf_check_size(ATTENTION_DECODE, "v_cache", &vc, 2, "k_cache", &kc, 2); /* max length */
    opf_check_device(ATTENTION_DECODE, "seq_lens", &sl, "q", &q);
    const int lens_i64 = sl.dtype == aoti_torch_dtype_int64();
    if (!lens_i64 && sl.dtype != aoti_torch_dtype_int32())
        opf_fail(ATTENTION_DECODE, "argument 'seq_lens' must be int32 or int64, got %s", opf_dtype_name(sl.dtype));
    opf_check_dims(ATTENTION_DECODE, "seq_lens", &sl, 1, "(batch,)");
    opf_check_size(ATTENTION_DECODE, "seq_lens", &sl, 0, "q", &q, 0);
    attention_decode_problem p = {.b = qs[0],
                                  .h = qs[1],
                                  .hkv = ks[1],
                                  .n = qs[2],
                                  .s_max = ks[2],
                                  .d_qk = qs[3],
                                  .d_v = vs[3],
                                  .dt = opf_check_float(ATTENTION_DECODE, "q", &q),
                                  .q = q.data,
                                  .k = kc.data,
                                  .v = vc.data,
                                  .lens = sl.data,
                                  .lens_i64 = lens_i64,
                                  .lens_stride = sl.strides[0],
                                  .causal =
                                      causal ? ATTENTION_DECODE_CAUSAL_BOTTOM_RIGHT : ATTENTION_DECODE_CAUSAL_NONE};
    for (int d = 0; d < 4; d++) p.qs[d] = q.strides[d], p.ks[d] = kc.strides[d], p.vs[d] = vc.strides[d];
    p.scale = attention_scale(ATTENTION_DECODE, p.dt, has_scale, scale, qs[3]);
    const int meta = opf_is_meta(&q);
    for (int64_t b = 0; b < p.b && !meta; b++) { /* values: only a real tensor has them */
        const int64_t len = attention_decode_len(&p, b);
        if (len < 0 || len > p.s_max)
            opf_fail(ATTENTION_DECODE,
                     "argument 'seq_lens' must be in [0, %lld] (the max length of 'k_cache'), got %lld at %lld",
                     (long long)p.s_max, (long long)len, (long long)b);
    }
    const int64_t osz[4] = {p.b, p.h, p.n, p.d_v}, ost[4] = {p.n * p.h * p.d_v, p.d_v, p.h * p.d_v, 1};
    OPF_OWNED AtenTensorHandle out_h = opf_empty_strided(ATTENTION_DECODE, 4, osz, ost, q.dtype, &q);
    opf_tensor out = opf_tensor_info(ATTENTION_DECODE, "out", out_h);
    p.out = out.data;
    for (int d = 0; d < 4; d++) p.os[d] = out.strides[d];
    if (!meta) { /* the fake kernel's meta stand-ins are checked and shaped, nothing to compute */
        const attention_decode_plan plan = attention_decode_plan_make(&p, opf_num_threads());
        float *ws = NULL;
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace(ATTENTION_DECODE, attention_decode_workspace(&plan), &q, &ws);
        attention_decode_fwd(attention_decode_kernels_for(opf_isa_current()), &plan, &p, ws);
    }
    opf_log_call(ATTENTION_DECODE, t0, 4, (opf_tensor[]){q, kc, vc, out});
    OPF_RETURN(stack, 0, out_h);
}

static const opf_op_desc opf_attention_decode_ops[] = {
    {
        .schema = "attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, float? scale=None, "
                  "bool causal=False) -> Tensor",
        .cpu = attention_decode_cpu,
        /* as attention_decode_cpu allocates it, (B, N, H, Dv), returned as its (B, H, N, Dv) view */
        .shape = "[q[0], q[2], q[1], v_cache[-1]] perm=0,2,1,3",
        /* inference only: no backward; an input that requires grad is refused by the autograd wiring */
        .autocast = OPF_AUTOCAST_LOWER,
        /* an upper bound: every key of the cache, Dv = D */
        .flops = "4*numel(q)*size(k_cache,2)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_attention_decode_ops);
OPF_REGISTER_FAMILY(attention_decode_variants);

OPF_AOTI_SHIM(attention_decode, 1,
              (AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle seq_lens,
               double *scale, int32_t causal),
              q, k_cache, v_cache, seq_lens, scale, causal);
