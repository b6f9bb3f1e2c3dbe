/*
 * CUDA glue of rope and rope_backward: check, guard, stream, allocate through
 * torch, launch (csrc/cuda/rope.cu). The schema, fake kernel, autograd and
 * autocast are the CPU op's (csrc/torch/rope.c), and so are the checks, the
 * messages and the outputs' layout, through the same function (rope_prepare,
 * csrc/torch/rope.h): q_out and k_out take the strides of q and k when those
 * are dense, else they are contiguous (opf_empty_like). q, k, cos and sin of
 * any strides are read in place.
 *
 * One difference: the CPU op checks every position id against the rows of
 * the cos / sin table before it writes anything; here the ids live on the
 * GPU and reading them would synchronise the stream (and break CUDA graph
 * capture), so the kernel checks each id as it reads it instead, reads no
 * table row for an id outside [0, P), and writes NaN to every element of q_out
 * and k_out at that position.
 */
#include "rope.h"

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "../torch/rope.h"
#include "opforge/cuda.h"

static const char FWD[] = OPF_QUALNAME("rope");
static const char BWD[] = OPF_QUALNAME("rope_backward");

/* The problem rope_prepare made for the CPU kernels, as the CUDA launcher takes it: the dtype
 * apart, and with the table's rows for the kernel's check of the position ids. */
static rope_cuda_problem cuda_problem(const rope_args *a) {
    const rope_problem *c = &a->p;
    rope_cuda_problem p = {.b = c->b,
                           .hq = c->hq,
                           .hk = c->hk,
                           .n = c->n,
                           .d = c->d,
                           .r = c->r,
                           .interleaved = c->interleaved,
                           .inverse = c->inverse,
                           .q = c->q,
                           .k = c->k,
                           .cos = c->cos,
                           .sin = c->sin,
                           .oq = c->oq,
                           .ok = c->ok,
                           .pos = c->pos,
                           .table_rows = a->has_pos ? a->cos.sizes[0] : 0,
                           .cb = c->cb,
                           .cn = c->cn,
                           .cr = c->cr,
                           .sb = c->sb,
                           .sn = c->sn,
                           .sr = c->sr,
                           .pb = c->pb,
                           .pn = c->pn};
    for (int d = 0; d < 4; d++) p.qs[d] = c->qs[d], p.ks[d] = c->ks[d], p.oqs[d] = c->oqs[d], p.oks[d] = c->oks[d];
    return p;
}

/* The boxed body of both ops: the backward is the forward's transpose (inverse = 1). */
static void rope_call(const char *op, const char *qname, const char *kname, StableIValue *stack, int inverse) {
    OPF_ARG_TENSOR(q, stack, 0);
    OPF_ARG_TENSOR(k, stack, 1);
    OPF_ARG_TENSOR(cos, stack, 2);
    OPF_ARG_TENSOR(sin, stack, 3);
    /* unboxed before the first check that can throw: unboxing frees torch's box */
    OPF_OWNED AtenTensorHandle pos_h = opf_arg_optional_tensor(stack[4]);
    const int interleaved = opf_arg_bool(stack[5]);
    /* the guard on q's GPU before anything is allocated; it checks q's device first, as rope_prepare does */
    const opf_tensor q = opf_tensor_info(op, qname, q_h);
    OPF_CUDA_CALL(call, op, &q, qname);
    OPF_OWNED AtenTensorHandle oq_h = NULL;
    OPF_OWNED AtenTensorHandle ok_h = NULL;
    const rope_args a = rope_prepare(op, qname, kname, opf_check_cuda, q_h, k_h, cos_h, sin_h, pos_h, interleaved,
                                     inverse, &oq_h, &ok_h);

    const rope_cuda_problem p = cuda_problem(&a);
    const int vec = rope_cuda_vector(a.p.dt, &p);
    unsigned grid = rope_cuda(a.p.dt, &p, call.stream);
    opf_cuda_done(&call, NULL, vec ? "rope_rows_vec" : "rope_rows", grid, ROPE_CUDA_THREADS, 4,
                  (opf_tensor[]){a.q, a.k, a.cos, a.oq});
    OPF_RETURN(stack, 0, oq_h);
    OPF_RETURN(stack, 1, ok_h);
}

/* rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved) -> (Tensor, Tensor) */
static void rope_cuda_kernel(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(FWD, "q", "k", stack, 0);
}

/* rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved)
 *   -> (Tensor, Tensor) */
static void rope_backward_cuda_kernel(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    rope_call(BWD, "grad_q", "grad_k", stack, 1);
}

OPF_REGISTER_CUDA(rope, rope_cuda_kernel);
OPF_REGISTER_CUDA(rope_backward, rope_backward_cuda_kernel);
