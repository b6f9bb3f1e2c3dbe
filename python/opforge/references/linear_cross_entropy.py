"""The references of linear_cross_entropy (reductions mean and sum), linear_cross_entropy_none and
their backwards: F.cross_entropy of F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import Reference, grid
from .cross_entropy import REDUCTIONS

# _lce_loss too: tests/python/test_thread_sweep.py calls it as opforge.references._lce_loss
__all__ = ["_lce_loss", "linear_cross_entropy", "linear_cross_entropy_backward", "linear_cross_entropy_none",
           "linear_cross_entropy_none_backward"]

_NAMES = {code: name for name, code in REDUCTIONS.items()}


def _lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, logits=None):
    z = F.linear(hidden, weight, bias)
    if logits is not None:  # the float32 sums rounded to the logits' dtype, as the kernel's bfloat16 block holds them
        z = z.float().to(logits).to(z.dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=_NAMES[reduction])


def linear_cross_entropy(hidden, weight, target, bias, ignore_index: int, label_smoothing: float, reduction: int,
                         softcap: float | None, compute_grad: bool, keep_dlogits: bool = False):
    """(loss,): lse and the gradients (or dlogits) the op may make are checked through the backward ops."""
    return (_lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap),)


def linear_cross_entropy_none(hidden, weight, target, bias, ignore_index: int, label_smoothing: float,
                              softcap: float | None):
    return (_lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, REDUCTIONS["none"], softcap),)


def _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap):
    leaves = [t.detach().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    with torch.enable_grad():
        loss = _lce_loss(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, ignore_index,
                         label_smoothing, reduction, softcap)
        grads = torch.autograd.grad(loss, leaves, grad)
    return grads[0], grads[1], grads[2] if bias is not None else hidden.new_empty(0)


def linear_cross_entropy_backward(grad, hidden, weight, target, bias, lse, dhidden, dweight, dbias,
                                  ignore_index: int, label_smoothing: float, reduction: int, softcap: float | None,
                                  needs: int = 7, dlogits=None):
    """(dhidden, dweight, dbias) of grad * loss, dbias empty without a bias. The op leaves the ones needs does
    not ask for uncomputed, so the samples ask for all."""
    return _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap)


def linear_cross_entropy_none_backward(grad, hidden, weight, target, bias, lse, ignore_index: int,
                                       label_smoothing: float, softcap: float | None, needs: int = 7):
    return _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, REDUCTIONS["none"], softcap)


def _lce_inputs(dtype):
    # 7 tokens (two ignored) over a vocab of 11, hidden 9; with and without bias, smoothing and softcap
    h, w, b = grid(7, 9, seed=1), grid(11, 9, seed=2), grid(11, seed=3)
    y = torch.randint(0, 11, (7,), generator=torch.Generator().manual_seed(4))
    y[2] = y[5] = -100
    return [(h, w, y, None, -100, 0.0, REDUCTIONS["mean"], None, True),
            (h, w, y, b, -100, 0.1, REDUCTIONS["sum"], 4.0, True)]


def _lce_none_inputs(dtype):
    return [(h, w, y, b, ii, ls, cap) for h, w, y, b, ii, ls, _, cap, _ in _lce_inputs(dtype)]


def _lce_lse(h, w, y, b, cap):
    z = F.linear(h.double(), w.double(), None if b is None else b.double())
    return (z if cap is None else cap * torch.tanh(z / cap)).logsumexp(-1).float()


def _lce_backward_inputs(dtype):
    samples = []
    loss_dtype = torch.promote_types(dtype, torch.float32)  # the loss's, and its gradient's
    for h, w, y, b, ii, ls, red, cap, _ in _lce_inputs(dtype):
        h, w, b = h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        e = h.new_empty(0)  # no gradients from the forward: the backward recomputes them from lse
        samples.append((torch.tensor(1.5, dtype=loss_dtype), h, w, y, b, _lce_lse(h, w, y, b, cap), e, e, e, ii, ls,
                        red, cap))
    return samples


def _lce_none_backward_inputs(dtype):
    samples = []
    for h, w, y, b, ii, ls, cap in _lce_none_inputs(dtype):
        h, w, b = h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        samples.append((grid(7, seed=5).to(torch.promote_types(dtype, torch.float32)), h, w, y, b,
                        _lce_lse(h, w, y, b, cap), ii, ls, cap))
    return samples


REFERENCES: dict[str, Reference] = {
    "linear_cross_entropy": Reference(linear_cross_entropy, _lce_inputs),
    "linear_cross_entropy_backward": Reference(linear_cross_entropy_backward, _lce_backward_inputs, grad=False),
    "linear_cross_entropy_none": Reference(linear_cross_entropy_none, _lce_none_inputs),
    "linear_cross_entropy_none_backward": Reference(linear_cross_entropy_none_backward, _lce_none_backward_inputs,
                                                    grad=False),
}
