/*
 * Writing an opforge operator: the descriptor and the glue helpers.
 *
 * An op is one boxed C kernel per dispatch key plus one opf_op_desc. The
 * Python layer reads the table returned by opforge_op_table() and wires
 * register_fake (from `shape`), register_autograd (from `backward*`) and the
 * autocast kernels (from `autocast`); no per-op Python is needed.
 *
 * Boxed kernel contract (torch's stable ABI): inputs in stack[0..nin) -- the
 * kernel owns their tensor handles -- and outputs written to stack[0..nout).
 * Take every tensor argument with OPF_ARG_TENSOR first: the handle is then
 * released on every path, including the C++ exception opf_fail raises.
 */
#ifndef OPFORGE_OP_H
#define OPFORGE_OP_H

#include <stddef.h>
#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"
#include "opforge/shim.h"

#ifdef __cplusplus
extern "C" {
#endif

#define OPF_EXPORT __attribute__((visibility("default")))

typedef enum opf_autocast {
    OPF_AUTOCAST_NONE = 0, /* run in the dtype the inputs have */
    OPF_AUTOCAST_LOWER,    /* cast floating inputs to the autocast dtype (fp16/bf16) */
    OPF_AUTOCAST_FP32,     /* cast floating inputs to float32 */
    OPF_AUTOCAST_PROMOTE,  /* cast floating inputs to the widest of their dtypes (eager's type promotion: an
                              elementwise op on a 16-bit and a float32 tensor runs in float32) */
    OPF_AUTOCAST_FOLLOW    /* parameters follow the input: with a 16-bit first tensor argument, float32
                              Tensor? arguments (weight, bias) are cast to its dtype, as eager's norms run in
                              their input's dtype beside float32 parameters; their gradients come back in
                              float32 through the cast */
} opf_autocast;

/* The op's name is the schema's up to its '(': it is written once, there. */
typedef struct opf_op_desc {
    const char *schema; /* "dispersion_correction(Tensor x, float alpha) -> Tensor"; NULL ends a table */
    OpfBoxedKernel cpu; /* kernel per dispatch key; NULL where there is none */
    OpfBoxedKernel cuda;
    /* Fake-tensor rule per output, ';'-separated: what the fake kernel makes
     * when sizes are symbolic (torch.compile(dynamic=True)) or the op has no
     * .meta kernel. Each rule is one of two forms; ARG names a schema argument.
     *
     *   like:ARG         ARG's sizes and dtype, ARG's strides if ARG is dense
     *                    (opf_output_strides).                       "like:x"
     *   [SIZES] OPTION*  a new contiguous tensor. SIZES is a comma list of
     *                    ARG[i] (one size of ARG; negative i counts from the
     *                    end), ARG[i:j] (a slice of its sizes, either end
     *                    optional; ARG[:] is all of them) and integers; []
     *                    is a 0-d tensor.      "[x[:-1], weight[0]]", "[a[:]]"
     *     dtype=ARG|DTYPE  the dtype of argument ARG, or a fixed one (float32,
     *                    float64, float16, bfloat16, int64, int32, int8,
     *                    uint8, bool). Default: the first argument in SIZES.
     *                                            "[q[:3]] dtype=float32"
     *     dtype=promote(ARG|DTYPE,...)  their promoted dtype (torch's
     *                    type promotion): a float32 loss of 16-bit operands,
     *                    float64 of float64 ones.
     *                                  "[] dtype=promote(hidden,float32)"
     *     perm=I,J,...   SIZES are the sizes as laid out in memory and the
     *                    output is that tensor's permute(I,J,...) view: the
     *                    layout the C glue allocates, stated next to it.
     *                    "[q[0], q[2], q[1], v[-1]] perm=0,2,1,3": allocated
     *                    (B, N, H, Dv), returned as (B, H, N, Dv)
     *     if ARG and ...  the output is empty, [0], unless every ARG is given
     *                    and true (not None, not false, not 0, not an enum's
     *                    first value); an argument left out takes its
     *                    schema default.
     *                    "[x[:-1], weight[0]] if activation and save_preact",
     *                    "[bias[:]] dtype=x if bias"
     *
     * Rules are checked against the schema when the library loads: an
     * unknown form, an argument the schema lacks, a Tensor? read outside
     * `if` (it may be None), or a rule count that differs from the schema's
     * outputs fails there, naming the op. */
    const char *shape;
    /* Autograd: the backward op (same namespace), what it is called with --
     * argument names, "gradN" (gradient of output N), "outN" (output N) -- and
     * which arguments its outputs are the gradients of. NULL: no autograd.
     * "outN!": output N is saved for the backward alone and may be reused as
     * its scratch: when the graph is not retained and nothing else refers to
     * it, the wiring calls "<backward>_" instead, an op with the same
     * arguments that declares that one mutable (Tensor(a!)).
     * "ARG!" (an input): the backward may write ARG's gradient over ARG: when
     * the graph is not retained, every such input is contiguous and nothing
     * else refers to it, the wiring calls "<backward>_", an op with the same
     * arguments that declares them mutable and returns the other gradients
     * of backward_grads in order ("-> ()" when there are none); the written
     * inputs are those gradients (glu: "grad0,gate!,up!,act").
     * "outN!ARG": output N, a tensor of ARG's shape (the forward made ARG's
     * gradient for a unit upstream gradient, say): "<backward>_", called as
     * for "ARG!" when output N also has ARG's dtype and device and nothing
     * else refers to it, writes ARG's gradient over it, and output N is that
     * gradient (linear_cross_entropy: "...,out2!hidden,out3!weight,...").
     * "needs": an int, bit i set when the i-th of backward_grads needs its
     * gradient (ctx.needs_input_grad): a backward may leave the outputs of
     * the others uncomputed (still allocated, of their usual shape, so the
     * shape rules hold), and the wiring drops them. A frozen weight then
     * costs no weight-gradient GEMM. Declare it in the backward's schema as
     * "int needs=<all bits>" so a direct call computes everything. */
    const char *backward;
    const char *backward_args;
    const char *backward_grads;
    int autocast; /* opf_autocast */
    /* FLOP estimate for torch.utils.flop_counter: a product of integers,
     * numel(arg) and size(arg,dim), e.g. "2*numel(x)*size(weight,0)". NULL: none. */
    const char *flops;
    /* 1: the cpu kernel takes meta tensors (it checks them and allocates its
     * outputs as usual, and computes nothing): the fake kernel runs it on
     * meta stand-ins of concrete-sized inputs, so torch.compile and
     * torch.export refuse what eager refuses, with the same message, and
     * the outputs' shapes and strides come from the C that makes them. */
    int meta;
    /* The policy under CUDA autocast where it differs from `autocast` (0: the same): torch's CUDA
     * autocast runs softmax, log_softmax and layer_norm in float32, its CPU autocast does not. */
    int autocast_cuda;
    /* The values of the `str` (or `str?`) arguments that take a fixed set, ';'-separated:
     * "activation: none|silu|gelu; mode: a|b". The kernel reads each with opf_arg_enum and the same
     * list -- one #define for both: `#define GLU_ACTS "silu|gelu"`, `.enums = "act: " GLU_ACTS` --
     * and gets the value's index; the fake kernel refuses an unknown value with the kernel's message.
     * Checked at load: each names a str argument of the schema, values are distinct identifiers, and
     * a schema default is one of them. In a shape rule's `if`, the first value counts as false (it is
     * the 0 the kernel sees). NULL: none. */
    const char *enums;
} opf_op_desc;

/* The entry that ends every op table: the tables state no counts. */
#define OPF_OP_END \
    { .schema = NULL }

/* Every op library exports its table as opforge_op_table(err, errlen): the
 * descriptors up to OPF_OP_END, or NULL with a message in err. OPF_OP_TABLE
 * defines it from a list of descriptors and adds the end:
 *     OPF_OP_TABLE({.schema = "myop(Tensor x) -> Tensor", ...},
 *                  {.schema = "myop_backward(Tensor grad, Tensor x) -> Tensor", ...})
 */
#define OPF_OP_TABLE(...)                                                      \
    OPF_EXPORT const opf_op_desc *opforge_op_table(char *err, size_t errlen) { \
        static const opf_op_desc ops[] = {__VA_ARGS__, OPF_OP_END};            \
        (void)err, (void)errlen;                                               \
        return ops;                                                            \
    }

/* A library's kernel families (variant tables, runtime.h), listed by
 * `opforge info --load`: OPF_KERNEL_FAMILIES(&myop_variants, ...) exports them
 * as opforge_kernel_families(&count). Optional. */
#define OPF_KERNEL_FAMILIES(...)                                                \
    OPF_EXPORT const opf_variants *const *opforge_kernel_families(int *count) { \
        static const opf_variants *const families[] = {__VA_ARGS__};            \
        *count = (int)(sizeof families / sizeof families[0]);                   \
        return families;                                                        \
    }

/* ---- glue helpers (csrc/torch/glue.c) ---------------------------------------- */

typedef struct opf_tensor {
    AtenTensorHandle h;
    void *data;
    int64_t ndim, numel;
    const int64_t *sizes, *strides;
    int32_t dtype;       /* torch's code, see opf_dtype_of */
    int32_t device_type; /* torch's code */
} opf_tensor;

void opf_tensor_release(AtenTensorHandle *h);
#define OPF_OWNED __attribute__((cleanup(opf_tensor_release)))

/* Takes ownership of stack[i] as a tensor handle named `var##_h`. */
#define OPF_ARG_TENSOR(var, stack, i) OPF_OWNED AtenTensorHandle var##_h = (AtenTensorHandle)(stack)[i]

/* Hands an output tensor to the caller: stack[i] owns it from here on. */
#define OPF_RETURN(stack, i, handle)         \
    do {                                     \
        (stack)[i] = (StableIValue)(handle); \
        (handle) = NULL;                     \
    } while (0)

/* A `Tensor?` argument: the owned handle, or NULL for None (frees torch's box). */
AtenTensorHandle opf_arg_optional_tensor(StableIValue v);
/* A `float?` argument: 1 and *out = the value, or 0 for None (frees torch's box). */
int opf_arg_optional_double(StableIValue v, double *out);
double opf_arg_double(StableIValue v);
int64_t opf_arg_int(StableIValue v);
int opf_arg_bool(StableIValue v);
/* A `str` argument with a fixed set of values ("none|silu|gelu", the descriptor's .enums list): the
 * index of the value given, or fails "[ns::op] argument 'act' must be one of 'none', 'silu', 'gelu',
 * got 'relu'". Frees torch's string on every path; read it right after OPF_ARG_TENSOR, before anything
 * that may fail (which would leave the string to no one). Of several, a refused one leaves those after
 * it unread: a few bytes, on an error path. */
int opf_arg_enum(const char *op, const char *arg, StableIValue v, const char *values);
/* The same for a `str?` argument: -1 for None. */
int opf_arg_optional_enum(const char *op, const char *arg, StableIValue v, const char *values);
/* An `int[]` argument: its values into out (at most max: a longer list fails naming op, argument and
 * max), their count returned; frees torch's list. */
int64_t opf_arg_int_list(const char *op, const char *arg, StableIValue v, int64_t *out, int64_t max);
/* An `int?` argument: 1 and *out = the value, or 0 for None (frees torch's box). */
int opf_arg_optional_int(StableIValue v, int64_t *out);

/* Raises RuntimeError("[ns::op] <message>"); never returns. */
void opf_fail(const char *op, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
/* Reads a tensor's metadata; fails naming op and argument. */
opf_tensor opf_tensor_info(const char *op, const char *arg, AtenTensorHandle h);
/* The opf_dtype of a float32/float64/bfloat16/float16 tensor, or fails naming
 * op, argument, the accepted dtypes and the dtype given. */
opf_dtype opf_check_float(const char *op, const char *arg, const opf_tensor *t);
/* A set of accepted dtypes: OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_BF16) | ... */
#define OPF_DTYPE_BIT(dt) (1u << (dt))
#define OPF_DTYPES_FLOAT \
    (OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_F64) | OPF_DTYPE_BIT(OPF_BF16) | OPF_DTYPE_BIT(OPF_F16))
/* The opf_dtype of t when `accepted` holds it, or fails naming op, argument,
 * exactly the accepted dtypes and the dtype given:
 * "[ns::op] argument 'x' must be float32, bfloat16 or float16, got float64". */
opf_dtype opf_check_dtype(const char *op, const char *arg, const opf_tensor *t, unsigned accepted);
void opf_check_cpu(const char *op, const char *arg, const opf_tensor *t);
/* For kernels of ops whose descriptor sets .meta: t on the cpu device or meta, and on ref's device (ref
 * may be t itself). A kernel given meta tensors checks and allocates as usual and computes nothing
 * (opf_is_meta): that is how the fake kernel checks what the real one checks. */
void opf_check_device(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg, const opf_tensor *ref);
int opf_is_meta(const opf_tensor *t);
void opf_check_same_shape(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                          const opf_tensor *ref);
void opf_check_same_dtype(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                          const opf_tensor *ref);
/* Shapes, with both sides in the message. A negative dim counts from the end; a dim the tensor lacks
 * fails naming it ("must have at least 2 dims for size(-2), got 1: [5]"), for t and ref alike.
 * t has exactly ndim dims; names (or NULL) says what they are:
 *   "[ns::op] argument 'x' must have 3 dims (B, D, L), got 2: [4, 5]" */
void opf_check_dims(const char *op, const char *arg, const opf_tensor *t, int64_t ndim, const char *names);
/* t.size(dim) == ref.size(ref_dim):
 *   "[ns::op] argument 'weight' must have size(0) == x.size(1) = 64, got 48 (weight: [48, 4], x: [2, 64, 100])" */
void opf_check_size(const char *op, const char *arg, const opf_tensor *t, int64_t dim, const char *ref_arg,
                    const opf_tensor *ref, int64_t ref_dim);
/* t.size(dim) == size: "[ns::op] argument 'freqs' must have size(-1) == 32, got 16 ([8, 16])" */
void opf_check_size_is(const char *op, const char *arg, const opf_tensor *t, int64_t dim, int64_t size);
const char *opf_dtype_name(int32_t torch_dtype);
/* "cpu", "cuda", "meta" or "another device": a device type's name, for error messages. */
const char *opf_device_name(int32_t torch_device_type);
/* "[2, 3, 4]": the sizes of t, for error messages (truncated to len). */
void opf_shape_str(char *buf, size_t len, const opf_tensor *t);
/* "float32[2, 3] bfloat16[3]": the dtypes and sizes of n tensors, for log lines (truncated to len). */
void opf_tensors_str(char *buf, size_t len, int n, const opf_tensor *tensors);

/* New tensor with like's sizes and dtype, strides by opf_output_strides. */
AtenTensorHandle opf_empty_like(const char *op, const opf_tensor *like);
/* New contiguous tensor of sizes and dtype on like's device. */
AtenTensorHandle opf_empty(const char *op, int64_t ndim, const int64_t *sizes, int32_t dtype, const opf_tensor *like);

/* New tensor with explicit strides, on like's device. */
AtenTensorHandle opf_empty_strided(const char *op, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                   int32_t dtype, const opf_tensor *like);
/* Scratch float32 memory of `floats` elements from torch's allocator (so the
 * profiler and memory stats see it), owned by the returned handle. */
AtenTensorHandle opf_workspace(const char *op, int64_t floats, const opf_tensor *like, float **data);

/* At OPFORGE_LOG_LEVEL=info: one line with the op, the tensors' shapes and
 * dtypes, the kernel variants the call picked through opf_variant_pick since
 * t0_us (family:variant; family:picked->ran (why) for one that fell back,
 * opf_variant_fallback; and the highest ISA that ran), the thread count and
 * the microseconds since t0_us. Take t0_us before picking the kernels. */
void opf_log_call(const char *op, double t0_us, int n, const opf_tensor *tensors);

#ifdef __cplusplus
}
#endif

#endif
