"""The reference of cross_entropy (class dim last) and its backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._runtime import enum
from ._common import Reference, randn

__all__ = ["cross_entropy", "cross_entropy_backward"]

REDUCTIONS = enum("reduction")  # name -> the code the op takes
_NONE, _MEAN, _SUM = REDUCTIONS["none"], REDUCTIONS["mean"], REDUCTIONS["sum"]

def cross_entropy(logits, target, weight, ignore_index: int, label_smoothing: float, reduction: int,
                  softcap: float | None):
    """(losses, loss) of opforge's cross_entropy (class dim last); its third output, the saved lse, is
    not compared. No gradient flows to weight (as torch's)."""
    weight = None if weight is None else weight.detach()
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    flat, t = z.reshape(-1, z.shape[-1]), target.reshape(-1)
    args = dict(weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    losses = F.cross_entropy(flat, t, reduction="none", **args).reshape(target.shape)
    loss = F.cross_entropy(flat, t, reduction="mean" if reduction == _MEAN else "sum", **args)
    return losses, loss


def cross_entropy_backward(grad_losses, grad_loss, logits, target, weight, lse, ignore_index: int,
                           label_smoothing: float, reduction: int, softcap: float | None):
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        outs = cross_entropy(x, target, weight, ignore_index, label_smoothing, reduction, softcap)
        return torch.autograd.grad(outs, x, (grad_losses, grad_loss))[0]


def _cross_entropy_inputs(dtype):
    x, t = randn(6, 11, seed=1) * 2, torch.tensor([0, 3, -100, 10, 5, 3])
    w = randn(11, seed=2).abs() + 0.5
    return [(x, t, None, -100, 0.0, _MEAN, None), (x, t, w, -100, 0.1, _SUM, None), (x, t, w, -100, 0.2, _NONE, 4.0),
            (randn(2, 3, 11, seed=3), torch.tensor([[0, 3, 3], [10, 5, 1]]), None, 3, 0.0, _MEAN, 2.0)]


def _cross_entropy_backward_inputs(dtype):
    out = []
    for x, t, w, ignore, eps, red, cap in _cross_entropy_inputs(dtype):
        z = x if cap is None else cap * torch.tanh(x / cap)
        lse = torch.logsumexp(z.to(dtype).double(), -1).masked_fill(t == ignore, 0)
        # the saved lse: float64 as the forward makes it; float32 (which the op also takes) where the
        # check would cast a float64 one to the op's dtype
        out.append((randn(*t.shape, seed=5), randn(seed=6), x, t, w, lse if dtype == torch.float64 else lse.float(),
                    ignore, eps, red, cap))
    return out


REFERENCES: dict[str, Reference] = {
    "cross_entropy": Reference(cross_entropy, _cross_entropy_inputs),
    "cross_entropy_backward": Reference(cross_entropy_backward, _cross_entropy_backward_inputs, grad=False),
}
