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
 *   str    -> const char * (borrowed)          str?    -> const char ** (NULL: None)
 * then one `AtenTensorHandle *retN` per output, which receives a new owning handle.
 *
 * Names. Inductor calls `aoti_torch_cpu_<op>`, the op's name without its
 * namespace. The symbol defined here is `<namespace>_aoti_cpu_<op>`
 * (OPF_NAMESPACE, a build parameter), so that two builds under different
 * namespaces cannot collide; the declaration that python/opforge/aoti.py
 * generates from the schema binds inductor's name to it with an asm label:
 *   AOTITorchError aoti_torch_cpu_<op>(AtenTensorHandle x, ...) __asm__("opforge_aoti_cpu_<op>")
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

#include "aoti.h"

#define OPF_AOTI_FAILURE 1

/* ---- arguments: the shim's C values as a boxed stack ------------------------- */

/* What a slot owns: a plain value, a tensor handle, a string handle; SLOT_BOXED: that in a box. */
enum { SLOT_VALUE, SLOT_TENSOR, SLOT_STRING, SLOT_BOXED = 4 };

static void release_slot(StableIValue v, int kind);

static void push(opf_aoti_args *a, StableIValue v, int kind) {
    if (a->n == OPF_AOTI_MAX_ARGS) {
        a->failed = 1;
        release_slot(v, kind);
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
static AtenTensorHandle new_handle(opf_aoti_args *a, AtenTensorHandle t) {
    AtenTensorHandle h = NULL;
    if (t == NULL || aoti_torch_new_tensor_handle(t, &h) != OPF_AOTI_SUCCESS) a->failed = 1;
    return h;
}

static void release_slot(StableIValue v, int kind) {
    if (kind & SLOT_BOXED) {
        StableIValue *box = (StableIValue *)(uintptr_t)v;
        release_slot(*box, kind & ~SLOT_BOXED);
        free_box(box);
    } else if (kind == SLOT_TENSOR) {
        aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)v);
    } else if (kind == SLOT_STRING) {
        torch_delete_string((StringHandle)(uintptr_t)v);
    }
}

/* v (what kind says it is) in a new box, pushed as a `T?` value */
static void push_boxed(opf_aoti_args *a, StableIValue v, int kind) {
    StableIValue *box = new_box(v);
    if (box == NULL) {
        a->failed = 1;
        release_slot(v, kind);
        return;
    }
    push(a, (StableIValue)(uintptr_t)box, kind | SLOT_BOXED);
}

static StableIValue bits_of(double d) {
    StableIValue v = 0;
    memcpy(&v, &d, sizeof d);
    return v;
}

void opf_aoti_arg_tensor(opf_aoti_args *a, AtenTensorHandle t) {
    AtenTensorHandle h = new_handle(a, t);
    if (h) push(a, (StableIValue)(uintptr_t)h, SLOT_TENSOR);
}

void opf_aoti_arg_optional_tensor(opf_aoti_args *a, AtenTensorHandle *t) {
    if (t == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    AtenTensorHandle h = new_handle(a, *t);
    if (h) push_boxed(a, (StableIValue)(uintptr_t)h, SLOT_TENSOR);
}

void opf_aoti_arg_double(opf_aoti_args *a, double v) { push(a, bits_of(v), SLOT_VALUE); }
void opf_aoti_arg_int(opf_aoti_args *a, int64_t v) { push(a, (StableIValue)v, SLOT_VALUE); }
void opf_aoti_arg_bool(opf_aoti_args *a, int32_t v) { push(a, v != 0, SLOT_VALUE); }

void opf_aoti_arg_optional_double(opf_aoti_args *a, double *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, bits_of(*v), SLOT_VALUE);
}

void opf_aoti_arg_optional_int(opf_aoti_args *a, int64_t *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, (StableIValue)*v, SLOT_VALUE);
}

void opf_aoti_arg_optional_bool(opf_aoti_args *a, int32_t *v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    push_boxed(a, *v != 0, SLOT_VALUE);
}

/* The kernel owns (and frees) a `str` argument: a new string handle holding a copy of s. */
static StringHandle new_string(opf_aoti_args *a, const char *s) {
    StringHandle h = NULL;
    if (s == NULL || torch_new_string_handle(s, strlen(s), &h) != OPF_AOTI_SUCCESS) a->failed = 1;
    return h;
}

void opf_aoti_arg_str(opf_aoti_args *a, const char *v) {
    StringHandle h = new_string(a, v);
    if (h) push(a, (StableIValue)(uintptr_t)h, SLOT_STRING);
}

void opf_aoti_arg_optional_str(opf_aoti_args *a, const char **v) {
    if (v == NULL) {
        push(a, 0, SLOT_VALUE);
        return;
    }
    StringHandle h = new_string(a, *v);
    if (h) push_boxed(a, (StableIValue)(uintptr_t)h, SLOT_STRING);
}

static void release(opf_aoti_args *a) {
    for (int i = 0; i < a->n; i++) release_slot(a->v[i], a->kind[i]);
    a->n = 0;
}

/* ---- the call --------------------------------------------------------------- */

AOTITorchError opf_aoti_run(opf_aoti_site *site, opf_aoti_args *a, AtenTensorHandle **rets, int nout) {
    OpfBoxedKernel kernel = __atomic_load_n(&site->kernel, __ATOMIC_ACQUIRE);
    if (kernel == NULL && !a->failed) {
        char err[512];
        if (opf_init_once(err, sizeof err) == 0) {
            const opf_op_desc *desc = opf_find_op(site->op);
            kernel = desc ? desc->cpu : NULL;
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

/* ---- the shims' list ------------------------------------------------------------ */

OPF_SECTION_BOUNDS(opf_aoti_shims, const opf_aoti_shim_desc *);

/* Shim i of this library: the op's name, its C parameters as its op file
 * writes them (outputs left out) and its number of outputs; the symbol is
 * opforge_namespace() + "_aoti_cpu_" + op. Returns 1, or 0 past the last. */
OPF_EXPORT int opforge_aoti_shim_at(int i, const char **op, const char **params, int *nout) {
    if (i < 0 || i >= (int)(__stop_opf_aoti_shims - __start_opf_aoti_shims)) return 0;
    const opf_aoti_shim_desc *d = __start_opf_aoti_shims[i];
    *op = d->op;
    *params = d->params;
    *nout = d->nout;
    return 1;
}
