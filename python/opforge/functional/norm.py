"""``rms_norm``, ``add_rms_norm`` and ``layer_norm`` over the last dimension."""

from __future__ import annotations

import torch

from .._lib import op_function, require_tensors
from .._runtime import namespace, ops

__all__ = ["add_rms_norm", "layer_norm", "rms_norm"]

@op_function(ops.rms_norm.default)
def _rms_norm(x, weight, eps, offset):
    """(y, rstd): see rms_norm."""


@op_function(ops.add_rms_norm.default)
def _add_rms_norm(x, residual, weight, eps, offset):
    """(y, sum, rstd): see add_rms_norm."""


@op_function(ops.layer_norm.default)
def _layer_norm(x, weight, bias, eps):
    """(y, mean, rstd): see layer_norm."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6,
             offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)`` without
    the normalized_shape argument (the last dimension is normalised).

    Args:
        x: (..., H): float32, float64, bfloat16 or float16, any leading dims and
            any strides: read in place, never copied (a row whose last dim is
            not contiguous runs the scalar loop).
        weight: (H,) of x's dtype, or None (no scaling).
        eps: > 0, added to the mean of squares (rounded to float32 except for
            float64); None, as F.rms_norm: ``torch.finfo(x.dtype).eps``.
        offset: scale by ``1 + weight`` (Gemma) instead of ``weight``.

    Numerics: float32 and the 16-bit types compute in float32 (16-bit values
    converted on load): per row, ``rstd = 1 / sqrt(sum(x*x) / H + eps)``, then
    ``y = (x * rstd) * w`` (``w = 1 + weight`` with offset), rounded once to x's
    dtype -- what torch's F.rms_norm computes for these dtypes. float64
    computes in double. The output is contiguous. The backward saves the
    per-row rstd (float32, R floats) and x, never x-hat; the weight gradient is
    summed over fixed blocks of rows in a fixed order, so it has the same bits
    on any thread count. Under autocast the op runs in x's dtype (policy
    follow), as torch's does: torch runs F.rms_norm in the dtype of its input
    (on none of its autocast lists) and takes float32 parameters beside 16-bit
    activations, so float32 parameters are cast to a 16-bit x's dtype (a cast
    in the graph: their gradients come back in float32).
    """
    if isinstance(weight, (int, tuple, list, torch.Size)):
        _shape_given("rms_norm", weight)
    if eps is None and isinstance(x, torch.Tensor):  # as F.rms_norm: the machine epsilon of x's dtype
        eps = torch.finfo(x.dtype).eps
    return _rms_norm(x, weight, eps, offset)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6,
                 offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual; (rms_norm(s, weight, eps, offset), s)`` in one pass:
    the pre-norm residual stream of Llama-style blocks.

    Args:
        x, residual: (..., H) of one shape and dtype, any strides (read in place).
        weight, eps, offset: as in :func:`rms_norm`.

    Returns:
        ``(y, s)``, both contiguous, of x's dtype. ``s`` is ``x + residual``
        computed in float32 (double for float64) and rounded once to x's dtype,
        exactly torch's ``x + residual``; ``y`` is normalised from that rounded
        ``s`` with float32 accumulation and rounded once, exactly as
        :func:`rms_norm` of the eager ``x + residual`` would be. Gradients flow
        from both outputs: ``dx = dresidual = d rms_norm(s) + grad_s``, computed
        in float32 and rounded once.

    Under autocast, where a 16-bit branch output meets a float32 residual
    stream, x and residual of different dtypes are both cast to the wider one
    (a copy of the narrower), as eager ``x + residual`` promotes; outside
    autocast they must have one dtype.
    """
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)):
        require_tensors(f"{namespace}::add_rms_norm", x=x, residual=residual)
    if eps is None:  # as F.rms_norm: the machine epsilon of the sum's dtype
        eps = torch.finfo(torch.promote_types(x.dtype, residual.dtype)).eps
    if x.dtype != residual.dtype and torch.is_autocast_enabled(x.device.type):
        # autocast adds a 16-bit branch output to a float32 stream: x + residual is then float32, as in eager
        wide = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(wide), residual.to(wide)
    y, s, _ = _add_rms_norm(x, residual, weight, eps, offset)
    return y, s


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) * rsqrt(var + eps) * weight + bias``
    (biased variance), ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)``.

    Args:
        x: (..., H), float32, float64, bfloat16 or float16, any strides (read in place).
        weight, bias: (H,) of x's dtype, or None.
        eps: > 0.

    float32 and the 16-bit types compute in float32: per row the mean, then
    the variance of ``x - mean`` (two passes over the row while it is in
    cache), ``y = ((x - mean) * rstd) * weight + bias`` rounded once. float64
    computes in double. The backward saves mean and rstd per row (float32),
    never x-hat; weight and bias gradients are deterministic across thread
    counts. Under autocast the op runs in x's dtype (policy follow), as torch's
    does (float32 parameters cast as :func:`rms_norm` casts them).
    """
    if isinstance(weight, (int, tuple, list, torch.Size)):
        _shape_given("layer_norm", weight)
    return _layer_norm(x, weight, bias, eps)[0]


def _shape_given(name: str, shape) -> None:
    """torch's F.rms_norm / F.layer_norm take normalized_shape second; these normalise the last dim and take the
    weight there: say so, rather than the dispatcher's type error."""
    raise RuntimeError(f"[{namespace}::{name}] argument 'weight' must be a tensor or None, got {shape!r}: "
                       f"opforge.{name} normalises the last dim, with no normalized_shape argument "
                       f"(F.{name}(x, normalized_shape, weight, ...) is opforge.{name}(x, weight, ...))")
