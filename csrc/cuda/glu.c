/*
 * CUDA glue of glu and glu_backward: check, guard, stream, allocate through
 * torch, launch (csrc/cuda/glu.cu). The schema, fake kernel, autograd and
 * autocast are the CPU op's (csrc/torch/glu.c), and so are the checks, the
 * messages and the outputs' layout, through the same functions (glu_arg_act
 * and glu_prepare, csrc/torch/glu.h): out, dgate and dup take gate's strides
 * when gate is dense, else they are contiguous (opf_empty_like). Any strides
 * are read in place, the packed (..., 2F) form split by chunk included: the
 * kernel walks rows of the innermost merged dim, 16 bytes at a time where
 * every operand's rows are aligned unit-stride runs.
 */
#include "glu.h"

#include "../torch/glu.h"
#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char FWD[] = OPF_QUALNAME("glu");
static const char BWD[] = OPF_QUALNAME("glu_backward");

/* glu(Tensor gate, Tensor up, str act) -> Tensor */
static void glu_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gate, stack, 0);
    OPF_ARG_TENSOR(up, stack, 1);
    act_kind act = glu_arg_act(FWD, stack[2]);
    /* the guard on gate's GPU before anything is allocated; it checks gate's device first, as glu_prepare does */
    const opf_tensor gate = opf_tensor_info(FWD, "gate", gate_h);
    OPF_CUDA_CALL(call, FWD, &gate, "gate");
    OPF_OWNED AtenTensorHandle out_h = NULL;
    const glu_args a = glu_prepare(FWD, opf_check_cuda, NULL, gate_h, up_h, &out_h, NULL);

    opf_cuda_nd nd;
    const int64_t *strides[] = {a.out.strides, a.gate.strides, a.up.strides};
    opf_cuda_nd_init(FWD, &nd, (int)a.gate.ndim, a.gate.sizes, 3, strides);
    const void *ptrs[] = {a.out.data, a.gate.data, a.up.data};
    const int vec = glu_cuda_vector(a.dt, &nd, ptrs, 3);
    unsigned grid = glu_cuda_fwd(a.dt, a.out.data, a.gate.data, a.up.data, &nd, act, call.stream);
    opf_cuda_done(&call, NULL, vec ? "glu_fwd_rows_vec" : "glu_fwd_rows", grid, GLU_CUDA_THREADS, 3,
                  (opf_tensor[]){a.gate, a.up, a.out});
    OPF_RETURN(stack, 0, out_h);
}

/* glu_backward(Tensor grad, Tensor gate, Tensor up, str act) -> (Tensor, Tensor) */
static void glu_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(gate, stack, 1);
    OPF_ARG_TENSOR(up, stack, 2);
    act_kind act = glu_arg_act(BWD, stack[3]);
    const opf_tensor gate = opf_tensor_info(BWD, "gate", gate_h);
    OPF_CUDA_CALL(call, BWD, &gate, "gate");
    OPF_OWNED AtenTensorHandle dgate_h = NULL;
    OPF_OWNED AtenTensorHandle dup_h = NULL;
    const glu_args a = glu_prepare(BWD, opf_check_cuda, grad_h, gate_h, up_h, &dgate_h, &dup_h);

    opf_cuda_nd nd;
    const int64_t *strides[] = {a.out.strides, a.grad.strides, a.gate.strides, a.up.strides};
    opf_cuda_nd_init(BWD, &nd, (int)a.gate.ndim, a.gate.sizes, 4, strides);
    const void *ptrs[] = {a.out.data, a.dup.data, a.grad.data, a.gate.data, a.up.data};
    const int vec = glu_cuda_vector(a.dt, &nd, ptrs, 5);
    unsigned grid =
        glu_cuda_bwd(a.dt, a.out.data, a.dup.data, a.grad.data, a.gate.data, a.up.data, &nd, act, call.stream);
    opf_cuda_done(&call, NULL, vec ? "glu_bwd_rows_vec" : "glu_bwd_rows", grid, GLU_CUDA_THREADS, 4,
                  (opf_tensor[]){a.grad, a.gate, a.up, a.out});
    OPF_RETURN(stack, 0, dgate_h);
    OPF_RETURN(stack, 1, dup_h);
}

OPF_REGISTER_CUDA(glu, glu_cuda);
OPF_REGISTER_CUDA(glu_backward, glu_backward_cuda);
