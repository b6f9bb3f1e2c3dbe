"""``linear`` (a GEMM with its bias and activation fused) and ``matmul``, on opforge's GEMM."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import library, ops

__all__ = ["ACTIVATIONS", "linear", "matmul"]

# the names the linear ops' `str activation` takes, read from the library (csrc/kernels/act.h's ACT_NAMES)
ACTIVATIONS = library.descriptor("linear").enum_values("activation")


@op_function(ops.linear.default)
def _linear(x, weight, bias, activation, save_preact=True):
    """(out, preact): see linear."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "none",
           recompute: bool = False):
    """``act(x @ weight.T + bias)`` in one pass: ``torch.nn.functional.linear``
    with the bias and the activation applied while each output tile is in
    registers.

    Args:
        x: (..., in_features), any strides (read in place).
        weight: (out_features, in_features) as ``nn.Linear`` stores it, any strides.
        bias: (out_features,) or None.
        activation: "none", "relu", "gelu" (exact, erf), "gelu_tanh" or "silu".
        recompute: keep no pre-activation for the backward; the backward
            recomputes it (x @ weight.T + bias) a row chunk at a time. Saves
            an (..., out_features) tensor between forward and backward for one
            more GEMM in the backward (four instead of three).

    float32 runs opforge's GEMM (AVX-512 or AVX2 micro-kernel where
    available); bfloat16 the same GEMM on bfloat16 pairs where the CPU has
    AVX512-BF16 (AMX-BF16 tiles where it has those), else (and float16 always) on operands converted to float32
    while packed (float32 accumulation, one rounding); float64 a reference
    loop (for gradcheck). The pre-activation is kept for the backward only
    when an activation is applied, a gradient is needed (grad mode on and an
    input requires grad) and recompute is off: inference writes the output
    alone. The backward reuses the kept pre-activation as its scratch when
    the graph is not retained. Under autocast the op runs in the autocast
    dtype (policy lower), as F.linear does.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return _linear(x, weight, bias, "none" if activation is None else activation, needs_grad and not recompute)[0]


@op_function(ops.matmul.default)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop. Under autocast
    it runs in the autocast dtype (policy lower), as torch.matmul does."""
