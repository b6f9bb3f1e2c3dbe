/*
 * CUDA glue of softmax, log_softmax and their backwards: check, guard, stream,
 * allocate through torch, launch (csrc/cuda/softmax.cu). The schemas, fake
 * kernels and autograd are the CPU ops' (csrc/torch/softmax.c), and so are the
 * checks (the CPU glue's functions, csrc/torch/softmax.h, with opf_check_cuda
 * for the device), the outputs' layouts (opf_empty_like: x's strides when x is
 * dense, else contiguous) and the walk: no copies, every operand read in place
 * through its strides, along dim when it has stride 1 everywhere, else across
 * a dim that has.
 */
#include "softmax.h"

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "../torch/softmax.h"
#include "opforge/cuda.h"

static const char SM[] = OPF_QUALNAME("softmax");
static const char LSM[] = OPF_QUALNAME("log_softmax");
static const char SMB[] = OPF_QUALNAME("softmax_backward");
static const char LSMB[] = OPF_QUALNAME("log_softmax_backward");

/* the lines of a problem; a 0-d tensor as one element of a 1-d one (as the CPU glue) */
static void plan(const char *op, softmax_cuda_lines *l, const opf_tensor *ref, int dim, int nops,
                 const int64_t *const *strides) {
    static const int64_t one = 1;
    const int64_t *const ones[3] = {&one, &one, &one};
    int rc = ref->ndim == 0 ? softmax_cuda_plan(l, 1, 0, &one, nops, ones)
                            : softmax_cuda_plan(l, (int)ref->ndim, dim, ref->sizes, nops, strides);
    if (rc != 0)
        opf_fail(op,
                 "the operands' strides leave more dims that cannot be merged than the CUDA kernel walks (%d): "
                 "pass contiguous tensors",
                 OPF_CUDA_MAX_DIMS);
}

/* softmax(Tensor x, int dim) -> Tensor, log_softmax(Tensor x, int dim) -> Tensor */
static void softmax_impl(StableIValue *stack, const char *op, int log) {
    OPF_ARG_TENSOR(x, stack, 0);
    const softmax_args a = softmax_check(op, opf_check_cuda, x_h, opf_arg_int(stack[1]));
    const opf_tensor x = a.x;
    OPF_CUDA_CALL(call, op, &x, "x"); /* x's GPU current before anything is allocated */

    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(op, &x);
    opf_tensor y = opf_tensor_info(op, "out", y_h);
    softmax_cuda_lines l;
    const int64_t *strides[] = {y.strides, x.strides};
    plan(op, &l, &x, a.dim, 2, strides);
    softmax_cuda_launch r = softmax_cuda_fwd(a.dt, y.data, x.data, &l, log, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 2, (opf_tensor[]){x, y});
    OPF_RETURN(stack, 0, y_h);
}

/* softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor (and log_softmax_backward) */
static void softmax_backward_impl(StableIValue *stack, const char *op, int log) {
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(y, stack, 1);
    const softmax_backward_args a = softmax_backward_check(op, opf_check_cuda, grad_h, y_h, opf_arg_int(stack[2]));
    const opf_tensor g = a.grad, y = a.y;
    OPF_CUDA_CALL(call, op, &y, "y"); /* y's GPU current before anything is allocated */

    OPF_OWNED AtenTensorHandle dx_h = opf_empty_like(op, &y);
    opf_tensor dx = opf_tensor_info(op, "out", dx_h);
    softmax_cuda_lines l;
    const int64_t *strides[] = {dx.strides, g.strides, y.strides};
    plan(op, &l, &y, a.dim, 3, strides);
    softmax_cuda_launch r = softmax_cuda_bwd(a.dt, dx.data, g.data, y.data, &l, log, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 3, (opf_tensor[]){g, y, dx});
    OPF_RETURN(stack, 0, dx_h);
}

static void softmax_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_impl(stack, SM, 0);
}
static void log_softmax_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_impl(stack, LSM, 1);
}
static void softmax_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_backward_impl(stack, SMB, 0);
}
static void log_softmax_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    softmax_backward_impl(stack, LSMB, 1);
}

OPF_REGISTER_CUDA(softmax, softmax_cuda);
OPF_REGISTER_CUDA(log_softmax, log_softmax_cuda);
OPF_REGISTER_CUDA(softmax_backward, softmax_backward_cuda);
OPF_REGISTER_CUDA(log_softmax_backward, log_softmax_backward_cuda);
