"""PyTorch references of opforge's own ops, one per registered op, with the
op's own signature, and the inputs `opforge check` runs them on.

Each reference computes in the dtype it is given (the check hands it float64
copies of the op's inputs). The tests and benchmarks import these, so what is
timed and what is checked is what is tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Reference:
    """A reference callable as the op is, with what checking it needs.

    inputs: dtype -> argument tuples for the op, for ops whose tensors must
    fit each other (matrix shapes); None: generated from the schema (any
    shape will do, as for an elementwise op).
    grad: whether the op has a derivative to compare (backward ops have none).
    """

    fn: Callable
    inputs: Callable[[torch.dtype], Sequence[tuple]] | None = None
    grad: bool = True

    def __call__(self, *args):
        return self.fn(*args)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grid(*shape, seed: int) -> torch.Tensor:
    """Values in [-1, 1] on a grid of 1/8, exact in every dtype: the products and
    sums of a short GEMM are then exact in float32 too, so a check compares the
    op's indexing and its one rounding, not the order of a sum that the
    per-dtype tolerances (made for elementwise ops) leave no room for."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g, dtype=torch.int64).to(torch.float64) / 8


# ---- dispersion_correction ------------------------------------------------------------


def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The brief's reference: y = x * alpha + sqrt(x)."""
    return x * alpha + torch.sqrt(x)


def dispersion_correction_backward(grad: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """dy/dx = alpha + 1 / (2 sqrt(x)), evaluated as autograd evaluates the forward."""
    return grad * alpha + grad / (2 * torch.sqrt(x))


# ---- matmul and linear --------------------------------------------------------------------


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def matmul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad @ b.transpose(-1, -2), a.transpose(-1, -2) @ grad


def _matmul_inputs(dtype):
    # odd sizes (no multiple of a vector width), a batch, and a transposed operand read in place
    return [(_grid(7, 13, seed=1), _grid(13, 5, seed=2)),
            (_grid(3, 9, 17, seed=3), _grid(3, 17, 6, seed=4)),
            (_grid(19, 11, seed=5).t(), _grid(19, 4, seed=6))]


def _matmul_backward_inputs(dtype):
    return [(_grid(*a.shape[:-1], b.shape[-1], seed=7), a, b) for a, b in _matmul_inputs(dtype)]


# activation codes of the linear ops (opforge.functional.ACTIVATIONS)
ACTIVATIONS = [lambda t: t, F.relu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu]


def linear(x, weight, bias, activation: int, save_preact: bool = True):
    """(act(x weight^T + bias),): the pre-activation the op may keep is saved for
    its backward and has no gradient of its own, so it is checked through
    linear_backward rather than here."""
    return (ACTIVATIONS[activation](F.linear(x, weight, bias)),)


def linear_backward(grad, x, weight, bias, preact, activation: int):
    """(dx, dweight, dbias), dbias empty without a bias; an empty preact is recomputed."""
    if preact.numel() == 0:
        preact = F.linear(x, weight, bias)
    pre = preact.detach().requires_grad_()
    with torch.enable_grad():
        (dpre,) = torch.autograd.grad(ACTIVATIONS[activation](pre), pre, grad)
    dpre2 = dpre.reshape(-1, dpre.shape[-1])
    dbias = dpre2.sum(0) if bias is not None else x.new_empty(0)
    return dpre @ weight, dpre2.t() @ x.reshape(-1, x.shape[-1]), dbias


def _linear_inputs(dtype):
    # every activation, with and without a bias, and leading dims (2, 3) over a K of 17
    x, w, b = _grid(2, 3, 17, seed=1), _grid(9, 17, seed=2), _grid(9, seed=3)
    return [(x, w, b if act % 2 else None, act, True) for act in range(len(ACTIVATIONS))]


def _linear_backward_inputs(dtype):
    samples = []
    for x, w, b, act, _ in _linear_inputs(dtype):
        grad = _grid(*x.shape[:-1], w.shape[0], seed=4)
        saved = F.linear(x, w, b) if act else x.new_empty(0)
        samples.append((grad, x, w, b, saved, act))
    return samples


# ---- attention ------------------------------------------------------------------------------


def _attention(q, k, v, attn_mask, causal, scale):
    """(out, lse): softmax(q k^T * scale + mask) v per head, K/V heads repeated for
    grouped-query attention, and each row's log-sum-exp of the scores; rows with
    no key left give zeros, as torch's."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a fully masked row: -inf - -inf
    return p @ v, lse


def attention(q, k, v, attn_mask=None, causal: bool = False, scale: float | None = None):
    """(out,): the op's lse is float32 whatever the dtype and has no gradient of
    its own (the backward reads it as saved), so it is checked through
    attention_backward rather than here."""
    return (_attention(q, k, v, attn_mask, causal, scale)[0],)


def attention_backward(grad, q, k, v, attn_mask, out, lse, causal: bool, scale: float | None):
    """(dq, dk, dv) of attention's out; out and lse are recomputed."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        return torch.autograd.grad(_attention(q, k, v, attn_mask, causal, scale)[0], (q, k, v), grad)


def _attention_inputs(dtype):
    # (B, H, N, D) with grouped-query heads (4 query heads over 2), N != S, odd sizes;
    # unmasked, causal, and a boolean mask with a scale
    q, k, v = _randn(2, 4, 13, 8, seed=1), _randn(2, 2, 21, 8, seed=2), _randn(2, 2, 21, 5, seed=3)
    mask = _randn(13, 21, seed=4) > -1.0
    return [(q, k, v, None, False, None), (q, k, v, None, True, None), (q, k, v, mask, False, 0.3)]


def _attention_backward_inputs(dtype):
    samples = []
    for q, k, v, mask, causal, scale in _attention_inputs(dtype):
        # in dtype, with out and lse as the forward returns them (lse float32 always)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        out, lse = _attention(q.double(), k.double(), v.double(), mask, causal, scale)
        samples.append((_randn(*out.shape, seed=5).to(dtype), q, k, v, mask, out.to(dtype), lse.float(), causal, scale))
    return samples


# ---- softmax, log_softmax, cross_entropy ---------------------------------------------------

def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.log_softmax(x, dim)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return y * (grad - (grad * y).sum(dim, keepdim=True))


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return grad - y.exp() * grad.sum(dim, keepdim=True)


def _softmax_inputs(dtype):
    return [(_randn(5, 13, seed=1) * 3, -1), (_randn(13, 5, seed=2).t(), 0), (_randn(2, 3, 7, seed=3), 1)]


def _softmax_backward_inputs(log: bool):
    def inputs(dtype):
        out = []
        for x, dim in _softmax_inputs(dtype):
            y = (F.log_softmax if log else F.softmax)(x, dim)
            out.append((_randn(*x.shape, seed=4), y, dim))
        return out

    return inputs


def cross_entropy(logits, target, weight, ignore_index: int, label_smoothing: float, reduction: int,
                  softcap: float | None):
    """(losses, loss) of opforge's cross_entropy (class dim last); its third output, the saved lse, is
    not compared. No gradient flows to weight (as torch's)."""
    weight = None if weight is None else weight.detach()
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    flat, t = z.reshape(-1, z.shape[-1]), target.reshape(-1)
    args = dict(weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    losses = F.cross_entropy(flat, t, reduction="none", **args).reshape(target.shape)
    loss = F.cross_entropy(flat, t, reduction="mean" if reduction == 1 else "sum", **args)
    return losses, loss


def cross_entropy_backward(grad_losses, grad_loss, logits, target, weight, lse, ignore_index: int,
                           label_smoothing: float, reduction: int, softcap: float | None):
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        outs = cross_entropy(x, target, weight, ignore_index, label_smoothing, reduction, softcap)
        return torch.autograd.grad(outs, x, (grad_losses, grad_loss))[0]


def _cross_entropy_inputs(dtype):
    x, t = _randn(6, 11, seed=1) * 2, torch.tensor([0, 3, -100, 10, 5, 3])
    w = _randn(11, seed=2).abs() + 0.5
    return [(x, t, None, -100, 0.0, 1, None), (x, t, w, -100, 0.1, 2, None), (x, t, w, -100, 0.2, 0, 4.0),
            (_randn(2, 3, 11, seed=3), torch.tensor([[0, 3, 3], [10, 5, 1]]), None, 3, 0.0, 1, 2.0)]


def _cross_entropy_backward_inputs(dtype):
    out = []
    for x, t, w, ignore, eps, red, cap in _cross_entropy_inputs(dtype):
        z = x if cap is None else cap * torch.tanh(x / cap)
        lse = torch.logsumexp(z.to(dtype).double(), -1).masked_fill(t == ignore, 0)
        # the saved lse: float64 as the forward makes it; float32 (which the op also takes) where the
        # check would cast a float64 one to the op's dtype
        out.append((_randn(*t.shape, seed=5), _randn(seed=6), x, t, w, lse if dtype == torch.float64 else lse.float(),
                    ignore, eps, red, cap))
    return out


REFERENCES: dict[str, Reference] = {
    "dispersion_correction": Reference(dispersion_correction),
    "dispersion_correction_backward": Reference(dispersion_correction_backward, grad=False),
    "matmul": Reference(matmul, _matmul_inputs),
    "matmul_backward": Reference(matmul_backward, _matmul_backward_inputs, grad=False),
    "linear": Reference(linear, _linear_inputs),
    "linear_backward": Reference(linear_backward, _linear_backward_inputs, grad=False),
    "attention": Reference(attention, _attention_inputs),
    "attention_backward": Reference(attention_backward, _attention_backward_inputs, grad=False),
    "softmax": Reference(softmax, _softmax_inputs),
    "log_softmax": Reference(log_softmax, _softmax_inputs),
    "softmax_backward": Reference(softmax_backward, _softmax_backward_inputs(False), grad=False),
    "log_softmax_backward": Reference(log_softmax_backward, _softmax_backward_inputs(True), grad=False),
    "cross_entropy": Reference(cross_entropy, _cross_entropy_inputs),
    "cross_entropy_backward": Reference(cross_entropy_backward, _cross_entropy_backward_inputs, grad=False),
}
