"""The references of matmul and linear (with its activations) and their backwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import Reference, activations, grid

__all__ = ["linear", "linear_backward", "matmul", "matmul_backward"]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def matmul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, needs: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db); the op leaves the ones needs does not ask for uncomputed, so the samples ask for both."""
    return grad @ b.transpose(-1, -2), a.transpose(-1, -2) @ grad


def _matmul_inputs(dtype):
    # odd sizes (no multiple of a vector width), a batch, and a transposed operand read in place
    return [(grid(7, 13, seed=1), grid(13, 5, seed=2)),
            (grid(3, 9, 17, seed=3), grid(3, 17, 6, seed=4)),
            (grid(19, 11, seed=5).t(), grid(19, 4, seed=6))]


def _matmul_backward_inputs(dtype):
    return [(grid(*a.shape[:-1], b.shape[-1], seed=7), a, b) for a, b in _matmul_inputs(dtype)]


ACTIVATIONS = activations("linear", "activation")  # name -> torch function


def linear(x, weight, bias, activation: str, save_preact: bool = True):
    """(act(x weight^T + bias),): the pre-activation the op may keep is saved for
    its backward and has no gradient of its own, so it is checked through
    linear_backward rather than here."""
    return (ACTIVATIONS[activation](F.linear(x, weight, bias)),)


def linear_backward(grad, x, weight, bias, preact, activation: str, needs: int = 7):
    """(dx, dweight, dbias), dbias empty without a bias; an empty preact is recomputed. The op leaves
    the ones needs does not ask for uncomputed, so the samples ask for all."""
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
    x, w, b = grid(2, 3, 17, seed=1), grid(9, 17, seed=2), grid(9, seed=3)
    return [(x, w, b if i % 2 else None, act, True) for i, act in enumerate(ACTIVATIONS)]


def _linear_backward_inputs(dtype):
    samples = []
    for x, w, b, act, _ in _linear_inputs(dtype):
        grad = grid(*x.shape[:-1], w.shape[0], seed=4)
        saved = F.linear(x, w, b) if act != "none" else x.new_empty(0)
        samples.append((grad, x, w, b, saved, act))
    return samples


REFERENCES: dict[str, Reference] = {
    "matmul": Reference(matmul, _matmul_inputs),
    "matmul_backward": Reference(matmul_backward, _matmul_backward_inputs, grad=False),
    "linear": Reference(linear, _linear_inputs),
    "linear_backward": Reference(linear_backward, _linear_backward_inputs, grad=False),
}
