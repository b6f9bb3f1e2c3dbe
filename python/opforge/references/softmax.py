"""The references of softmax and log_softmax and their backwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import Reference, randn

__all__ = ["log_softmax", "log_softmax_backward", "softmax", "softmax_backward"]


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.log_softmax(x, dim)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return y * (grad - (grad * y).sum(dim, keepdim=True))


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return grad - y.exp() * grad.sum(dim, keepdim=True)


def _softmax_inputs(dtype):
    return [(randn(5, 13, seed=1) * 3, -1), (randn(13, 5, seed=2).t(), 0), (randn(2, 3, 7, seed=3), 1)]


def _softmax_backward_inputs(log: bool):
    def inputs(dtype):
        out = []
        for x, dim in _softmax_inputs(dtype):
            y = (F.log_softmax if log else F.softmax)(x, dim)
            out.append((randn(*x.shape, seed=4), y, dim))
        return out

    return inputs


REFERENCES: dict[str, Reference] = {
    "softmax": Reference(softmax, _softmax_inputs),
    "log_softmax": Reference(log_softmax, _softmax_inputs),
    "softmax_backward": Reference(softmax_backward, _softmax_backward_inputs(False), grad=False),
    "log_softmax_backward": Reference(log_softmax_backward, _softmax_backward_inputs(True), grad=False),
}
