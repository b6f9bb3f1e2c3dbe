/*
 * AOTInductor C shims: one exported C function per op, in the form that
 * torch._inductor's `aot_inductor.custom_ops_to_c_shims` expects, so that a
 * model compiled by AOTInductor calls the op's CPU kernel directly -- no
 * dispatcher, no Python, no proxy executor, and no registration: a process
 * that loads such a model needs libopforge.so, not `import opforge`.
 *
 * Calling convention (torch 2.13, _inductor/codegen/cpp_wrapper_cpu.py,
 * c_type_for_prim_type and generate_c_shim_fallback_kernel):
 *   Tensor -> AtenTensorHandle (borrowed)      Tensor? -> AtenTensorHandle * (NULL: None)
 *   float  -> double                           float?  -> double *
 *   int    -> int64_t                          int?    -> int64_t *
 *   bool   -> int32_t                          bool?   -> int32_t *
 * then one `AtenTensorHandle *retN` per output, which receives a new owning handle.
 *
 * Names. Inductor calls `aoti_torch_cpu_<op>`, the op's name without its
 * namespace. The symbol defined here is `<namespace>_aoti_cpu_<op>`
 * (OPF_NAMESPACE, a build parameter), so that two builds under different
 * namespaces cannot collide; the declaration that python/opforge/aoti.py
 * generates from the schema binds inductor's name to it with an asm label:
 *   AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, ...) __asm__("opforge_aoti_cpu_rms_norm")
 *
 * Errors. The boxed kernel raises with aoti_torch_check, which throws a C++
 * exception (c10::Error). C cannot catch it, and torch's C ABI has no entry
 * that calls a function and turns its exception into an error code
 * (torch_call_dispatcher does, but through the dispatcher's autograd and
 * autocast kernels, which opforge registers in Python). So an op error leaves
 * the shim as that exception, unwinding through these frames (built with
 * -fexceptions; every handle is owned by a cleanup by then) into the caller.
 * In an AOTInductor model the caller is generated C++ that runs inside
 * AOTInductorModelContainerRun, which catches every exception and returns an
 * error code: Python's runner raises RuntimeError and the op's message goes to
 * stderr. A C host calling a shim itself must be built with -fexceptions, or
 * an op error terminates the process. A non-zero return reports a failure
 * before the kernel ran (no memory for an argument, the runtime's
 * initialisation refused OPFORGE_ISA / OPFORGE_LOG_* from the environment).
 */
#include <stdlib.h>
#include <string.h>

#include "namespace.h"
#include "opforge/op.h"

#define OPF_AOTI_FAILURE 1
#define OPF_AOTI_MAX_ARGS 16

int opf_init_once(char *err, size_t errlen);                   /* glue.c */
const opf_op_desc *opforge_op_table(char *err, size_t errlen); /* ops.c */

/* ---- arguments: the shim's C values as a boxed stack ------------------------- */

enum { SLOT_VALUE, SLOT_TENSOR, SLOT_BOX_TENSOR, SLOT_BOX_VALUE };

typedef struct shim_args {
    StableIValue v[OPF_AOTI_MAX_ARGS];
    unsigned char kind[OPF_AOTI_MAX_ARGS]; /* what to release if the kernel never gets them */
    int n, failed;
} shim_args;

static void push(shim_args *a, StableIValue v, int kind) {
    if (a->n == OPF_AOTI_MAX_ARGS) {
        a->failed = 1;
        return;
    }
    a->v[a->n] = v;
    a->kind[a->n++] = (unsigned char)kind;
}

/* A `T?` value is a pointer to a heap StableIValue, which the kernel frees as
 * glue.c's unbox_optional does: with torch's allocator where torch has one. */
static StableIValue *new_box(StableIValue v) {
    StableIValue *box = NULL;
    if (torch_new_stable_ivalue) {
        if (torch_new_stable_ivalue(&box) != OPF_AOTI_SUCCESS) box = NULL;
    } else {
        box = malloc(sizeof *box);
    }
    if (box) *box = v;
    return box;
}

static void free_box(StableIValue *box) {
    if (torch_delete_stable_ivalue)
        torch_delete_stable_ivalue(box);
    else
        free(box);
}

/* The kernel owns its tensor arguments; the caller keeps its own: a new handle to the same tensor. */
static AtenTensorHandle new_handle(shim_args *a, AtenTensorHandle t) {
    AtenTensorHandle h = NULL;
    if (t == NULL || aoti_torch_new_tensor_handle(t, &h) != OPF_AOTI_SUCCESS) a->failed = 1;
    return h;
}

static void push_boxed(shim_args *a, StableIValue v, int kind) {
    StableIValue *box = new_box(v);
    if (box == NULL) {
        a->failed = 1;
        if (kind == SLOT_BOX_TENSOR) aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)v);
        return;
    }
    push(a, (StableIValue)(uintptr_t)box, kind);
}

static StableIValue bits_of(double d) {
    StableIValue v = 0;
    memcpy(&v, &d, sizeof d);
    return v;
}

static void arg_tensor(shim_args *a, AtenTensorHandle t) {
    AtenTensorHandle h = new_handle(a, t);
    if (h) push(a, (StableIValue)(uintptr_t)h, SLOT_TENSOR);
}

static void arg_optional_tensor(shim_args *a, AtenTensorHandle *t) {
    if (t == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    AtenTensorHandle h = new_handle(a, *t);
    if (h) push_boxed(a, (StableIValue)(uintptr_t)h, SLOT_BOX_TENSOR);
}

static void arg_double(shim_args *a, double v) { push(a, bits_of(v), SLOT_VALUE); }
static void arg_int(shim_args *a, int64_t v) { push(a, (StableIValue)v, SLOT_VALUE); }
static void arg_bool(shim_args *a, int32_t v) { push(a, v != 0, SLOT_VALUE); }

static void arg_optional_double(shim_args *a, double *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, bits_of(*v), SLOT_BOX_VALUE);
}

static void arg_optional_int(shim_args *a, int64_t *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, (StableIValue)*v, SLOT_BOX_VALUE);
}

static void arg_optional_bool(shim_args *a, int32_t *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, *v != 0, SLOT_BOX_VALUE);
}

/* The C type of a parameter picks how it is boxed: the parameter list is the only per-op fact. */
#define OPF_AOTI_ARG(a, v) \
    _Generic((v),                                              \
        AtenTensorHandle: arg_tensor,                          \
        AtenTensorHandle *: arg_optional_tensor,               \
        double: arg_double,                                    \
        double *: arg_optional_double,                         \
        int64_t: arg_int,                                      \
        int64_t *: arg_optional_int,                           \
        int32_t: arg_bool,                                     \
        int32_t *: arg_optional_bool)(a, v)

static void release(shim_args *a) {
    for (int i = 0; i < a->n; i++) {
        StableIValue v = a->v[i];
        if (a->kind[i] == SLOT_TENSOR) aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)v);
        if (a->kind[i] == SLOT_BOX_TENSOR || a->kind[i] == SLOT_BOX_VALUE) {
            StableIValue *box = (StableIValue *)(uintptr_t)v;
            if (a->kind[i] == SLOT_BOX_TENSOR) aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)*box);
            free_box(box);
        }
    }
    a->n = 0;
}

/* ---- the call --------------------------------------------------------------- */

typedef struct shim_site {
    const char *op;
    OpfBoxedKernel kernel; /* the op's cpu kernel, found in the op table on the first call */
} shim_site;

static OpfBoxedKernel find_kernel(const char *op) {
    char err[256];
    const opf_op_desc *table = opforge_op_table(err, sizeof err);
    size_t len = strlen(op);
    for (const opf_op_desc *d = table; d && d->schema; d++)
        if (strncmp(d->schema, op, len) == 0 && d->schema[len] == '(') return d->cpu;
    return NULL;
}

static AOTITorchError shim_run(shim_site *site, shim_args *a, AtenTensorHandle **rets, int nout) {
    OpfBoxedKernel kernel = __atomic_load_n(&site->kernel, __ATOMIC_ACQUIRE);
    if (kernel == NULL && !a->failed) {
        char err[512];
        if (opf_init_once(err, sizeof err) == 0) {
            kernel = find_kernel(site->op);
            __atomic_store_n(&site->kernel, kernel, __ATOMIC_RELEASE);
        } else {
            opf_log(OPF_LOG_ERROR, "%s: %s", site->op, err);
        }
    }
    if (a->failed || kernel == NULL) {
        release(a);
        return OPF_AOTI_FAILURE;
    }
    /* from here the kernel owns every argument; an error it raises propagates (see the header) */
    kernel(a->v, (uint64_t)a->n, (uint64_t)nout);
    for (int i = 0; i < nout; i++) *rets[i] = (AtenTensorHandle)(uintptr_t)a->v[i];
    return OPF_AOTI_SUCCESS;
}

/* ---- one shim per op ---------------------------------------------------------- */

#define OPF_UNPAREN(...) __VA_ARGS__
#define OPF_CAT(a, b) OPF_CAT_(a, b)
#define OPF_CAT_(a, b) a##b
#define OPF_COUNT(...) OPF_COUNT_(__VA_ARGS__, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
#define OPF_COUNT_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, n, ...) n
#define OPF_EACH(m, a, ...) OPF_CAT(OPF_EACH_, OPF_COUNT(__VA_ARGS__))(m, a, __VA_ARGS__)
#define OPF_EACH_1(m, a, x) m(a, x);
#define OPF_EACH_2(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_1(m, a, __VA_ARGS__)
#define OPF_EACH_3(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_2(m, a, __VA_ARGS__)
#define OPF_EACH_4(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_3(m, a, __VA_ARGS__)
#define OPF_EACH_5(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_4(m, a, __VA_ARGS__)
#define OPF_EACH_6(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_5(m, a, __VA_ARGS__)
#define OPF_EACH_7(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_6(m, a, __VA_ARGS__)
#define OPF_EACH_8(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_7(m, a, __VA_ARGS__)
#define OPF_EACH_9(m, a, x, ...) \
    m(a, x);                     \
    OPF_EACH_8(m, a, __VA_ARGS__)
#define OPF_EACH_10(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_9(m, a, __VA_ARGS__)
#define OPF_EACH_11(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_10(m, a, __VA_ARGS__)
#define OPF_EACH_12(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_11(m, a, __VA_ARGS__)
#define OPF_EACH_13(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_12(m, a, __VA_ARGS__)
#define OPF_EACH_14(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_13(m, a, __VA_ARGS__)
#define OPF_EACH_15(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_14(m, a, __VA_ARGS__)
#define OPF_EACH_16(m, a, x, ...) \
    m(a, x);                      \
    OPF_EACH_15(m, a, __VA_ARGS__)

#define OPF_RETS_1 AtenTensorHandle *ret0
#define OPF_RETS_2 OPF_RETS_1, AtenTensorHandle *ret1
#define OPF_RETS_3 OPF_RETS_2, AtenTensorHandle *ret2
#define OPF_RETS_4 OPF_RETS_3, AtenTensorHandle *ret3
#define OPF_RETS_5 OPF_RETS_4, AtenTensorHandle *ret4
#define OPF_RET_PTRS_1 ret0
#define OPF_RET_PTRS_2 OPF_RET_PTRS_1, ret1
#define OPF_RET_PTRS_3 OPF_RET_PTRS_2, ret2
#define OPF_RET_PTRS_4 OPF_RET_PTRS_3, ret3
#define OPF_RET_PTRS_5 OPF_RET_PTRS_4, ret4

/* X(op, number of outputs, (C parameters as the schema's arguments map to them), parameter names...).
 * The parameters are written as aoti.py derives them from the schema; opforge_aoti_shim_at hands this
 * text to it, and it refuses an op whose text differs from what it derives (a test checks every op). */
#define OPF_AOTI_OPS(X)                                                                                                \
    X(dispersion_correction, 1, (AtenTensorHandle x, double alpha), x, alpha)                                          \
    X(dispersion_correction_backward, 1, (AtenTensorHandle grad, AtenTensorHandle x, double alpha), grad, x, alpha)    \
    X(matmul, 1, (AtenTensorHandle a, AtenTensorHandle b), a, b)                                                       \
    X(matmul_backward, 2, (AtenTensorHandle grad, AtenTensorHandle a, AtenTensorHandle b), grad, a, b)                 \
    X(linear, 2,                                                                                                       \
      (AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle * bias, int64_t activation, int32_t save_preact), \
      x, weight, bias, activation, save_preact)                                                                        \
    X(linear_backward, 3,                                                                                              \
      (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle * bias,                    \
       AtenTensorHandle preact, int64_t activation),                                                                   \
      grad, x, weight, bias, preact, activation)                                                                       \
    X(linear_backward_, 3,                                                                                             \
      (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle * bias,                    \
       AtenTensorHandle preact, int64_t activation),                                                                   \
      grad, x, weight, bias, preact, activation)                                                                       \
    X(attention, 2,                                                                                                    \
      (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle * attn_mask, int32_t causal,       \
       double *scale),                                                                                                 \
      q, k, v, attn_mask, causal, scale)                                                                               \
    X(attention_backward, 3,                                                                                           \
      (AtenTensorHandle grad, AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,                              \
       AtenTensorHandle * attn_mask, AtenTensorHandle out, AtenTensorHandle lse, int32_t causal, double *scale),       \
      grad, q, k, v, attn_mask, out, lse, causal, scale)                                                               \
    X(attention_decode, 1,                                                                                             \
      (AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle seq_lens,              \
       double *scale, int32_t causal),                                                                                 \
      q, k_cache, v_cache, seq_lens, scale, causal)                                                                    \
    X(rms_norm, 2, (AtenTensorHandle x, AtenTensorHandle * weight, double eps, int32_t offset), x, weight, eps,        \
      offset)                                                                                                          \
    X(rms_norm_backward, 2,                                                                                            \
      (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle * weight, AtenTensorHandle rstd, double eps,        \
       int32_t offset),                                                                                                \
      grad, x, weight, rstd, eps, offset)                                                                              \
    X(add_rms_norm, 3,                                                                                                 \
      (AtenTensorHandle x, AtenTensorHandle residual, AtenTensorHandle * weight, double eps, int32_t offset), x,       \
      residual, weight, eps, offset)                                                                                   \
    X(add_rms_norm_backward, 3,                                                                                        \
      (AtenTensorHandle grad, AtenTensorHandle grad_sum, AtenTensorHandle sum, AtenTensorHandle * weight,              \
       AtenTensorHandle rstd, double eps, int32_t offset),                                                             \
      grad, grad_sum, sum, weight, rstd, eps, offset)                                                                  \
    X(layer_norm, 3, (AtenTensorHandle x, AtenTensorHandle * weight, AtenTensorHandle * bias, double eps), x, weight,  \
      bias, eps)                                                                                                       \
    X(layer_norm_backward, 3,                                                                                          \
      (AtenTensorHandle grad, AtenTensorHandle x, AtenTensorHandle * weight, AtenTensorHandle * bias,                  \
       AtenTensorHandle mean, AtenTensorHandle rstd, double eps),                                                      \
      grad, x, weight, bias, mean, rstd, eps)                                                                          \
    X(glu, 1, (AtenTensorHandle gate, AtenTensorHandle up, int64_t act), gate, up, act)                                \
    X(glu_backward, 2, (AtenTensorHandle grad, AtenTensorHandle gate, AtenTensorHandle up, int64_t act), grad, gate,   \
      up, act)                                                                                                         \
    X(rope, 2,                                                                                                         \
      (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle cos, AtenTensorHandle sin,                             \
       AtenTensorHandle * position_ids, int32_t interleaved),                                                          \
      q, k, cos, sin, position_ids, interleaved)                                                                       \
    X(rope_backward, 2,                                                                                                \
      (AtenTensorHandle grad_q, AtenTensorHandle grad_k, AtenTensorHandle cos, AtenTensorHandle sin,                   \
       AtenTensorHandle * position_ids, int32_t interleaved),                                                          \
      grad_q, grad_k, cos, sin, position_ids, interleaved)                                                             \
    X(softmax, 1, (AtenTensorHandle x, int64_t dim), x, dim)                                                           \
    X(log_softmax, 1, (AtenTensorHandle x, int64_t dim), x, dim)                                                       \
    X(softmax_backward, 1, (AtenTensorHandle grad, AtenTensorHandle y, int64_t dim), grad, y, dim)                     \
    X(log_softmax_backward, 1, (AtenTensorHandle grad, AtenTensorHandle y, int64_t dim), grad, y, dim)                 \
    X(cross_entropy, 3,                                                                                                \
      (AtenTensorHandle logits, AtenTensorHandle target, AtenTensorHandle * weight, int64_t ignore_index,              \
       double label_smoothing, int64_t reduction, double *softcap),                                                    \
      logits, target, weight, ignore_index, label_smoothing, reduction, softcap)                                       \
    X(cross_entropy_backward, 1,                                                                                       \
      (AtenTensorHandle grad_losses, AtenTensorHandle grad_loss, AtenTensorHandle logits, AtenTensorHandle target,     \
       AtenTensorHandle * weight, AtenTensorHandle lse, int64_t ignore_index, double label_smoothing,                  \
       int64_t reduction, double *softcap),                                                                            \
      grad_losses, grad_loss, logits, target, weight, lse, ignore_index, label_smoothing, reduction, softcap)          \
    X(linear_cross_entropy, 5,                                                                                         \
      (AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target, AtenTensorHandle * bias,             \
       int64_t ignore_index, double label_smoothing, int64_t reduction, double *softcap, int32_t compute_grad),        \
      hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, compute_grad)                   \
    X(linear_cross_entropy_backward, 3,                                                                                \
      (AtenTensorHandle grad, AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target,               \
       AtenTensorHandle * bias, AtenTensorHandle lse, AtenTensorHandle dhidden, AtenTensorHandle dweight,              \
       AtenTensorHandle dbias, int64_t ignore_index, double label_smoothing, int64_t reduction, double *softcap),      \
      grad, hidden, weight, target, bias, lse, dhidden, dweight, dbias, ignore_index, label_smoothing, reduction,      \
      softcap)                                                                                                         \
    X(linear_cross_entropy_none, 2,                                                                                    \
      (AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target, AtenTensorHandle * bias,             \
       int64_t ignore_index, double label_smoothing, double *softcap),                                                 \
      hidden, weight, target, bias, ignore_index, label_smoothing, softcap)                                            \
    X(linear_cross_entropy_none_backward, 3,                                                                           \
      (AtenTensorHandle grad, AtenTensorHandle hidden, AtenTensorHandle weight, AtenTensorHandle target,               \
       AtenTensorHandle * bias, AtenTensorHandle lse, int64_t ignore_index, double label_smoothing, double *softcap),  \
      grad, hidden, weight, target, bias, lse, ignore_index, label_smoothing, softcap)

/* The locals end in '_' so that no schema argument name (a, grad, ...) shadows them. */
#define OPF_AOTI_DEFINE(op, nout, params, ...)                                                            \
    OPF_EXPORT AOTITorchError opf_aoti_cpu_##op(OPF_UNPAREN params,                                       \
                                                OPF_RETS_##nout) __asm__(OPF_NAMESPACE "_aoti_cpu_" #op); \
    AOTITorchError opf_aoti_cpu_##op(OPF_UNPAREN params, OPF_RETS_##nout) {                               \
        static shim_site site_ = {#op, NULL};                                                             \
        shim_args args_ = {.n = 0};                                                                       \
        AtenTensorHandle *rets_[] = {OPF_RET_PTRS_##nout};                                                \
        OPF_EACH(OPF_AOTI_ARG, &args_, __VA_ARGS__)                                                       \
        return shim_run(&site_, &args_, rets_, nout);                                                     \
    }
OPF_AOTI_OPS(OPF_AOTI_DEFINE)

typedef struct shim_info {
    const char *op, *params;
    int nout;
} shim_info;

#define OPF_AOTI_INFO(op, nout, params, ...) {#op, #params, nout},
static const shim_info shims[] = {OPF_AOTI_OPS(OPF_AOTI_INFO)};

/* Shim i of this library: the op's name, its C parameters as written above
 * (outputs left out) and its number of outputs; the symbol is
 * opforge_namespace() + "_aoti_cpu_" + op. Returns 1, or 0 past the last. */
OPF_EXPORT int opforge_aoti_shim_at(int i, const char **op, const char **params, int *nout) {
    if (i < 0 || i >= (int)(sizeof shims / sizeof shims[0])) return 0;
    *op = shims[i].op;
    *params = shims[i].params;
    *nout = shims[i].nout;
    return 1;
}
