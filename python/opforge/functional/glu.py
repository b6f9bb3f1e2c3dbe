"""``swiglu`` and ``geglu``: gated linear units (the op ``glu``)."""

from __future__ import annotations

import torch

from .._lib import op_function, require_tensors
from .._runtime import library, namespace, ops

__all__ = ["GLU_ACTIVATIONS", "geglu", "swiglu"]

# the names the glu op's `str act` takes, read from the library
GLU_ACTIVATIONS = library.descriptor("glu").enum_values("act")
GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}

@op_function(ops.glu.default)
def _glu(gate, up, act):
    """act(gate) * up, act one of GLU_ACTIVATIONS: see swiglu and geglu."""


def _glu_halves(name: str, gate: torch.Tensor, up: torch.Tensor | None):
    """(gate, up), splitting a packed (..., 2F) gate as x.chunk(2, -1) does: two views, no copy."""
    if not isinstance(gate, torch.Tensor):
        require_tensors(f"{namespace}::{name}", gate=gate)
    if up is not None:
        return gate, up
    if gate.dim() == 0 or gate.shape[-1] % 2 != 0:
        got = "a 0-d tensor" if gate.dim() == 0 else f"last size {gate.shape[-1]}"
        raise RuntimeError(f"[{namespace}::{name}] argument 'gate' given alone must be packed (..., 2F) "
                           f"(gate then up), with an even last size, got {got}")
    return gate.chunk(2, -1)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP activation) in one pass.

    Args:
        gate, up: (..., F) tensors of one shape, dtype (float32, float64,
            bfloat16, float16) and device; any strides, read in place.
            ``up=None``: ``gate`` is the packed (..., 2F) tensor of a fused
            gate-up projection, split as ``gate.chunk(2, -1)`` (gate first)
            into two views, read in place.

    Returns a new (..., F) tensor, with gate's strides when gate is dense
    (contiguous otherwise). bfloat16 / float16 compute in float32 and round
    once. The backward recomputes silu from gate (nothing else is saved) and
    gives gradients of gate and up (of the packed tensor through autograd's
    chunk, which assembles the two halves in one copy). Under autocast the op
    follows the widest of gate and up (policy promote), as eager
    ``silu(gate) * up`` does: 16-bit with 16-bit stays 16-bit, a float32 one
    makes it float32.
    """
    gate, up = _glu_halves("swiglu", gate, up)
    return _glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` (GeGLU) in one pass; ``approximate`` is
    "none" (exact, erf) or "tanh", as ``torch.nn.functional.gelu`` takes it.
    Everything else as :func:`swiglu` (packed form with ``up=None``)."""
    act = GELU_APPROXIMATE.get(approximate)
    if act is None:
        raise RuntimeError(f"[{namespace}::geglu] argument 'approximate' must be 'none' or 'tanh', got {approximate!r}")
    gate, up = _glu_halves("geglu", gate, up)
    return _glu(gate, up, act)
