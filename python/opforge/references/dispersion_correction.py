"""The reference of dispersion_correction and its backward."""

from __future__ import annotations

import torch

from ._common import Reference

__all__ = ["dispersion_correction", "dispersion_correction_backward"]


def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The brief's reference: y = x * alpha + sqrt(x)."""
    return x * alpha + torch.sqrt(x)


def dispersion_correction_backward(grad: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """dy/dx = alpha + 1 / (2 sqrt(x)), evaluated as autograd evaluates the forward."""
    return grad * alpha + grad / (2 * torch.sqrt(x))


REFERENCES: dict[str, Reference] = {
    "dispersion_correction": Reference(dispersion_correction),
    "dispersion_correction_backward": Reference(dispersion_correction_backward, grad=False),
}
