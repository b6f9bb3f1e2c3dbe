"""opforge's ops, called like ``torch.nn.functional``.

Each function is the registered ``torch.ops.opforge.<op>``: autograd,
``torch.compile(fullgraph=True)``, autocast and the profiler work on it.
"""

from __future__ import annotations

import torch

from . import _runtime  # noqa: F401  (loads and registers the ops)
from ._lib import op_function


@op_function(torch.ops.opforge.dispersion_correction.default)
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
    the reference (so x = 0 gives inf). Under ``torch.autocast`` the op runs in
    the autocast dtype.
    """


ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}


def _activation_code(activation) -> int:
    code = ACTIVATIONS.get("none" if activation is None else activation)
    if code is None:
        raise RuntimeError(
            f"[opforge.linear] argument 'activation' must be one of {', '.join(map(repr, ACTIVATIONS))} or None, "
            f"got {activation!r}"
        )
    return code


@op_function(torch.ops.opforge.linear.default)
def _linear(x, weight, bias, activation):
    """(out, preact): see linear."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "none"):
    """``act(x @ weight.T + bias)`` in one pass: ``torch.nn.functional.linear``
    with the bias and the activation applied while each output tile is in
    registers.

    Args:
        x: (..., in_features), any strides (read in place).
        weight: (out_features, in_features) as ``nn.Linear`` stores it, any strides.
        bias: (out_features,) or None.
        activation: "none", "relu", "gelu" (exact, erf), "gelu_tanh" or "silu".

    float32 runs opforge's GEMM (AVX2 micro-kernel where available);
    bfloat16 / float16 the same GEMM on operands converted to float32 while
    packed (float32 accumulation, one rounding); float64 a reference loop (for
    gradcheck). The pre-activation is kept for the backward only when an
    activation is applied. Under autocast the op runs in the autocast dtype,
    as F.linear does.
    """
    return _linear(x, weight, bias, _activation_code(activation))[0]


@op_function(torch.ops.opforge.matmul.default)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop."""
