/*
 * Op registration on torch's stable C ABI: opforge_register defines the ops of a
 * table (opforge's own and every user library's, which link this runtime) and
 * registers their CPU and CUDA kernels; opforge_set_python_module names the
 * Python module of a namespace's fake and autograd kernels before that.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "opforge/op.h"
#include "registry.h"

#define OPF_MAX_LIBS 64
static TorchLibraryHandle libs[OPF_MAX_LIBS]; /* kept for the process: deleting undoes registrations */
static int nlibs;

/* The Python module that registers the fake and autograd kernels of a
 * namespace, set by opforge_set_python_module before opforge_register. */
static struct { char ns[128], module[128], context[512]; } pymodule;

static int keep_lib(TorchLibraryHandle h, char *err, size_t errlen) {
    if (nlibs == OPF_MAX_LIBS) {
        snprintf(err, errlen, "too many op libraries registered (max %d)", OPF_MAX_LIBS);
        return -1;
    }
    libs[nlibs++] = h;
    return 0;
}

/* The op's name: its schema up to '(', which is where a descriptor states it. */
static int op_name(const char *ns, const char *schema, char *name, size_t len, char *err, size_t errlen) {
    const char *paren = strchr(schema, '(');
    const char *begin = schema, *end = paren ? paren : schema;
    while (begin < end && *begin == ' ') begin++;
    while (end > begin && end[-1] == ' ') end--;
    if ((size_t)(end - begin) >= len) {
        snprintf(err, errlen, "op name in schema '%s' (namespace '%s') is longer than %zu characters", schema, ns,
                 len - 1);
        return -1;
    }
    if (!paren || begin == end) {
        snprintf(err, errlen,
                 "op schema '%s' in namespace '%s' does not start with an op name and '(': expected "
                 "'name(Tensor x, ...) -> Tensor'",
                 schema, ns);
        return -1;
    }
    memcpy(name, begin, (size_t)(end - begin));
    name[end - begin] = '\0';
    return 0;
}

#define OPF_MAX_NAME 256

static int register_impls(const char *ns, const char *key, const opf_op_desc *ops, size_t field, char *err,
                          size_t errlen) {
    int any = 0;
    for (const opf_op_desc *op = ops; op->schema; op++) any |= *(OpfBoxedKernel *)((const char *)op + field) != NULL;
    if (!any) return 0;
    TorchLibraryHandle impl = NULL;
    if (aoti_torch_library_init_impl(ns, key, __FILE__, __LINE__, &impl) != OPF_AOTI_SUCCESS) {
        snprintf(err, errlen, "could not open a %s implementation library for namespace '%s'", key, ns);
        return -1;
    }
    if (keep_lib(impl, err, errlen)) return -1;
    for (const opf_op_desc *op = ops; op->schema; op++) {
        OpfBoxedKernel fn = *(OpfBoxedKernel *)((const char *)op + field);
        char name[OPF_MAX_NAME];
        if (!fn) continue;
        if (op_name(ns, op->schema, name, sizeof name, err, errlen)) return -1;
        if (torch_library_impl(impl, name, fn, OPF_TORCH_BUILD_VERSION) != OPF_AOTI_SUCCESS) {
            snprintf(err, errlen, "could not register the %s kernel of %s::%s", key, ns, name);
            return -1;
        }
    }
    return 0;
}

/* Defines the ops of a table ended by OPF_OP_END and registers their kernels. */
OPF_EXPORT int opforge_register(const char *ns, const opf_op_desc *ops, char *err, size_t errlen) {
    char name[OPF_MAX_NAME];
    for (const opf_op_desc *op = ops; op->schema; op++)
        if (op_name(ns, op->schema, name, sizeof name, err, errlen)) return -1;
    TorchLibraryHandle def = NULL;
    if (aoti_torch_library_init_def(ns, __FILE__, __LINE__, &def) != OPF_AOTI_SUCCESS) {
        snprintf(err, errlen, "could not define namespace '%s' (already defined by another library?)", ns);
        return -1;
    }
    if (keep_lib(def, err, errlen)) return -1;
    /* before the defs: torch attaches the module to each op as it is defined */
    if (torch_library_set_python_module && pymodule.module[0] && strcmp(pymodule.ns, ns) == 0 &&
        torch_library_set_python_module(def, pymodule.module, pymodule.context) != OPF_AOTI_SUCCESS) {
        snprintf(err, errlen, "could not point namespace '%s' at the Python module '%s'", ns, pymodule.module);
        return -1;
    }
    for (const opf_op_desc *op = ops; op->schema; op++) {
        AOTITorchError rc;
        if (torch_library_def_with_tags && torch_tag_pt2_compliant_tag) {
            int32_t tag = torch_tag_pt2_compliant_tag();
            rc = torch_library_def_with_tags(def, op->schema, &tag, 1);
        } else {
            rc = aoti_torch_library_def(def, op->schema);
        }
        if (rc != OPF_AOTI_SUCCESS) {
            snprintf(err, errlen, "could not define an op of namespace '%s' from schema '%s'", ns, op->schema);
            return -1;
        }
    }
    if (register_impls(ns, "CPU", ops, offsetof(opf_op_desc, cpu), err, errlen)) return -1;
    return register_impls(ns, "CUDA", ops, offsetof(opf_op_desc, cuda), err, errlen);
}

/* Names the Python module that registers the fake and autograd kernels of
 * namespace ns, for the next opforge_register of ns (torch's
 * m.set_python_module, which applies to the ops defined after it): torch then
 * checks that the fake kernels come from there, and a message about a missing
 * fake kernel names the module to import. torch >= 2.13; returns 1 where this
 * torch lacks it (nothing to do), 0 when noted, -1 with a message in err. */
OPF_EXPORT int opforge_set_python_module(const char *ns, const char *module, const char *context, char *err,
                                         size_t errlen) {
    if (!torch_library_set_python_module) return 1;
    if (strlen(ns) >= sizeof pymodule.ns || strlen(module) >= sizeof pymodule.module) {
        snprintf(err, errlen, "namespace '%s' or module '%s' is too long (max %zu characters)", ns, module,
                 sizeof pymodule.ns - 1);
        return -1;
    }
    snprintf(pymodule.ns, sizeof pymodule.ns, "%s", ns);
    snprintf(pymodule.module, sizeof pymodule.module, "%s", module);
    snprintf(pymodule.context, sizeof pymodule.context, "%s", context);
    return 0;
}
