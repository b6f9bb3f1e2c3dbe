"""``softmax`` and ``log_softmax`` along any dim."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import get_gemm, ops
from .linear import _FLOATS, _routed, _small_class

__all__ = ["log_softmax", "softmax"]


@op_function(ops.softmax.default)
def _softmax(x, dim):
    """See softmax."""


@op_function(ops.log_softmax.default)
def _log_softmax(x, dim):
    """See log_softmax."""


# elements below which a call with a gradient may run torch's function (_small_on_torch)
_SMALL = 1 << 20


def _small_on_torch(kind: str, own, theirs, x: torch.Tensor, dim: int) -> bool:
    """Whether a small eager call with a gradient runs torch's function instead of the op: the op's fixed
    costs (its autograd formula is Python's, ~25 us a forward and backward) outweigh its kernels' speed
    on small tensors. Auto mode times both whole per class (_small_class: the op against
    torch.softmax / torch.log_softmax, forward and backward) and keeps the op only where it is 3% faster;
    mode torch always routes such calls, mode own never. CPU tensors of float32, bfloat16, float16
    (float64, gradcheck's dtype, stays the op's)."""

    def query(key, routed: int) -> int:  # (never 3: nothing to report)
        if not x.is_cpu or x.dtype not in _FLOATS:
            return 0
        mode = get_gemm()
        if mode != "auto":
            return int(mode == "torch")
        return _small_class(key, lambda a: own(a, dim), lambda a: theirs(a, dim), (x,), True)

    return _routed(kind, 1, query, x, extra=(dim,))


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

    A small eager call with a gradient (under 2^20 elements, on the CPU) that
    torch.softmax runs about as fast or faster, as measured per class in the GEMM
    provider's auto mode (``OPFORGE_GEMM``; mode torch: every such call),
    is ``torch.softmax`` itself: there the op's autograd formula, which is
    Python's, costs more than its kernels save.
    """
    if getattr(x, "requires_grad", False) and x.numel() < _SMALL and torch.is_grad_enabled() and \
            _small_on_torch("softmax", _softmax, torch.softmax, x, dim):
        return torch.softmax(x, dim)
    return _softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.nn.functional.log_softmax(x, dim)``: ``x - max - log(sum(exp(x - max)))`` along ``dim``.

    Layouts, dtypes and autocast as :func:`softmax`. Entries of -inf give
    exactly -inf (and a finite gradient); a row of -inf only, or one holding
    +inf or NaN, is NaN, as torch's. The backward uses the saved output alone:
    ``dx = dy - exp(y) * sum(dy)``. Small eager calls with a gradient may be
    ``torch.log_softmax`` itself, as for :func:`softmax`.
    """
    if getattr(x, "requires_grad", False) and x.numel() < _SMALL and torch.is_grad_enabled() and \
            _small_on_torch("log_softmax", _log_softmax, torch.log_softmax, x, dim):
        return torch.log_softmax(x, dim)
    return _log_softmax(x, dim)
