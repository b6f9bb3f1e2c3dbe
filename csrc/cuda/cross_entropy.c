/*
 * CUDA glue of the fused cross-entropy and its backward: check, guard, stream,
 * allocate through torch, launch (csrc/cuda/cross_entropy.cu). The schemas,
 * fake kernels, autograd and autocast are the CPU ops'
 * (csrc/torch/cross_entropy.c), and so are the checks and the forward's
 * outputs (the CPU glue's functions, csrc/torch/cross_entropy.h, with
 * opf_check_cuda for the devices: losses and loss of the logits' dtype, lse
 * float64), dlogits (contiguous) and the walk: operands of any strides read
 * in place.
 *
 * One difference: the CPU op raises when a target is neither in [0, C) nor
 * ignore_index, before computing anything. The targets live on the GPU here
 * and reading them back would synchronise the stream (and break CUDA graph
 * capture), so the kernels check them instead: such a row's loss and lse are
 * NaN (so are the mean and the sum) and its gradient row is NaN.
 */
#include "cross_entropy.h"

#include "../kernels/cross_entropy.h"
#include "../torch/cross_entropy.h"
#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

static const char CE[] = OPF_QUALNAME("cross_entropy");
static const char CEB[] = OPF_QUALNAME("cross_entropy_backward");

/* The CUDA kernels' view of the checked arguments: the scalars of a.p, the class stride and the
 * rows over the lead dims (operand 0 the row index, from contiguous strides of the lead sizes; then
 * the logits', the target's and, backward, grad_losses' strides). */
static cross_entropy_cuda_problem cuda_problem(const char *op, const cross_entropy_args *a,
                                               const int64_t *grad_losses_strides) {
    const opf_tensor *x = &a->logits;
    const int lead_ndim = (int)(x->ndim - 1);
    int64_t lead_strides[OPF_MAX_DIMS], step = 1;
    for (int d = lead_ndim - 1; d >= 0; d--) {
        lead_strides[d] = step;
        step *= x->sizes[d];
    }
    cross_entropy_cuda_problem p = {.nrows = a->p.rows,
                                    .classes = a->p.classes,
                                    .class_stride = x->strides[lead_ndim],
                                    .weight_stride = a->p.weight_stride,
                                    .ignore_index = a->p.ignore_index,
                                    .label_smoothing = a->p.label_smoothing,
                                    .softcap = a->p.softcap,
                                    .reduction = a->p.reduction};
    const int64_t *strides[4] = {lead_strides, x->strides, a->target.strides, grad_losses_strides};
    opf_cuda_nd_init(op, &p.rows, lead_ndim, x->sizes, grad_losses_strides ? 4 : 3, strides);
    return p;
}

static void cross_entropy_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(t, stack, 1);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[2]);
    const cross_entropy_args a = cross_entropy_check(CE, opf_check_cuda, x_h, t_h, w_h, stack + 3);
    const opf_tensor *x = &a.logits;
    const opf_dtype dt = a.p.dt;
    OPF_CUDA_CALL(call, CE, x, "logits"); /* the logits' GPU current before anything is allocated */
    OPF_OWNED AtenTensorHandle losses_h = NULL;
    OPF_OWNED AtenTensorHandle loss_h = NULL;
    OPF_OWNED AtenTensorHandle lse_h = NULL;
    cross_entropy_alloc(CE, x, &losses_h, &loss_h, &lse_h);
    opf_tensor losses = opf_tensor_info(CE, "losses", losses_h), loss = opf_tensor_info(CE, "loss", loss_h);
    opf_tensor lse = opf_tensor_info(CE, "lse", lse_h);
    const cross_entropy_cuda_problem p = cuda_problem(CE, &a, NULL);
    float *ws = NULL;
    OPF_OWNED AtenTensorHandle ws_h = opf_workspace(CE, cross_entropy_cuda_fwd_workspace(dt, &p, a.has_weight), x, &ws);
    cross_entropy_cuda_launch r = cross_entropy_cuda_fwd(dt, losses.data, loss.data, lse.data, x->data, a.target.data,
                                                         a.has_weight ? a.weight.data : NULL, ws, &p, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 2, (opf_tensor[]){*x, a.target});
    OPF_RETURN(stack, 0, losses_h);
    OPF_RETURN(stack, 1, loss_h);
    OPF_RETURN(stack, 2, lse_h);
}

static void cross_entropy_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {
    (void)nin, (void)nout;
    OPF_ARG_TENSOR(gl, stack, 0);
    OPF_ARG_TENSOR(g, stack, 1);
    OPF_ARG_TENSOR(x, stack, 2);
    OPF_ARG_TENSOR(t, stack, 3);
    OPF_OWNED AtenTensorHandle w_h = opf_arg_optional_tensor(stack[4]);
    OPF_ARG_TENSOR(lse, stack, 5);
    const cross_entropy_args a =
        cross_entropy_backward_check(CEB, opf_check_cuda, gl_h, g_h, x_h, t_h, w_h, lse_h, stack + 6);
    const opf_tensor *x = &a.logits, *lse = &a.lse;
    const opf_dtype dt = a.p.dt;
    OPF_CUDA_CALL(call, CEB, x, "logits"); /* the logits' GPU current before anything is allocated */
    OPF_OWNED AtenTensorHandle dx_h = opf_empty(CEB, x->ndim, x->sizes, x->dtype, x);
    opf_tensor dx = opf_tensor_info(CEB, "dlogits", dx_h);
    const cross_entropy_cuda_problem p = cuda_problem(CEB, &a, a.grad_losses.strides);
    float *ws = NULL;
    const int64_t ws_floats = cross_entropy_cuda_bwd_workspace(dt, &p, a.has_weight);
    OPF_OWNED AtenTensorHandle ws_h = ws_floats > 0 ? opf_workspace(CEB, ws_floats, x, &ws) : NULL;
    cross_entropy_cuda_launch r = cross_entropy_cuda_bwd(
        dt, dx.data, x->data, a.target.data, a.has_weight ? a.weight.data : NULL, a.grad_losses.data, a.grad_loss.data,
        lse->data, lse->dtype == aoti_torch_dtype_float32(), ws, &p, call.stream);
    opf_cuda_done(&call, NULL, r.kernel, r.grid, (int)r.block, 3, (opf_tensor[]){*x, a.target, dx});
    OPF_RETURN(stack, 0, dx_h);
}

OPF_REGISTER_CUDA(cross_entropy, cross_entropy_cuda);
OPF_REGISTER_CUDA(cross_entropy_backward, cross_entropy_backward_cuda);
