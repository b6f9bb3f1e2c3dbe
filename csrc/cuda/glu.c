/*
 * CUDA glue of glu and glu_backward: check, guard, stream, allocate through
 * torch, launch (csrc/cuda/glu.cu). The schema, fake kernel, autograd and
 * autocast are the CPU op's (csrc/torch/glu.c), and so are the checks, the
 * messages and the outputs' layout: out, dgate and dup take gate's strides
 * when gate is dense, else they are contiguous (opf_empty_like). Any strides
 * are read in place, the packed (..., 2F) form split by chunk included: the
 * kernel walks rows of the innermost merged dim, 16 bytes at a time where
 * every operand's rows are aligned unit-stride runs.
 */
#include "glu.h"

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char FWD[] = OPF_QUALNAME("glu");
static const char BWD[] = OPF_QUALNAME("glu_backward");

/* the activation names and codes the CPU op registers (csrc/torch/glu.c), for the same message */
extern const opf_enum_desc opf_enum_glu_activation;

static act_kind check_act(const char *op, int64_t act) {
    return (act_kind)opf_check_enum(op, "act", &opf_enum_glu_activation, act);
}

/* gate (already checked on the GPU by OPF_CUDA_CALL) and up: float, one device, dtype and shape */
static opf_dtype check_gate_up(const char *op, const opf_tensor *gate, const opf_tensor *up) {
    opf_check_cuda(op, "up", up, "gate", gate);
    opf_dtype dt = opf_check_float(op, "gate", gate);
    opf_check_same_dtype(op, "up", up, "gate", gate);
    opf_check_same_shape(op, "up", up, "gate", gate);
    return dt;
}

/* glu(Tensor gate, Tensor up, int act) -> Tensor */
static void glu_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gate, stack, 0);
    OPF_ARG_TENSOR(up, stack, 1);
    act_kind act = check_act(FWD, opf_arg_int(stack[2]));
    opf_tensor gate = opf_tensor_info(FWD, "gate", gate_h), up = opf_tensor_info(FWD, "up", up_h);
    OPF_CUDA_CALL(call, FWD, &gate, "gate");
    opf_dtype dt = check_gate_up(FWD, &gate, &up);

    OPF_OWNED AtenTensorHandle out_h = opf_empty_like(FWD, &gate);
    opf_tensor out = opf_tensor_info(FWD, "out", out_h);
    opf_cuda_nd nd;
    const int64_t *strides[] = {out.strides, gate.strides, up.strides};
    opf_cuda_nd_init(FWD, &nd, (int)gate.ndim, gate.sizes, 3, strides);
    const void *ptrs[] = {out.data, gate.data, up.data};
    const int vec = glu_cuda_vector(dt, &nd, ptrs, 3);
    unsigned grid = glu_cuda_fwd(dt, out.data, gate.data, up.data, &nd, act, call.stream);
    opf_cuda_done(&call, NULL, vec ? "glu_fwd_rows_vec" : "glu_fwd_rows", grid, GLU_CUDA_THREADS, 3,
                  (opf_tensor[]){gate, up, out});
    OPF_RETURN(stack, 0, out_h);
}

/* glu_backward(Tensor grad, Tensor gate, Tensor up, int act) -> (Tensor, Tensor) */
static void glu_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(grad, stack, 0);
    OPF_ARG_TENSOR(gate, stack, 1);
    OPF_ARG_TENSOR(up, stack, 2);
    act_kind act = check_act(BWD, opf_arg_int(stack[3]));
    opf_tensor g = opf_tensor_info(BWD, "grad", grad_h);
    opf_tensor gate = opf_tensor_info(BWD, "gate", gate_h), up = opf_tensor_info(BWD, "up", up_h);
    OPF_CUDA_CALL(call, BWD, &gate, "gate");
    opf_dtype dt = check_gate_up(BWD, &gate, &up);
    opf_check_cuda(BWD, "grad", &g, "gate", &gate);
    opf_check_same_dtype(BWD, "grad", &g, "gate", &gate);
    opf_check_same_shape(BWD, "grad", &g, "gate", &gate);

    /* both like gate: one set of strides for the two outputs */
    OPF_OWNED AtenTensorHandle dgate_h = opf_empty_like(BWD, &gate);
    OPF_OWNED AtenTensorHandle dup_h = opf_empty_like(BWD, &gate);
    opf_tensor dgate = opf_tensor_info(BWD, "dgate", dgate_h), dup = opf_tensor_info(BWD, "dup", dup_h);
    opf_cuda_nd nd;
    const int64_t *strides[] = {dgate.strides, g.strides, gate.strides, up.strides};
    opf_cuda_nd_init(BWD, &nd, (int)gate.ndim, gate.sizes, 4, strides);
    const void *ptrs[] = {dgate.data, dup.data, g.data, gate.data, up.data};
    const int vec = glu_cuda_vector(dt, &nd, ptrs, 5);
    unsigned grid = glu_cuda_bwd(dt, dgate.data, dup.data, g.data, gate.data, up.data, &nd, act, call.stream);
    opf_cuda_done(&call, NULL, vec ? "glu_bwd_rows_vec" : "glu_bwd_rows", grid, GLU_CUDA_THREADS, 4,
                  (opf_tensor[]){g, gate, up, dgate});
    OPF_RETURN(stack, 0, dgate_h);
    OPF_RETURN(stack, 1, dup_h);
}

OPF_REGISTER_CUDA(glu, glu_cuda);
OPF_REGISTER_CUDA(glu_backward, glu_backward_cuda);
