"""``linear`` (a GEMM with its bias and activation fused) and ``matmul``, on opforge's GEMM."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .._lib import _compiling, _tracing, op_function
from .._runtime import TORCH_LINEARS, library, ops

__all__ = ["ACTIVATIONS", "linear", "matmul"]

# the names the linear ops' `str activation` takes, read from the library (csrc/kernels/act.h's ACT_NAMES)
ACTIVATIONS = library.descriptor("linear").enum_values("activation")


@op_function(ops.linear.default)
def _linear(x, weight, bias, activation, save_preact=True):
    """(out, preact): see linear."""


_on_torch = library.dll.opforge_linear_on_torch
_on_torch.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] * 3 + [ctypes.c_int64]
_on_torch.restype = ctypes.c_int
_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))  # no subclass with a behavior of its own


def _plain_on_torch(x, weight, bias, needs_grad) -> bool:
    """Whether a plain linear (no activation) of these operands, eager and on plain CPU tensors, has every
    product on torch's GEMM (the provider's mode torch, or classes auto mode settled for torch): the op
    would then fuse nothing F.linear does not, and only add its autograd hop through Python."""
    if _compiling() or _tracing() or type(x) not in _PLAIN or type(weight) not in _PLAIN or type(bias) not in _PLAIN:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 1:
        return False
    dt = x.dtype
    if torch.is_autocast_enabled("cpu") and dt in (torch.float32, torch.bfloat16, torch.float16):
        dt = torch.get_autocast_dtype("cpu")  # the operands F.linear and the op would both run on
    elif weight.dtype != dt or (bias is not None and bias.dtype != dt):
        return False  # the op's error, not F.linear's
    if dt not in (torch.float32, torch.bfloat16) or bias is not None and (bias.device.type != "cpu" or bias.dim() != 1):
        return False
    k = x.shape[-1]
    if x.dim() == 2:
        m, (rsx, csx) = x.shape[0], x.stride()
    elif x.is_contiguous():
        m, rsx, csx = x.numel() // max(k, 1), k, 1
    else:
        return False
    key = (m, weight.shape[0], k, rsx, csx, *weight.stride(), dt == torch.bfloat16, bias is not None, needs_grad,
           torch.get_num_threads())
    if key in TORCH_LINEARS:
        return True
    if weight.shape[1] != k or not _on_torch(*key):
        return False
    TORCH_LINEARS.add(key)
    return True


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

    A plain product (activation "none") whose every GEMM, forward and backward, the GEMM provider runs on
    torch's own (``OPFORGE_GEMM=torch``, or classes auto mode measured faster there) is ``F.linear``
    itself in eager mode: the op would fuse nothing there, and its autograd formula, registered from
    Python, costs ~60-140 us a step more than F.linear's. Auto mode's first calls of a class still run
    the op, which measures them; ``torch.compile`` and ``torch.jit.trace`` record the op.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if activation in (None, "none") and _plain_on_torch(x, weight, bias, needs_grad):
        return F.linear(x, weight, bias)
    return _linear(x, weight, bias, "none" if activation is None else activation, needs_grad and not recompute)[0]


@op_function(ops.matmul.default)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop. Under autocast
    it runs in the autocast dtype (policy lower), as torch.matmul does."""
