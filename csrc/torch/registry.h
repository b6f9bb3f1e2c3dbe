/*
 * How an op file of opforge's own library announces what it has, so that no
 * generic file lists ops: each csrc/torch/<op>.c ends with
 *
 *     OPF_REGISTER_OPS(opf_<op>_ops);          its descriptor table (op.h)
 *     OPF_REGISTER_FAMILY(<op>_variants);      each kernel family it runs (runtime.h)
 *     OPF_REGISTER_ENUM(reduction, {"none", CROSS_ENTROPY_NONE}, ...);
 *                                              the names of the codes an int argument takes
 *     OPF_AOTI_SHIM(<op>, nout, (C params), names...);   its AOTInductor shims (aoti.h)
 *
 * Each line puts a pointer in a named linker section; the linker gathers the
 * sections of every object it links into one array between __start_<name>
 * and __stop_<name>, which ops.c, glue.c and aoti.c read. Adding an op file
 * to the build is therefore all it takes to register it. Entries are
 * pointers only: the compiler may pad or over-align a larger object placed
 * in a section, but never a pointer, so the array has no holes. The order of
 * the entries is the link order of the objects (the build sorts its sources).
 */
#ifndef OPFORGE_TORCH_REGISTRY_H
#define OPFORGE_TORCH_REGISTRY_H

#include "opforge/op.h"

#define OPF_REG_CAT(a, b) OPF_REG_CAT_(a, b)
#define OPF_REG_CAT_(a, b) a##b
#define OPF_REG_ENTRY(name, type) \
    static type const OPF_REG_CAT(opf_reg_##name##_, __LINE__) __attribute__((used, section(#name)))

/* The first entry and one past the last of a section: empty (both NULL) when
 * no object put anything there. Hidden, so that a library linking this one
 * never sees another library's sections. */
#define OPF_SECTION_BOUNDS(name, type)                                              \
    extern type const __start_##name[] __attribute__((weak, visibility("hidden"))); \
    extern type const __stop_##name[] __attribute__((weak, visibility("hidden")))

typedef struct opf_enum_value {
    const char *name; /* "mean": what Python accepts */
    int64_t code;     /* what the C op's int argument takes */
} opf_enum_value;

typedef struct opf_enum_desc {
    const char *name; /* "reduction" */
    int count;
    const opf_enum_value *values;
} opf_enum_desc;

#define OPF_REGISTER_OPS(table) OPF_REG_ENTRY(opf_ops, const opf_op_desc *) = (table)
#define OPF_REGISTER_FAMILY(family) OPF_REG_ENTRY(opf_families, const opf_variants *) = &(family)
/* OPF_REGISTER_ENUM(reduction, {"none", CROSS_ENTROPY_NONE}, {"mean", CROSS_ENTROPY_MEAN}, {"sum", CROSS_ENTROPY_SUM}): the names of
 * the codes a kernel defines, stated once, beside the op that takes them. */
#define OPF_REGISTER_ENUM(enum_name, ...)                                                            \
    static const opf_enum_value OPF_REG_CAT(opf_enum_values_, enum_name)[] = {__VA_ARGS__};          \
    const opf_enum_desc OPF_REG_CAT(opf_enum_, enum_name) = {                                        \
        #enum_name, (int)(sizeof OPF_REG_CAT(opf_enum_values_, enum_name) / sizeof(opf_enum_value)), \
        OPF_REG_CAT(opf_enum_values_, enum_name)};                                                   \
    OPF_REG_ENTRY(opf_enums, const opf_enum_desc *) = &OPF_REG_CAT(opf_enum_, enum_name)

/* A CUDA kernel of one of the ops above, in a csrc/cuda/<op>.c of libopforge_cuda.so (csrc/cuda/ops.c
 * registers them on torch's CUDA key when that library loads): OPF_REGISTER_CUDA(rms_norm, rms_norm_cuda). */
typedef struct opf_cuda_kernel {
    const char *name; /* the op's name, as its schema states it */
    OpfBoxedKernel fn;
} opf_cuda_kernel;
#define OPF_REGISTER_CUDA(op, kernel)                                               \
    static const opf_cuda_kernel OPF_REG_CAT(opf_cuda_kernel_, op) = {#op, kernel}; \
    OPF_REG_ENTRY(opf_cuda_kernels, const opf_cuda_kernel *) = &OPF_REG_CAT(opf_cuda_kernel_, op)

/* ---- the generic wiring's own calls (ops.c, glue.c, register.c), for the other generic files ---- */

/* Every op of the library as one table ended by OPF_OP_END (a copy in static storage), or NULL with a
 * message in err. */
const opf_op_desc *opforge_op_table(char *err, size_t errlen);
/* The descriptor of the op named name (its schema up to '('), read from the op files' tables in place;
 * NULL when there is none. */
const opf_op_desc *opf_find_op(const char *name);
/* Defines the ops of a table ended by OPF_OP_END under namespace ns and registers their kernels. */
int opforge_register(const char *ns, const opf_op_desc *ops, char *err, size_t errlen);
/* Names the Python module that registers the fake and autograd kernels of ns, for its next opforge_register. */
int opforge_set_python_module(const char *ns, const char *module, const char *context, char *err, size_t errlen);
/* The runtime's initialisation, once per process (entry points reached without the Python layer). */
int opf_init_once(char *err, size_t errlen);

/* `value` when it is a code of the enum e, or a RuntimeError naming op, argument and every accepted code with its name:
 * "[opforge::cross_entropy] argument 'reduction' must be 0 (none), 1 (mean) or
 * 2 (sum), got 5". The codes are what the schema's int argument takes. */
int64_t opf_check_enum(const char *op, const char *arg, const opf_enum_desc *e, int64_t value);

#endif
