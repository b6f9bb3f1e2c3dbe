/*
 * torch glue of the fused LM head + cross-entropy (csrc/kernels/linear_cross_entropy.h):
 *   linear_cross_entropy(hidden (T,H), weight (V,H), target (T) int64, bias (V)?, ignore_index,
 *                        label_smoothing, reduction (1 mean, 2 sum), softcap?, compute_grad, keep_dlogits)
 *       -> (loss [], lse (T) float32, dhidden (T,H), dweight (V,H), dbias (V), dlogits (T,V))
 *       compute_grad: the gradients of the loss (for a gradient of 1) are made in the same call,
 *       else those three are empty; the backward scales them by the scalar gradient.
 *       keep_dlogits (float32 and bfloat16 hidden; not with compute_grad): the loss's gradient with
 *       respect to the logits (for a gradient of 1), of hidden's dtype, else empty; the backward's two
 *       GEMMs read it, times the scalar gradient.
 *   linear_cross_entropy_backward(grad [], hidden, weight, target, bias?, lse, dhidden, dweight, dbias, ...,
 *                                 dlogits?)
 *       -> (dhidden, dweight, dbias): grad * the forward's gradients, from the kept dlogits, or (a
 *       forward that made neither) recomputed from lse.
 *   linear_cross_entropy_backward_(..., dhidden!, dweight!, dbias!, ...) -> (): the forward's gradients
 *       of hidden's dtype (float32 and float64) scaled by grad where they are, for the autograd wiring to
 *       return them (when nothing else refers to them): the backward's peak then holds one copy of the
 *       gradients, not the forward's and new ones; at grad 1 (loss.backward()) nothing is written.
 *   linear_cross_entropy_none(hidden, weight, target, bias?, ignore_index, label_smoothing, softcap?)
 *       -> (loss (T), lse (T) float32)
 *   linear_cross_entropy_none_backward(grad (T), hidden, weight, target, bias?, lse, ...)
 *       -> (dhidden, dweight, dbias): recomputed from lse with each token's gradient (the per-token
 *       gradients are unknown in the forward, so nothing there can be precomputed).
 * The loss, its gradient (grad) and the forward's gradients are promote(hidden, float32)
 * (linear_cross_entropy_loss_dtype: float32 for 16-bit hidden); the backward's are hidden's dtype.
 * Checks, allocation and the calls. hidden, weight, bias and target are read in place through their
 * strides; the outputs are contiguous.
 */
#include <math.h>

#include "../kernels/linear_cross_entropy.h"
#include "aoti.h"
#include "namespace.h"
#include "provider.h"
#include "opforge/op.h"

static const char LCE[] = OPF_QUALNAME("linear_cross_entropy");
static const char LCEB[] = OPF_QUALNAME("linear_cross_entropy_backward");
static const char LCEB_INPLACE[] = OPF_QUALNAME("linear_cross_entropy_backward_");
static const char LCEN[] = OPF_QUALNAME("linear_cross_entropy_none");
static const char LCENB[] = OPF_QUALNAME("linear_cross_entropy_none_backward");

extern const opf_enum_desc opf_enum_reduction; /* cross_entropy.c: torch's Reduction codes */

typedef struct linear_cross_entropy_args {
    opf_tensor hidden, weight, target, bias;
    int has_bias;
    linear_cross_entropy_problem p;
} linear_cross_entropy_args;

/* every argument of the forward, checked before anything is computed */
static linear_cross_entropy_args check_lce(const char *op, AtenTensorHandle h_h, AtenTensorHandle w_h,
                                           AtenTensorHandle t_h, AtenTensorHandle b_h, int64_t ignore_index,
                                           double label_smoothing, int64_t reduction, int has_softcap, double softcap) {
    linear_cross_entropy_args a = {.hidden = opf_tensor_info(op, "hidden", h_h),
                                   .weight = opf_tensor_info(op, "weight", w_h),
                                   .target = opf_tensor_info(op, "target", t_h),
                                   .has_bias = b_h != NULL};
    opf_check_device(op, "hidden", &a.hidden, "hidden", &a.hidden);
    opf_dtype dt = opf_check_float(op, "hidden", &a.hidden);
    opf_check_device(op, "weight", &a.weight, "hidden", &a.hidden);
    opf_check_float(op, "weight", &a.weight);
    opf_check_same_dtype(op, "weight", &a.weight, "hidden", &a.hidden);
    opf_check_device(op, "target", &a.target, "hidden", &a.hidden);
    opf_check_dims(op, "hidden", &a.hidden, 2, "(tokens, hidden)");
    opf_check_dims(op, "weight", &a.weight, 2, "(vocab, hidden)");
    const int64_t t = a.hidden.sizes[0], h = a.hidden.sizes[1], v = a.weight.sizes[0];
    opf_check_size(op, "weight", &a.weight, 1, "hidden", &a.hidden, 1);
    if (a.target.dtype != aoti_torch_dtype_int64())
        opf_fail(op, "argument 'target' must be int64 (class indices), got %s", opf_dtype_name(a.target.dtype));
    opf_check_dims(op, "target", &a.target, 1, "(tokens,)");
    opf_check_size(op, "target", &a.target, 0, "hidden", &a.hidden, 0);
    if (a.has_bias) {
        a.bias = opf_tensor_info(op, "bias", b_h);
        opf_check_device(op, "bias", &a.bias, "hidden", &a.hidden);
        opf_check_float(op, "bias", &a.bias);
        opf_check_same_dtype(op, "bias", &a.bias, "hidden", &a.hidden);
        opf_check_dims(op, "bias", &a.bias, 1, "(vocab,)");
        opf_check_size(op, "bias", &a.bias, 0, "weight", &a.weight, 0);
    }
    if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
        opf_fail(op, "argument 'label_smoothing' must be in [0, 1], got %g", label_smoothing);
    if (has_softcap && !(softcap > 0.0 && isfinite(softcap)))
        opf_fail(op, "argument 'softcap' must be a finite number > 0 (or None), got %g", softcap);
    opf_check_enum(op, "reduction", &opf_enum_reduction, reduction);
    a.p = (linear_cross_entropy_problem){.t = t,
                                         .h = h,
                                         .v = v,
                                         .dt = dt,
                                         .loss_dt = linear_cross_entropy_loss_dtype(dt),
                                         .grads_dt = dt,
                                         .hidden = a.hidden.data,
                                         .hidden_strides = {a.hidden.strides[0], a.hidden.strides[1]},
                                         .weight = a.weight.data,
                                         .weight_strides = {a.weight.strides[0], a.weight.strides[1]},
                                         .target = a.target.data,
                                         .target_stride = a.target.strides[0],
                                         .bias = a.has_bias ? a.bias.data : NULL,
                                         .bias_stride = a.has_bias ? a.bias.strides[0] : 0,
                                         .ignore_index = ignore_index,
                                         .label_smoothing = label_smoothing,
                                         .softcap = has_softcap ? softcap : 0.0,
                                         .reduction = (int)reduction};
    if (!opf_is_meta(&a.hidden)) { /* the values: a meta tensor has none to read */
        int64_t bad = linear_cross_entropy_bad_target(&a.p);
        if (bad >= 0)
            opf_fail(op,
                     "argument 'target' must hold class indices in [0, %lld) or ignore_index (%lld), got %lld at "
                     "position %lld",
                     (long long)v, (long long)ignore_index, (long long)a.p.target[bad * a.p.target_stride],
                     (long long)bad);
    }
    return a;
}

/* the plan claimed where the GEMM provider runs a backward's products on kept dlogits itself (no
 * workspace for them), rerun unclaimed where it declines one after all: provider.h's OPF_RUN_CLAIMED */
static void run(const char *op, const linear_cross_entropy_args *a) {
    const gemm_kernels *gemm = gemm_kernels_for(opf_isa_current());
    const linear_cross_entropy_kernels *kern = linear_cross_entropy_kernels_for(opf_isa_current());
    linear_cross_entropy_plan plan;
    OPF_RUN_CLAIMED(op, &a->hidden, plan, linear_cross_entropy_workspace,
                    linear_cross_entropy_plan_make(gemm, &a->p, opf_num_threads()),
                    linear_cross_entropy_plan_claim(&plan, &a->p),
                    linear_cross_entropy_run(kern, &plan, &a->p, ws, wsn), LINEAR_CROSS_ENTROPY_ERR_DECLINED);
}

/* contiguous (1-d or 2-d; strides of size-1 dims do not matter) */
static int row_major(const opf_tensor *t) {
    int64_t expect = 1;
    if (t->numel == 0) return 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        if (t->sizes[d] > 1 && t->strides[d] != expect) return 0;
        expect *= t->sizes[d];
    }
    return 1;
}

/* torch's code of the loss's dtype (float32 or float64) */
static int32_t loss_dtype(const linear_cross_entropy_args *a) {
    return a->p.loss_dt == OPF_F64 ? aoti_torch_dtype_float64() : aoti_torch_dtype_float32();
}

/* the gradients' tensors in p.grads_dt: (T,H), (V,H), (V), or empty where not made */
typedef struct grads {
    AtenTensorHandle dh, dw, db;
} grads;

static void alloc_grads(const char *op, linear_cross_entropy_args *a, int make, grads *g) {
    int64_t empty = 0;
    const int32_t dt = a->p.grads_dt == a->p.dt ? a->hidden.dtype : loss_dtype(a);
    g->dh = make ? opf_empty(op, 2, a->hidden.sizes, dt, &a->hidden) : opf_empty(op, 1, &empty, dt, &a->hidden);
    g->dw = make ? opf_empty(op, 2, a->weight.sizes, dt, &a->hidden) : opf_empty(op, 1, &empty, dt, &a->hidden);
    g->db = make && a->has_bias ? opf_empty(op, 1, &a->p.v, dt, &a->hidden) : opf_empty(op, 1, &empty, dt, &a->hidden);
    if (!make) return;
    a->p.dhidden = opf_tensor_info(op, "dhidden", g->dh).data;
    a->p.dweight = opf_tensor_info(op, "dweight", g->dw).data;
    a->p.dbias = a->has_bias ? opf_tensor_info(op, "dbias", g->db).data : NULL;
}

/* ---- forward ----------------------------------------------------------------------------------- */

static void forward_impl(StableIValue *stack, int per_token) {
    const char *op = per_token ? LCEN : LCE;
    OPF_ARG_TENSOR(hidden, stack, 0);
    OPF_ARG_TENSOR(weight, stack, 1);
    OPF_ARG_TENSOR(target, stack, 2);
    OPF_OWNED AtenTensorHandle bias_h = opf_arg_optional_tensor(stack[3]);
    double softcap = 0.0;
    const int has_softcap = opf_arg_optional_double(stack[per_token ? 6 : 7], &softcap);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const int64_t ignore_index = opf_arg_int(stack[4]);
    const double label_smoothing = opf_arg_double(stack[5]);
    const int64_t reduction = per_token ? LINEAR_CROSS_ENTROPY_NONE : opf_arg_int(stack[6]);
    const int compute_grad = per_token ? 0 : opf_arg_bool(stack[8]);
    const int keep = per_token ? 0 : opf_arg_bool(stack[9]);
    if (!per_token && reduction != LINEAR_CROSS_ENTROPY_MEAN && reduction != LINEAR_CROSS_ENTROPY_SUM)
        opf_fail(op, "argument 'reduction' must be 1 (mean) or 2 (sum) (reduction none is %s), got %lld", LCEN,
                 (long long)reduction);
    linear_cross_entropy_args a = check_lce(op, hidden_h, weight_h, target_h, bias_h, ignore_index, label_smoothing,
                                            reduction, has_softcap, softcap);
    if (keep && compute_grad)
        opf_fail(op, "arguments 'compute_grad' and 'keep_dlogits' exclude each other (the gradients are made in the "
                     "forward, or from the kept dlogits in the backward), got both true");
    if (keep && a.p.dt != OPF_F32 && a.p.dt != OPF_BF16)
        opf_fail(op, "argument 'keep_dlogits' needs float32 or bfloat16 hidden (dlogits is of its dtype), got %s",
                 opf_dtype_name(a.hidden.dtype));
    OPF_OWNED AtenTensorHandle loss_h = opf_empty(op, per_token ? 1 : 0, &a.p.t, loss_dtype(&a), &a.hidden);
    OPF_OWNED AtenTensorHandle lse_h = opf_empty(op, 1, &a.p.t, aoti_torch_dtype_float32(), &a.hidden);
    grads g = {0};
    a.p.grads_dt = a.p.loss_dt; /* made for a unit loss gradient: the backward scales and rounds them once */
    if (!per_token) alloc_grads(op, &a, compute_grad, &g);
    OPF_OWNED AtenTensorHandle dh_h = g.dh, dw_h = g.dw, db_h = g.db;
    int64_t empty = 0, tv[2] = {a.p.t, a.p.v};
    OPF_OWNED AtenTensorHandle dl_h =
        per_token ? NULL : opf_empty(op, keep ? 2 : 1, keep ? tv : &empty, a.hidden.dtype, &a.hidden);
    if (keep) a.p.dlogits = opf_tensor_info(op, "dlogits", dl_h).data;
    a.p.loss = opf_tensor_info(op, "loss", loss_h).data;
    a.p.lse = opf_tensor_info(op, "lse", lse_h).data;
    if (!opf_is_meta(&a.hidden)) run(op, &a);
    opf_log_call(op, t0, 3, (opf_tensor[]){a.hidden, a.weight, a.target});
    OPF_RETURN(stack, 0, loss_h);
    OPF_RETURN(stack, 1, lse_h);
    if (per_token) return;
    OPF_RETURN(stack, 2, dh_h);
    OPF_RETURN(stack, 3, dw_h);
    OPF_RETURN(stack, 4, db_h);
    OPF_RETURN(stack, 5, dl_h);
}

static void linear_cross_entropy_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) { forward_impl(stack, 0); }
static void linear_cross_entropy_none_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) { forward_impl(stack, 1); }

/* ---- backward ---------------------------------------------------------------------------------- */

/* grad, hidden, weight, target, bias?, lse, [dhidden, dweight, dbias,] ignore_index, label_smoothing,
 * [reduction,] softcap?, needs (bit 0 dhidden, bit 1 dweight, bit 2 dbias: the gradients not wanted are
 * returned uncomputed, their GEMMs skipped)[, dlogits?] */
static void backward_impl(StableIValue *stack, int per_token, int inplace) {
    const char *op = per_token ? LCENB : inplace ? LCEB_INPLACE : LCEB;
    const int k = per_token ? 6 : 9; /* the first non-tensor argument */
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(hidden, stack, 1);
    OPF_ARG_TENSOR(weight, stack, 2);
    OPF_ARG_TENSOR(target, stack, 3);
    OPF_OWNED AtenTensorHandle bias_h = opf_arg_optional_tensor(stack[4]);
    OPF_ARG_TENSOR(lse, stack, 5);
    OPF_OWNED AtenTensorHandle sdh_h = per_token ? NULL : (AtenTensorHandle)stack[6];
    OPF_OWNED AtenTensorHandle sdw_h = per_token ? NULL : (AtenTensorHandle)stack[7];
    OPF_OWNED AtenTensorHandle sdb_h = per_token ? NULL : (AtenTensorHandle)stack[8];
    double softcap = 0.0;
    const int has_softcap = opf_arg_optional_double(stack[per_token ? k + 2 : k + 3], &softcap);
    const int64_t needs = opf_arg_int(stack[per_token ? k + 3 : k + 4]);
    OPF_OWNED AtenTensorHandle sdl_h = per_token ? NULL : opf_arg_optional_tensor(stack[k + 5]);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const int64_t ignore_index = opf_arg_int(stack[k]);
    const double label_smoothing = opf_arg_double(stack[k + 1]);
    const int64_t reduction = per_token ? LINEAR_CROSS_ENTROPY_NONE : opf_arg_int(stack[k + 2]);
    if (!per_token && reduction != LINEAR_CROSS_ENTROPY_MEAN && reduction != LINEAR_CROSS_ENTROPY_SUM)
        opf_fail(op, "argument 'reduction' must be 1 (mean) or 2 (sum), got %lld", (long long)reduction);
    linear_cross_entropy_args a = check_lce(op, hidden_h, weight_h, target_h, bias_h, ignore_index, label_smoothing,
                                            reduction, has_softcap, softcap);
    opf_tensor g = opf_tensor_info(op, "grad", grad_h), l = opf_tensor_info(op, "lse", lse_h);
    opf_check_device(op, "grad", &g, "hidden", &a.hidden);
    opf_check_dtype(op, "grad", &g, OPF_DTYPE_BIT(a.p.loss_dt)); /* the loss's */
    opf_tensor want_g = {.ndim = per_token ? 1 : 0, .sizes = &a.p.t}, want_lse = {.ndim = 1, .sizes = &a.p.t};
    opf_check_same_shape(op, "grad", &g, "the loss", &want_g);
    opf_check_device(op, "lse", &l, "hidden", &a.hidden);
    opf_check_same_shape(op, "lse", &l, "(tokens)", &want_lse);
    if (l.dtype != aoti_torch_dtype_float32() || (a.p.t > 1 && l.strides[0] != 1))
        opf_fail(op, "argument 'lse' must be the contiguous float32 log-sum-exp returned by the forward, got %s",
                 opf_dtype_name(l.dtype));
    /* the forward's gradients (mean / sum): all three made, or none (empty) */
    opf_tensor sdh = {0}, sdw = {0}, sdb = {0};
    int saved = 0; /* made: 2-d like hidden; not made: the empty 1-d tensors */
    if (!per_token) {
        sdh = opf_tensor_info(op, "dhidden", sdh_h), sdw = opf_tensor_info(op, "dweight", sdw_h);
        sdb = opf_tensor_info(op, "dbias", sdb_h);
        saved = sdh.ndim == 2 || sdw.ndim == 2;
        if (saved) { /* in the loss's dtype (forward_impl) */
            opf_check_same_shape(op, "dhidden", &sdh, "hidden", &a.hidden);
            opf_check_same_shape(op, "dweight", &sdw, "weight", &a.weight);
            opf_check_dtype(op, "dhidden", &sdh, OPF_DTYPE_BIT(a.p.loss_dt));
            opf_check_dtype(op, "dweight", &sdw, OPF_DTYPE_BIT(a.p.loss_dt));
            if (a.has_bias) {
                opf_check_same_shape(op, "dbias", &sdb, "bias", &a.bias);
                opf_check_dtype(op, "dbias", &sdb, OPF_DTYPE_BIT(a.p.loss_dt));
            }
            if (!row_major(&sdh) || !row_major(&sdw) || (a.has_bias && !row_major(&sdb)))
                opf_fail(op, "arguments 'dhidden', 'dweight' and 'dbias' must be the contiguous gradients returned by "
                             "the forward");
        }
    }
    /* the forward's kept dlogits (T, V) of hidden's dtype, or empty / None */
    opf_tensor sdl = sdl_h ? opf_tensor_info(op, "dlogits", sdl_h) : (opf_tensor){0};
    const int kept = sdl.ndim == 2;
    if (sdl_h && !kept && sdl.numel != 0)
        opf_fail(op, "argument 'dlogits' must be the (tokens, vocab) dlogits the forward kept, or empty, got %lld dims",
                 (long long)sdl.ndim);
    if (kept) {
        opf_tensor want_dl = {.ndim = 2, .sizes = (int64_t[2]){a.p.t, a.p.v}};
        opf_check_same_shape(op, "dlogits", &sdl, "(tokens, vocab)", &want_dl);
        opf_check_device(op, "dlogits", &sdl, "hidden", &a.hidden);
        opf_check_same_dtype(op, "dlogits", &sdl, "hidden", &a.hidden);
        if (saved || !row_major(&sdl) || (a.p.dt != OPF_F32 && a.p.dt != OPF_BF16))
            opf_fail(op, "argument 'dlogits' must be the contiguous float32 or bfloat16 dlogits a forward without "
                         "gradients kept (dhidden, dweight and dbias empty)");
    }
    grads out = {0};
    if (inplace) { /* the forward's gradients, in hidden's dtype, become the results: scaled where they are */
        if (!saved || a.p.dt != a.p.loss_dt)
            opf_fail(op,
                     "arguments 'dhidden', 'dweight' and 'dbias' must be the gradients a forward with "
                     "compute_grad made for %s hidden (the loss's dtype, so they are scaled where they are), got "
                     "%s",
                     opf_dtype_name(a.hidden.dtype), saved ? opf_dtype_name(sdh.dtype) : "empty tensors");
        a.p.dhidden = sdh.data, a.p.dweight = sdw.data, a.p.dbias = a.has_bias ? sdb.data : NULL;
    } else {
        alloc_grads(op, &a, 1, &out);
    }
    OPF_OWNED AtenTensorHandle dh_h = out.dh, dw_h = out.dw, db_h = out.db; /* none in place */
    if (!(needs & 1)) a.p.dhidden = NULL;
    if (!(needs & 2)) a.p.dweight = NULL;
    if (!(needs & 4)) a.p.dbias = NULL;
    if (!opf_is_meta(&a.hidden)) {
        if (saved) {
            const convert_kernels *cvt = convert_kernels_for(opf_isa_current());
            /* in place at a gradient of 1 (loss.backward()) the results are the forward's as they are */
            if (!inplace || opf_load_elem(g.data, 0, a.p.loss_dt) != 1.0) {
                if (a.p.dhidden)
                    linear_cross_entropy_scale(cvt, a.p.dt, a.p.dhidden, a.p.loss_dt, sdh.data, sdh.numel, g.data);
                if (a.p.dweight)
                    linear_cross_entropy_scale(cvt, a.p.dt, a.p.dweight, a.p.loss_dt, sdw.data, sdw.numel, g.data);
                if (a.p.dbias)
                    linear_cross_entropy_scale(cvt, a.p.dt, a.p.dbias, a.p.loss_dt, sdb.data, sdb.numel, g.data);
            }
        } else {
            a.p.lse = l.data;
            a.p.lse_given = 1;
            a.p.grad = g.data;
            a.p.grad_stride = per_token && a.p.t > 0 ? g.strides[0] : 0;
            a.p.dlogits = kept ? sdl.data : NULL;
            run(op, &a);
        }
    }
    opf_log_call(op, t0, 3, (opf_tensor[]){g, a.hidden, a.weight});
    if (inplace) return; /* "-> ()" */
    OPF_RETURN(stack, 0, dh_h);
    OPF_RETURN(stack, 1, dw_h);
    OPF_RETURN(stack, 2, db_h);
}

static void linear_cross_entropy_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    backward_impl(stack, 0, 0);
}
static void linear_cross_entropy_backward_inplace_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    backward_impl(stack, 0, 1);
}
static void linear_cross_entropy_none_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    backward_impl(stack, 1, 0);
}

/* Autocast runs the op in the autocast dtype, as torch's autocast runs F.cross_entropy(F.linear(h, w), t):
 * the GEMMs on 16-bit operands (float32 hidden and weights cast, their gradients back through the cast), the
 * log-sum-exp and the loss in float32, the loss's dtype for 16-bit hidden (a float16 loss would overflow
 * GradScaler's scaled gradient: 65536 is past float16's range). The former float32 policy ran float32 GEMMs where
 * eager's are 16-bit: fwd+bwd at 2048 tokens x 512 -> vocab 8192 under bfloat16 autocast, 0.38x eager on an
 * Intel AMX machine, 0.65x on one Zen 4 core (AVX512-BF16), where this policy runs at 1.15x. */
/* The logits block's floats and the fewest tokens of a chunk: the blocks span the vocabulary exactly
 * when min(max(tokens, 1), chunk tokens) * max(vocab, 1) <= the floats (linear_cross_entropy_vocab_in_one_block,
 * checked in tests/c/test_linear_cross_entropy.c). The Python layer then asks the forward for the gradients
 * (compute_grad), which it makes on the way at no extra GEMM; it compares sizes itself, so that a compiled
 * graph (whose sizes may be symbolic) makes the same choice. */
OPF_EXPORT int64_t opforge_linear_cross_entropy_chunk_tokens(void) { return LINEAR_CROSS_ENTROPY_CHUNK_TOKENS; }
OPF_EXPORT int64_t opforge_linear_cross_entropy_block_floats(void) { return LINEAR_CROSS_ENTROPY_BLOCK_FLOATS; }
OPF_EXPORT int64_t opforge_linear_cross_entropy_grad_block_floats_max(void) {
    return LINEAR_CROSS_ENTROPY_GRAD_BLOCK_FLOATS_MAX;
}

static const opf_op_desc opf_linear_cross_entropy_ops[] = {
    {
        .schema = "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
                  "float label_smoothing, int reduction, float? softcap, bool compute_grad, bool keep_dlogits=False) "
                  "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        .cpu = linear_cross_entropy_cpu,
        .shape = "[] dtype=promote(hidden,float32); [target[0]] dtype=float32; "
                 "[hidden[:]] dtype=promote(hidden,float32) if compute_grad; "
                 "[weight[:]] dtype=promote(hidden,float32) if compute_grad; "
                 "[bias[:]] dtype=promote(hidden,float32) if compute_grad and bias; "
                 "[hidden[0],weight[0]] dtype=hidden if keep_dlogits",
        .backward = "linear_cross_entropy_backward",
        .backward_args = "grad0,hidden,weight,target,bias,out1,out2!hidden,out3!weight,out4!bias,ignore_index,"
                         "label_smoothing,reduction,softcap,needs,out5",
        .backward_grads = "hidden,weight,bias",
        .autocast = OPF_AUTOCAST_LOWER, /* see the note above the table */
        .flops = "2*numel(hidden)*size(weight,0)",
        .meta = 1,
    },
    {
        .schema = "linear_cross_entropy_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor target, "
                  "Tensor? bias, Tensor lse, Tensor dhidden, Tensor dweight, Tensor dbias, int ignore_index, "
                  "float label_smoothing, int reduction, float? softcap, int needs=7, Tensor? dlogits=None) "
                  "-> (Tensor, Tensor, Tensor)",
        .cpu = linear_cross_entropy_backward_cpu,
        .shape = "[hidden[:]]; [weight[:]] dtype=hidden; [bias[:]] dtype=hidden if bias",
        .flops = "4*numel(hidden)*size(weight,0)",
        .meta = 1,
    },
    {
        .schema = "linear_cross_entropy_backward_(Tensor grad, Tensor hidden, Tensor weight, Tensor target, "
                  "Tensor? bias, Tensor lse, Tensor(a!) dhidden, Tensor(b!) dweight, Tensor(c!) dbias, "
                  "int ignore_index, float label_smoothing, int reduction, float? softcap, int needs=7, "
                  "Tensor? dlogits=None) -> ()",
        .cpu = linear_cross_entropy_backward_inplace_cpu,
        .shape = "",
        .flops = "numel(weight)",
        .meta = 1,
    },
    {
        .schema = "linear_cross_entropy_none(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
                  "int ignore_index, float label_smoothing, float? softcap) -> (Tensor, Tensor)",
        .cpu = linear_cross_entropy_none_cpu,
        .shape = "[target[0]] dtype=promote(hidden,float32); [target[0]] dtype=float32",
        .backward = "linear_cross_entropy_none_backward",
        .backward_args = "grad0,hidden,weight,target,bias,out1,ignore_index,label_smoothing,softcap,needs",
        .backward_grads = "hidden,weight,bias",
        .autocast = OPF_AUTOCAST_LOWER, /* see the note above the table */
        .flops = "2*numel(hidden)*size(weight,0)",
        .meta = 1,
    },
    {
        .schema = "linear_cross_entropy_none_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor target, "
                  "Tensor? bias, Tensor lse, int ignore_index, float label_smoothing, float? softcap, int needs=7) "
                  "-> (Tensor, Tensor, Tensor)",
        .cpu = linear_cross_entropy_none_backward_cpu,
        .shape = "[hidden[:]]; [weight[:]] dtype=hidden; [bias[:]] dtype=hidden if bias",
        .flops = "4*numel(hidden)*size(weight,0)",
        .meta = 1,
    },
    OPF_OP_END,
};

OPF_REGISTER_OPS(opf_linear_cross_entropy_ops);
OPF_REGISTER_FAMILY(linear_cross_entropy_variants);

OPF_AOTI_SHIM(linear_cross_entropy, 6,
              (AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target, AtenTensorHandle *bias,
               int64_t ignore_index, double label_smoothing, int64_t reduction, double *softcap, int32_t compute_grad,
               int32_t keep_dlogits),
              hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, compute_grad,
              keep_dlogits);
OPF_AOTI_SHIM(linear_cross_entropy_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target,
               AtenTensorHandle *bias, AtenTensorHandle lse, AtenTensorHandle dhidden, AtenTensorHandle dweight,
               AtenTensorHandle dbias, int64_t ignore_index, double label_smoothing, int64_t reduction, double *softcap,
               int64_t needs, AtenTensorHandle *dlogits),
              grad, hidden, weight, target, bias, lse, dhidden, dweight, dbias, ignore_index, label_smoothing,
              reduction, softcap, needs, dlogits);
OPF_AOTI_SHIM(linear_cross_entropy_backward_, 0,
              (AtenTensorHandle grad, AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target,
               AtenTensorHandle *bias, AtenTensorHandle lse, AtenTensorHandle dhidden, AtenTensorHandle dweight,
               AtenTensorHandle dbias, int64_t ignore_index, double label_smoothing, int64_t reduction, double *softcap,
               int64_t needs, AtenTensorHandle *dlogits),
              grad, hidden, weight, target, bias, lse, dhidden, dweight, dbias, ignore_index, label_smoothing,
              reduction, softcap, needs, dlogits);
OPF_AOTI_SHIM(linear_cross_entropy_none, 2,
              (AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target, AtenTensorHandle *bias,
               int64_t ignore_index, double label_smoothing, double *softcap),
              hidden, weight, target, bias, ignore_index, label_smoothing, softcap);
OPF_AOTI_SHIM(linear_cross_entropy_none_backward, 3,
              (AtenTensorHandle grad, AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target,
               AtenTensorHandle *bias, AtenTensorHandle lse, int64_t ignore_index, double label_smoothing,
               double *softcap, int64_t needs),
              grad, hidden, weight, target, bias, lse, ignore_index, label_smoothing, softcap, needs);
