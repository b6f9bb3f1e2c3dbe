/*
 * AOTInductor C shims (aoti.c has the calling convention and the error
 * story): an op file declares each of its ops' shims beside its descriptors,
 *
 *     OPF_AOTI_SHIM(op, number of outputs, (C parameters as the schema's arguments map to them),
 *                   parameter names...);
 *
 * which defines the exported function `<namespace>_aoti_cpu_<op>` and lists
 * it for opforge_aoti_shim_at. The parameters are written as
 * python/opforge/aoti.py derives them from the schema; aoti.py refuses a shim
 * whose text differs from what it derives (a test checks every op).
 */
#ifndef OPFORGE_TORCH_AOTI_H
#define OPFORGE_TORCH_AOTI_H

#include "namespace.h"
#include "opforge/op.h"
#include "registry.h"

#define OPF_AOTI_MAX_ARGS 16

/* The shim's C values as a boxed stack, and what to release if the kernel never gets them. */
typedef struct opf_aoti_args {
    StableIValue v[OPF_AOTI_MAX_ARGS];
    unsigned char kind[OPF_AOTI_MAX_ARGS];
    int n, failed;
} opf_aoti_args;

typedef struct opf_aoti_site {
    const char *op;
    OpfBoxedKernel kernel; /* the op's cpu kernel, found in the op table on the first call */
} opf_aoti_site;

typedef struct opf_aoti_shim_desc {
    const char *op, *params;
    int nout;
} opf_aoti_shim_desc;

void opf_aoti_arg_tensor(opf_aoti_args *a, AtenTensorHandle t);
void opf_aoti_arg_optional_tensor(opf_aoti_args *a, AtenTensorHandle *t);
void opf_aoti_arg_double(opf_aoti_args *a, double v);
void opf_aoti_arg_optional_double(opf_aoti_args *a, double *v);
void opf_aoti_arg_int(opf_aoti_args *a, int64_t v);
void opf_aoti_arg_optional_int(opf_aoti_args *a, int64_t *v);
void opf_aoti_arg_bool(opf_aoti_args *a, int32_t v);
void opf_aoti_arg_optional_bool(opf_aoti_args *a, int32_t *v);
void opf_aoti_arg_str(opf_aoti_args *a, const char *v);
void opf_aoti_arg_optional_str(opf_aoti_args *a, const char **v);
AOTITorchError opf_aoti_run(opf_aoti_site *site, opf_aoti_args *a, AtenTensorHandle **rets, int nout);

/* The C type of a parameter picks how it is boxed: the parameter list is the only per-op fact. */
#define OPF_AOTI_ARG(a, v) \
    _Generic((v),                                                    \
        AtenTensorHandle: opf_aoti_arg_tensor,                       \
        AtenTensorHandle *: opf_aoti_arg_optional_tensor,            \
        double: opf_aoti_arg_double,                                 \
        double *: opf_aoti_arg_optional_double,                      \
        int64_t: opf_aoti_arg_int,                                   \
        int64_t *: opf_aoti_arg_optional_int,                        \
        int32_t: opf_aoti_arg_bool,                                  \
        int32_t *: opf_aoti_arg_optional_bool,                       \
        const char *: opf_aoti_arg_str,                              \
        const char **: opf_aoti_arg_optional_str)(a, v)

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

/* the output parameters after the arguments, and their pointers after a leading NULL (an op may
 * return nothing: nout 0) */
#define OPF_RETS_0
#define OPF_RETS_1 , AtenTensorHandle *ret0
#define OPF_RETS_2 OPF_RETS_1, AtenTensorHandle *ret1
#define OPF_RETS_3 OPF_RETS_2, AtenTensorHandle *ret2
#define OPF_RETS_4 OPF_RETS_3, AtenTensorHandle *ret3
#define OPF_RETS_5 OPF_RETS_4, AtenTensorHandle *ret4
#define OPF_RETS_6 OPF_RETS_5, AtenTensorHandle *ret5
#define OPF_RET_PTRS_0
#define OPF_RET_PTRS_1 , ret0
#define OPF_RET_PTRS_2 OPF_RET_PTRS_1, ret1
#define OPF_RET_PTRS_3 OPF_RET_PTRS_2, ret2
#define OPF_RET_PTRS_4 OPF_RET_PTRS_3, ret3
#define OPF_RET_PTRS_5 OPF_RET_PTRS_4, ret4
#define OPF_RET_PTRS_6 OPF_RET_PTRS_5, ret5

/* The locals end in '_' so that no schema argument name (a, grad, ...) shadows them. */
#define OPF_AOTI_SHIM(op, nout, params, ...)                                                                   \
    OPF_EXPORT AOTITorchError opf_aoti_cpu_##op(OPF_UNPAREN params OPF_RETS_##nout) __asm__(OPF_NAMESPACE      \
                                                                                            "_aoti_cpu_" #op); \
    AOTITorchError opf_aoti_cpu_##op(OPF_UNPAREN params OPF_RETS_##nout) {                                     \
        static opf_aoti_site site_ = {#op, NULL};                                                              \
        opf_aoti_args args_ = {.n = 0};                                                                        \
        AtenTensorHandle *rets_[] = {NULL OPF_RET_PTRS_##nout};                                                \
        OPF_EACH(OPF_AOTI_ARG, &args_, __VA_ARGS__)                                                            \
        return opf_aoti_run(&site_, &args_, rets_ + 1, nout);                                                  \
    }                                                                                                          \
    static const opf_aoti_shim_desc opf_aoti_desc_##op = {#op, #params, nout};                                 \
    OPF_REG_ENTRY(opf_aoti_shims, const opf_aoti_shim_desc *) = &opf_aoti_desc_##op

#endif
