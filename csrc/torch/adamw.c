/*
 * torch glue of adamw_step: one AdamW step over a parameter group's lists of tensors, in place
 * (python/opforge/optim.py calls it once per group). Check, call; the arithmetic, the step counts
 * included, is in csrc/kernels/adamw.c.
 *
 * Not in the op table (OPF_REGISTER_OPS): that table's ops are functions of tensors that return
 * tensors, and the Python layer and the generic tests take each of them through fake kernels,
 * autograd, autocast, export, AOTInductor shims and the fuzzer. An optimizer step mutates lists of
 * tensors and returns nothing (AOTInductor has no C form for a list); it is defined here, in a
 * fragment of the namespace, with its CPU kernel, when the library loads.
 */
#include <stdlib.h>
#include <string.h>

#include "../kernels/adamw.h"
#include "namespace.h"
#include "opforge/op.h"
#include "registry.h"

static const char OP[] = OPF_QUALNAME("adamw_step");
#define ADAMW_SCHEMA                                                                                    \
    "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, " \
    "Tensor(d!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool maximize) -> ()"

enum { NLISTS = 5 };
static const char *const LIST_NAME[NLISTS] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "steps"};

/* The tensors of the five lists, owned: released on every path, the error's included. */
typedef struct adamw_handles {
    AtenTensorHandle *h; /* list k's tensor i at h[k * n + i] */
    size_t n, count;
    adamw_tensor *tensors; /* n, for the kernel */
} adamw_handles;

static void handles_release(adamw_handles *a) {
    for (size_t i = 0; i < a->count; i++) opf_tensor_release(&a->h[i]);
    free(a->h);
    free(a->tensors);
}

/* Takes the lists' tensors out of stack[0..NLISTS) and deletes the lists; the lists must be as long as
 * params. A list's tensors are taken whole before anything can fail, so that none is left unowned. */
static void take_lists(StableIValue *stack, adamw_handles *a) {
    size_t len[NLISTS], total = 0;
    for (int k = 0; k < NLISTS; k++) {
        if (torch_list_size((StableListHandle)(uintptr_t)stack[k], &len[k]) != OPF_AOTI_SUCCESS) len[k] = 0;
        total += len[k];
    }
    a->n = len[0];
    a->h = calloc(total ? total : 1, sizeof *a->h);
    a->tensors = calloc(a->n ? a->n : 1, sizeof *a->tensors);
    for (int k = 0; k < NLISTS; k++) {
        StableListHandle list = (StableListHandle)(uintptr_t)stack[k];
        for (size_t i = 0; i < len[k] && a->h; i++) {
            StableIValue v = 0;
            if (torch_list_get_item(list, i, &v) == OPF_AOTI_SUCCESS) a->h[a->count] = (AtenTensorHandle)(uintptr_t)v;
            a->count++;
        }
        torch_delete_list(list);
    }
    if (!a->h || !a->tensors) opf_fail(OP, "out of memory for the lists of %zu tensors", a->n);
    for (int k = 1; k < NLISTS; k++)
        if (len[k] != a->n)
            opf_fail(OP, "argument '%s' must hold one tensor per parameter (%zu), got %zu", LIST_NAME[k], a->n, len[k]);
}

/* List k's tensor i, named "grads[3]" in its errors. The name is written by hand: snprintf, five
 * times a parameter, took a fifth of the call (measured with 380 one-element parameters). */
static opf_tensor list_tensor(const adamw_handles *a, int k, size_t i, char *name, size_t len) {
    char digits[24];
    size_t nd = 0, at = strlen(LIST_NAME[k]);
    for (size_t v = i; nd == 0 || v; v /= 10) digits[nd++] = (char)('0' + v % 10);
    if (at + nd + 3 > len) opf_fail(OP, "internal error: the name of %s[%zu] is too long", LIST_NAME[k], i);
    memcpy(name, LIST_NAME[k], at);
    name[at++] = '[';
    while (nd) name[at++] = digits[--nd];
    name[at++] = ']';
    name[at] = '\0';
    const opf_tensor t = opf_tensor_info(OP, name, a->h[(size_t)k * a->n + i]);
    opf_check_cpu(OP, name, &t);
    return t;
}

/* t has ref's sizes and strides, so that the two are walked as one flat array. */
static void check_same_layout(const char *arg, const opf_tensor *t, const char *ref_arg, const opf_tensor *ref) {
    opf_check_same_shape(OP, arg, t, ref_arg, ref);
    for (int64_t d = 0; d < t->ndim; d++)
        if (t->sizes[d] > 1 && t->strides[d] != ref->strides[d])
            opf_fail(OP, "argument '%s' must have the strides of '%s' (dim %lld: %lld), got %lld", arg, ref_arg,
                     (long long)d, (long long)ref->strides[d], (long long)t->strides[d]);
}

static adamw_tensor check_tensor(const adamw_handles *a, size_t i) {
    char pn[48], name[48];
    const opf_tensor p = list_tensor(a, 0, i, pn, sizeof pn);
    const opf_dtype dt = opf_check_dtype(OP, pn, &p, OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_BF16));
    if (p.numel && !opf_is_dense((int)p.ndim, p.sizes, p.strides)) { /* an empty one is walked by no one */
        char shape[256];
        opf_shape_str(shape, sizeof shape, &p);
        opf_fail(OP, "argument '%s' must be dense (contiguous in some order of its dims), got a view of sizes %s", pn,
                 shape);
    }
    const opf_tensor g = list_tensor(a, 1, i, name, sizeof name);
    opf_check_same_dtype(OP, name, &g, pn, &p);
    check_same_layout(name, &g, pn, &p);
    opf_tensor moment[2];
    for (int k = 2; k < 4; k++) {
        moment[k - 2] = list_tensor(a, k, i, name, sizeof name);
        opf_check_dtype(OP, name, &moment[k - 2], OPF_DTYPE_BIT(OPF_F32));
        check_same_layout(name, &moment[k - 2], pn, &p);
    }
    const opf_tensor s = list_tensor(a, 4, i, name, sizeof name);
    const opf_dtype step_dt = opf_check_dtype(OP, name, &s, OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_F64));
    if (s.numel != 1)
        opf_fail(OP, "argument '%s' must hold one value (the step count), got %lld", name, (long long)s.numel);
    return (adamw_tensor){.param = p.data,
                          .exp_avg = moment[0].data,
                          .exp_avg_sq = moment[1].data,
                          .grad = g.data,
                          .step = s.data,
                          .numel = p.numel,
                          .dt = dt,
                          .step_dt = step_dt};
}

/* adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,
 *            Tensor(d!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay,
 *            bool maximize) -> () */
static void adamw_step_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    __attribute__((cleanup(handles_release))) adamw_handles a = {0};
    take_lists(stack, &a);
    double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const adamw_hparams h = {.lr = opf_arg_double(stack[5]),
                             .beta1 = opf_arg_double(stack[6]),
                             .beta2 = opf_arg_double(stack[7]),
                             .eps = opf_arg_double(stack[8]),
                             .weight_decay = opf_arg_double(stack[9]),
                             .maximize = opf_arg_bool(stack[10])};
    for (size_t i = 0; i < a.n; i++) a.tensors[i] = check_tensor(&a, i);
    adamw_step(adamw_kernels_for(opf_isa_current()), a.tensors, (int64_t)a.n, &h);
    if (a.n) opf_log_call(OP, t0, 1, (opf_tensor[]){opf_tensor_info(OP, "params[0]", a.h[0])});
}

/* ---- registration at load -------------------------------------------------------------------- */

__attribute__((constructor)) static void adamw_register(void) {
    TorchLibraryHandle def = NULL, impl = NULL; /* kept for the process: deleting one undoes it */
    const char *failed = NULL;
    if (aoti_torch_library_init_fragment(OPF_NAMESPACE, __FILE__, __LINE__, &def) != OPF_AOTI_SUCCESS)
        failed = "open a fragment of the namespace";
    else if (aoti_torch_library_def(def, ADAMW_SCHEMA) != OPF_AOTI_SUCCESS)
        failed = "define the schema (is another copy of the library loaded?)";
    else if (aoti_torch_library_init_impl(OPF_NAMESPACE, "CPU", __FILE__, __LINE__, &impl) != OPF_AOTI_SUCCESS ||
             torch_library_impl(impl, "adamw_step", adamw_step_cpu, OPF_TORCH_BUILD_VERSION) != OPF_AOTI_SUCCESS)
        failed = "register the CPU kernel";
    if (failed) opf_log(OPF_LOG_ERROR, "%s: could not %s; opforge.optim.AdamW will not run", OP, failed);
}

OPF_REGISTER_FAMILY(adamw_variants);
