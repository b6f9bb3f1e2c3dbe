"""The reference of glu (swiglu, geglu) and its backward."""

from __future__ import annotations

import torch

from ._common import Reference, activations, randn

__all__ = ["glu", "glu_backward"]

GLU_ACTIVATIONS = activations("glu", "act")  # name -> torch function


def glu(gate, up, act: str):
    """act(gate) * up, the eager formula (silu for SwiGLU, gelu for GeGLU)."""
    return GLU_ACTIVATIONS[act](gate) * up


def glu_backward(grad, gate, up, act: str):
    """(dgate, dup) of glu, by autograd of the formula."""
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(glu(gate, up, act), (gate, up), grad)


def _glu_inputs(dtype):
    gate, up = randn(2, 3, 17, seed=1) * 3, randn(2, 3, 17, seed=2)
    return [(gate, up, act) for act in GLU_ACTIVATIONS]


def _glu_backward_inputs(dtype):
    return [(randn(2, 3, 17, seed=3), gate, up, act) for gate, up, act in _glu_inputs(dtype)]


REFERENCES: dict[str, Reference] = {
    "glu": Reference(glu, _glu_inputs),
    "glu_backward": Reference(glu_backward, _glu_backward_inputs, grad=False),
}
