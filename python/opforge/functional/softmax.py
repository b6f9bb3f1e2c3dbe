"""``softmax`` and ``log_softmax`` along any dim."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import ops

__all__ = ["log_softmax", "softmax"]


@op_function(ops.softmax.default)
def _softmax(x, dim):
    """See softmax."""


@op_function(ops.log_softmax.default)
def _log_softmax(x, dim):
    """See log_softmax."""


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.nn.functional.softmax(x, dim)``: ``exp(x - max) / sum(exp(x - max))`` along ``dim``.

    Any dim and any strides, read in place (never copied): when ``dim`` has
    stride 1 the rows run vectorised along it; otherwise, when another dim has
    stride 1, the reduction walks down the strided ``dim`` with that dim's
    lines vectorised; otherwise each line is a strided scalar loop. The output
    takes x's strides when x is dense, else it is contiguous. float32,
    bfloat16 and float16 compute in float32 (halves round once), float64 in
    double. Entries of -inf give exactly 0 (and a finite gradient); a row of
    -inf only, or one holding +inf or NaN, is NaN, as torch's. The backward
    uses the saved output alone: ``dx = y * (dy - sum(dy * y))``. Under
    ``torch.autocast`` the op runs in the dtype it is given (policy none), as
    F.softmax does on the CPU (torch's CPU autocast lists neither softmax nor
    log_softmax; its CUDA autocast runs them in float32, opforge's does not).
    """
    return _softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.nn.functional.log_softmax(x, dim)``: ``x - max - log(sum(exp(x - max)))`` along ``dim``.

    Layouts, dtypes and autocast as :func:`softmax`. Entries of -inf give
    exactly -inf (and a finite gradient); a row of -inf only, or one holding
    +inf or NaN, is NaN, as torch's. The backward uses the saved output alone:
    ``dx = dy - exp(y) * sum(dy)``.
    """
    return _log_softmax(x, dim)
