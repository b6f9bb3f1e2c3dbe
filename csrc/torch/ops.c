/*
 * The table of opforge's own ops, gathered from the op files (registry.h),
 * and their registration with torch when the library is loaded.
 */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "namespace.h"
#include "opforge/op.h"
#include "registry.h"

OPF_SECTION_BOUNDS(opf_ops, const opf_op_desc *);
OPF_SECTION_BOUNDS(opf_enums, const opf_enum_desc *);

#define OPF_MAX_OPS 128
static opf_op_desc table[OPF_MAX_OPS + 1]; /* and its end */

OPF_EXPORT const opf_op_desc *opforge_op_table(char *err, size_t errlen) {
    int n = 0;
    for (const opf_op_desc *const *group = __start_opf_ops; group < __stop_opf_ops; group++) {
        for (const opf_op_desc *op = *group; op->schema; op++) {
            if (n == OPF_MAX_OPS) {
                snprintf(err, errlen, "more than OPF_MAX_OPS (%d) ops in opforge's table (csrc/torch/ops.c): raise it",
                         OPF_MAX_OPS);
                return NULL;
            }
            table[n++] = *op;
        }
    }
    table[n] = (opf_op_desc)OPF_OP_END;
    return table;
}

const opf_op_desc *opf_find_op(const char *name) {
    const size_t len = strlen(name);
    for (const opf_op_desc *const *group = __start_opf_ops; group < __stop_opf_ops; group++)
        for (const opf_op_desc *op = *group; op->schema; op++)
            if (strncmp(op->schema, name, len) == 0 && op->schema[len] == '(') return op;
    return NULL;
}

/* ---- registration at load --------------------------------------------------------- */

/* The Python module that adds the fake kernels, autograd and autocast: torch
 * names it when a traced program meets an op without its fake kernel. */
#define OPF_PYTHON_MODULE "opforge._lib"

static struct {
    int rc; /* 0 registered, -1 failed (err says why) */
    char err[1024];
} load_status;

/* A library that torch loads (torch.ops.load_library, or a deployed
 * AOTInductor or torch.export program's process) serves its ops from here on,
 * as a C++ extension does: schemas and CPU kernels under OPF_NAMESPACE, with
 * no Python. Importing opforge finds them registered and adds the rest. A
 * failure (the namespace already taken by another copy of the library, say)
 * cannot raise here: it is kept for opforge_registered, which the Python
 * layer reads at import, and logged. */
int opf_gemm_torch_install(char *err, size_t errlen); /* gemm_torch.c */

__attribute__((constructor)) static void register_at_load(void) {
    char context[768] = "opforge's op library";
    Dl_info info;
    if (dladdr((const void *)register_at_load, &info) && info.dli_fname)
        snprintf(context, sizeof context, "opforge's op library %s", info.dli_fname);
    const opf_op_desc *ops = opforge_op_table(load_status.err, sizeof load_status.err);
    if (ops == NULL ||
        opforge_set_python_module(OPF_NAMESPACE, OPF_PYTHON_MODULE, context, load_status.err, sizeof load_status.err) <
            0 ||
        opforge_register(OPF_NAMESPACE, ops, load_status.err, sizeof load_status.err) != 0) {
        load_status.rc = -1;
        opf_log(OPF_LOG_ERROR, "registering the ops of namespace '%s' at load: %s", OPF_NAMESPACE, load_status.err);
        return;
    }
    /* the kernels run from here on without the Python layer: the runtime reads OPFORGE_ISA and
     * OPFORGE_LOG_* now (importing opforge reads them again, and raises what is wrong with them) */
    char err[512];
    if (opf_init_once(err, sizeof err) != 0) opf_log(OPF_LOG_ERROR, "%s", err);
    /* the GEMMs are offered to torch's own from here on (gemm_torch.c), in the mode OPFORGE_GEMM names */
    if (opf_gemm_torch_install(err, sizeof err) != 0) opf_log(OPF_LOG_ERROR, "%s", err);
}

/* 0 when the library registered its ops as it was loaded, else -1 and why. */
OPF_EXPORT int opforge_registered(char *err, size_t errlen) {
    if (load_status.rc) snprintf(err, errlen, "%s", load_status.err);
    return load_status.rc;
}

/* ---- enums ----------------------------------------------------------------------- */

static const opf_enum_desc *find_enum(const char *name) {
    for (const opf_enum_desc *const *e = __start_opf_enums; e < __stop_opf_enums; e++)
        if (strcmp((*e)->name, name) == 0) return *e;
    return NULL;
}

/* Value i of the enum `name` (registry.h): its name and code. Returns 1, 0
 * past the last value, -1 when there is no such enum. */
OPF_EXPORT int opforge_enum_value(const char *name, int i, const char **value, int64_t *code) {
    const opf_enum_desc *e = find_enum(name);
    if (e == NULL) return -1;
    if (i < 0 || i >= e->count) return 0;
    *value = e->values[i].name;
    *code = e->values[i].code;
    return 1;
}

/* Enum i's name, NULL past the last. */
OPF_EXPORT const char *opforge_enum_at(int i) {
    return i >= 0 && i < (int)(__stop_opf_enums - __start_opf_enums) ? __start_opf_enums[i]->name : NULL;
}
