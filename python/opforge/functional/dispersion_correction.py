"""``dispersion_correction``: ``x * alpha + sqrt(x)``, the brief's op."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import ops

__all__ = ["dispersion_correction"]


@op_function(ops.dispersion_correction.default)
def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x * alpha + sqrt(x)``, elementwise, in one pass over memory.

    Args:
        x: float32, float64, bfloat16 or float16 tensor on the CPU; any shape
           (0-dim, empty, > 2**31 elements) and any strides: the input is read
           in place, never copied. bfloat16/float16 compute in float32 and round
           once.
        alpha: a Python float, rounded to x's compute type as torch does.

    Returns:
        A new tensor of x's shape and dtype. It takes x's strides when x is
        dense (contiguous, transposed, permuted); otherwise it is contiguous.

    Negative inputs give NaN, as ``torch.sqrt`` does. The gradient is
    ``grad * alpha + grad / (2 * sqrt(x))``, evaluated as autograd evaluates
    the reference (so x = 0 gives inf). Under ``torch.autocast`` the op follows
    its input (policy promote), as eager ``x * alpha + torch.sqrt(x)`` does: a
    float32 x gives float32, a 16-bit x its own dtype.
    """
