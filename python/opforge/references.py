"""PyTorch references of opforge's own ops, one per registered op, with the
op's own signature, and the inputs `opforge check` runs them on.

Each reference computes in the dtype it is given (the check hands it float64
copies of the op's inputs). The tests and benchmarks import these, so what is
timed and what is checked is what is tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Reference:
    """A reference callable as the op is, with what checking it needs.

    inputs: dtype -> argument tuples for the op, for ops whose tensors must
    fit each other (matrix shapes); None: generated from the schema (any
    shape will do, as for an elementwise op).
    grad: whether the op has a derivative to compare (backward ops have none).
    """

    fn: Callable
    inputs: Callable[[torch.dtype], Sequence[tuple]] | None = None
    grad: bool = True

    def __call__(self, *args):
        return self.fn(*args)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grid(*shape, seed: int) -> torch.Tensor:
    """Values in [-1, 1] on a grid of 1/8, exact in every dtype: the products and
    sums of a short GEMM are then exact in float32 too, so a check compares the
    op's indexing and its one rounding, not the order of a sum that the
    per-dtype tolerances (made for elementwise ops) leave no room for."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g, dtype=torch.int64).to(torch.float64) / 8


# ---- dispersion_correction ------------------------------------------------------------


def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The brief's reference: y = x * alpha + sqrt(x)."""
    return x * alpha + torch.sqrt(x)


def dispersion_correction_backward(grad: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """dy/dx = alpha + 1 / (2 sqrt(x)), evaluated as autograd evaluates the forward."""
    return grad * alpha + grad / (2 * torch.sqrt(x))


# ---- matmul and linear --------------------------------------------------------------------


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def matmul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad @ b.transpose(-1, -2), a.transpose(-1, -2) @ grad


def _matmul_inputs(dtype):
    # odd sizes (no multiple of a vector width), a batch, and a transposed operand read in place
    return [(_grid(7, 13, seed=1), _grid(13, 5, seed=2)),
            (_grid(3, 9, 17, seed=3), _grid(3, 17, 6, seed=4)),
            (_grid(19, 11, seed=5).t(), _grid(19, 4, seed=6))]


def _matmul_backward_inputs(dtype):
    return [(_grid(*a.shape[:-1], b.shape[-1], seed=7), a, b) for a, b in _matmul_inputs(dtype)]


# activation codes of the linear ops (opforge.functional.ACTIVATIONS)
ACTIVATIONS = [lambda t: t, F.relu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu]


def linear(x, weight, bias, activation: int, save_preact: bool = True):
    """(act(x weight^T + bias),): the pre-activation the op may keep is saved for
    its backward and has no gradient of its own, so it is checked through
    linear_backward rather than here."""
    return (ACTIVATIONS[activation](F.linear(x, weight, bias)),)


def linear_backward(grad, x, weight, bias, preact, activation: int):
    """(dx, dweight, dbias), dbias empty without a bias; an empty preact is recomputed."""
    if preact.numel() == 0:
        preact = F.linear(x, weight, bias)
    pre = preact.detach().requires_grad_()
    with torch.enable_grad():
        (dpre,) = torch.autograd.grad(ACTIVATIONS[activation](pre), pre, grad)
    dpre2 = dpre.reshape(-1, dpre.shape[-1])
    dbias = dpre2.sum(0) if bias is not None else x.new_empty(0)
    return dpre @ weight, dpre2.t() @ x.reshape(-1, x.shape[-1]), dbias


def _linear_inputs(dtype):
    # every activation, with and without a bias, and leading dims (2, 3) over a K of 17
    x, w, b = _grid(2, 3, 17, seed=1), _grid(9, 17, seed=2), _grid(9, seed=3)
    return [(x, w, b if act % 2 else None, act, True) for act in range(len(ACTIVATIONS))]


def _linear_backward_inputs(dtype):
    samples = []
    for x, w, b, act, _ in _linear_inputs(dtype):
        grad = _grid(*x.shape[:-1], w.shape[0], seed=4)
        saved = F.linear(x, w, b) if act else x.new_empty(0)
        samples.append((grad, x, w, b, saved, act))
    return samples


# ---- attention ------------------------------------------------------------------------------


def _attention(q, k, v, attn_mask, causal, scale):
    """(out, lse): softmax(q k^T * scale + mask) v per head, K/V heads repeated for
    grouped-query attention, and each row's log-sum-exp of the scores; rows with
    no key left give zeros, as torch's."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a fully masked row: -inf - -inf
    return p @ v, lse


def attention(q, k, v, attn_mask=None, causal: bool = False, scale: float | None = None):
    """(out,): the op's lse is float32 whatever the dtype and has no gradient of
    its own (the backward reads it as saved), so it is checked through
    attention_backward rather than here."""
    return (_attention(q, k, v, attn_mask, causal, scale)[0],)


def attention_backward(grad, q, k, v, attn_mask, out, lse, causal: bool, scale: float | None):
    """(dq, dk, dv) of attention's out; out and lse are recomputed."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        return torch.autograd.grad(_attention(q, k, v, attn_mask, causal, scale)[0], (q, k, v), grad)


def _attention_inputs(dtype):
    # (B, H, N, D) with grouped-query heads (4 query heads over 2), N != S, odd sizes;
    # unmasked, causal, and a boolean mask with a scale
    q, k, v = _randn(2, 4, 13, 8, seed=1), _randn(2, 2, 21, 8, seed=2), _randn(2, 2, 21, 5, seed=3)
    mask = _randn(13, 21, seed=4) > -1.0
    return [(q, k, v, None, False, None), (q, k, v, None, True, None), (q, k, v, mask, False, 0.3)]


def _attention_backward_inputs(dtype):
    samples = []
    for q, k, v, mask, causal, scale in _attention_inputs(dtype):
        # in dtype, with out and lse as the forward returns them (lse float32 always)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        out, lse = _attention(q.double(), k.double(), v.double(), mask, causal, scale)
        samples.append((_randn(*out.shape, seed=5).to(dtype), q, k, v, mask, out.to(dtype), lse.float(), causal, scale))
    return samples


# ---- linear_cross_entropy -------------------------------------------------------------------


def _lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap):
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=("none", "mean", "sum")[reduction])


def linear_cross_entropy(hidden, weight, target, bias, ignore_index: int, label_smoothing: float, reduction: int,
                         softcap: float | None, compute_grad: bool):
    """(loss,): lse and the gradients the op may make are checked through the backward ops."""
    return (_lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap),)


def linear_cross_entropy_none(hidden, weight, target, bias, ignore_index: int, label_smoothing: float,
                              softcap: float | None):
    return (_lce_loss(hidden, weight, target, bias, ignore_index, label_smoothing, 0, softcap),)


def _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap):
    leaves = [t.detach().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    with torch.enable_grad():
        loss = _lce_loss(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, ignore_index,
                         label_smoothing, reduction, softcap)
        grads = torch.autograd.grad(loss, leaves, grad)
    return grads[0], grads[1], grads[2] if bias is not None else hidden.new_empty(0)


def linear_cross_entropy_backward(grad, hidden, weight, target, bias, lse, dhidden, dweight, dbias,
                                  ignore_index: int, label_smoothing: float, reduction: int, softcap: float | None):
    """(dhidden, dweight, dbias) of grad * loss, dbias empty without a bias."""
    return _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap)


def linear_cross_entropy_none_backward(grad, hidden, weight, target, bias, lse, ignore_index: int,
                                       label_smoothing: float, softcap: float | None):
    return _lce_grads(grad, hidden, weight, target, bias, ignore_index, label_smoothing, 0, softcap)


def _lce_inputs(dtype):
    # 7 tokens (two ignored) over a vocab of 11, hidden 9; with and without bias, smoothing and softcap
    h, w, b = _grid(7, 9, seed=1), _grid(11, 9, seed=2), _grid(11, seed=3)
    y = torch.randint(0, 11, (7,), generator=torch.Generator().manual_seed(4))
    y[2] = y[5] = -100
    return [(h, w, y, None, -100, 0.0, 1, None, True), (h, w, y, b, -100, 0.1, 2, 4.0, True)]


def _lce_none_inputs(dtype):
    return [(h, w, y, b, ii, ls, cap) for h, w, y, b, ii, ls, _, cap, _ in _lce_inputs(dtype)]


def _lce_lse(h, w, y, b, cap):
    z = F.linear(h.double(), w.double(), None if b is None else b.double())
    return (z if cap is None else cap * torch.tanh(z / cap)).logsumexp(-1).float()


def _lce_backward_inputs(dtype):
    samples = []
    for h, w, y, b, ii, ls, red, cap, _ in _lce_inputs(dtype):
        h, w, b = h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        e = h.new_empty(0)  # no gradients from the forward: the backward recomputes them from lse
        samples.append((torch.tensor(1.5, dtype=dtype), h, w, y, b, _lce_lse(h, w, y, b, cap), e, e, e, ii, ls, red,
                        cap))
    return samples


def _lce_none_backward_inputs(dtype):
    samples = []
    for h, w, y, b, ii, ls, cap in _lce_none_inputs(dtype):
        h, w, b = h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        samples.append((_grid(7, seed=5).to(dtype), h, w, y, b, _lce_lse(h, w, y, b, cap), ii, ls, cap))
    return samples


REFERENCES: dict[str, Reference] = {
    "dispersion_correction": Reference(dispersion_correction),
    "dispersion_correction_backward": Reference(dispersion_correction_backward, grad=False),
    "matmul": Reference(matmul, _matmul_inputs),
    "matmul_backward": Reference(matmul_backward, _matmul_backward_inputs, grad=False),
    "linear": Reference(linear, _linear_inputs),
    "linear_backward": Reference(linear_backward, _linear_backward_inputs, grad=False),
    "attention": Reference(attention, _attention_inputs),
    "attention_backward": Reference(attention_backward, _attention_backward_inputs, grad=False),
    "linear_cross_entropy": Reference(linear_cross_entropy, _lce_inputs),
    "linear_cross_entropy_backward": Reference(linear_cross_entropy_backward, _lce_backward_inputs, grad=False),
    "linear_cross_entropy_none": Reference(linear_cross_entropy_none, _lce_none_inputs),
    "linear_cross_entropy_none_backward": Reference(linear_cross_entropy_none_backward, _lce_none_backward_inputs,
                                                    grad=False),
}
