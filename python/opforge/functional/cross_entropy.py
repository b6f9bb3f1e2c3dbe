"""``cross_entropy`` with class-index targets, fused with its backward."""

from __future__ import annotations

import numbers

import torch

from .._lib import op_function, require_tensors
from .._runtime import enum, enum_code, namespace, ops

__all__ = ["REDUCTIONS", "cross_entropy"]

# reduction name -> the code cross_entropy and linear_cross_entropy take, read from the library
REDUCTIONS = enum("reduction")

@op_function(ops.cross_entropy.default)
def _cross_entropy(logits, target, weight, ignore_index, label_smoothing, reduction, softcap):
    """(losses, loss, lse): see cross_entropy."""


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                  softcap: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` with class-index targets, fused
    with its backward: no (rows, C) tensor is kept between forward and
    backward, only a float64 logsumexp per row; the backward recomputes the
    softmax from the logits.

    Args:
        logits: (N, C) as F.cross_entropy takes it, (C,) for one sample, or
            (..., C) with the class dim LAST (F.cross_entropy puts the class
            dim at 1 for inputs of more than 2 dims: pass
            ``logits.movedim(1, -1)``, read in place). Any strides.
        target: int64 class indices of logits' shape without its last dim;
            each in [0, C) or ``ignore_index`` (checked before computing).
            Class probabilities are not supported.
        weight: (C,) class weights of logits' dtype, or None. No gradient
            flows to it.
        ignore_index: rows with this target get loss 0 and gradient 0 and do
            not count in the mean.
        label_smoothing: in [0, 1], as torch defines it (also with weight).
        reduction: "mean" (over the summed target weights, as torch: NaN
            when every row is ignored), "sum" or "none" (per row).
        softcap: None, or c > 0: logits become ``c * tanh(logits / c)``
            before the softmax (Gemma-2 soft-capping), with its derivative in
            the backward.

    float32, bfloat16, float16 (computed in float32) and float64 (double).
    The mean and the sum add fixed blocks of rows in a fixed order: the same
    bits on any thread count. Under ``torch.autocast`` the op runs in float32
    (policy fp32), as torch's autocast runs F.cross_entropy.
    """
    code = enum_code(REDUCTIONS, "cross_entropy", "reduction", reduction)
    if not (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)):
        require_tensors(f"{namespace}::cross_entropy", logits=logits, target=target)
    for arg, value, kind, fast in (("ignore_index", ignore_index, numbers.Integral, (int,)),
                                   ("label_smoothing", label_smoothing, numbers.Real, (int, float))):
        if type(value) not in fast and (isinstance(value, bool) or not isinstance(value, kind)):
            raise RuntimeError(f"[{namespace}::cross_entropy] argument '{arg}' must be "
                               f"{'an int' if kind is numbers.Integral else 'a float'}, "
                               f"got {value!r}: the arguments are (logits, target, weight, ignore_index, "
                               "label_smoothing, reduction, softcap), not F.cross_entropy's positional order "
                               "(size_average, reduce): pass them by keyword")
    if logits.dim() > 2 and target.shape != logits.shape[:-1] and target.shape == logits.shape[:1] + logits.shape[2:]:
        raise RuntimeError(f"[{namespace}::cross_entropy] argument 'target' {list(target.shape)} has the shape of "
                           "torch's (N, C, d1, ...) layout, but the class dim is logits' LAST here: pass "
                           "logits.movedim(1, -1) (a view), or use opforge.nn.CrossEntropyLoss, which takes torch's "
                           "layout")
    losses, loss, _ = _cross_entropy(logits, target, weight, int(ignore_index), float(label_smoothing), code,
                                     None if softcap is None else float(softcap))
    return losses if reduction == "none" else loss
