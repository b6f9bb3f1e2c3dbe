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


# ---- normalisation --------------------------------------------------------------------------


def _rms(x, weight, eps, offset):
    y = F.rms_norm(x, (x.shape[-1],), None, eps)
    if weight is not None:
        y = y * (1 + weight if offset else weight)
    return y


def rms_norm(x, weight=None, eps: float = 1e-6, offset: bool = False):
    """(y,): torch's F.rms_norm over the last dim, times 1 + weight with offset (Gemma); the op's rstd is
    saved for its backward and has no gradient of its own, so it is checked through rms_norm_backward."""
    return (_rms(x, weight, eps, offset),)


def add_rms_norm(x, residual, weight=None, eps: float = 1e-6, offset: bool = False):
    """(y, s): s = x + residual, y = rms_norm(s) (rstd as in rms_norm)."""
    s = x + residual
    return _rms(s, weight, eps, offset), s


def _grads(fn, grads, inputs):
    """Autograd of fn's outputs against inputs (None where an input is absent: an empty tensor)."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    present = [t for t in leaves if t is not None]
    with torch.enable_grad():
        outs = fn(*leaves)
        got = iter(torch.autograd.grad(outs, present, grads, allow_unused=True))
    return tuple(next(got) if t is not None else grads[0].new_empty(0) for t in leaves)


def rms_norm_backward(grad, x, weight, rstd, eps: float, offset: bool):
    """(dx, dweight), dweight empty without a weight; rstd is recomputed."""
    return _grads(lambda x_, w_: _rms(x_, w_, eps, offset), (grad,), (x, weight))


def add_rms_norm_backward(grad, grad_sum, s, weight, rstd, eps: float, offset: bool):
    """(dx, dresidual, dweight): dx = dresidual = d rms_norm(s) + grad_sum."""
    ds, dw = _grads(lambda s_, w_: _rms(s_, w_, eps, offset), (grad,), (s, weight))
    return ds + grad_sum, ds + grad_sum, dw


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """(y,): torch's F.layer_norm over the last dim; mean and rstd are checked through layer_norm_backward."""
    return (F.layer_norm(x, (x.shape[-1],), weight, bias, eps),)


def layer_norm_backward(grad, x, weight, bias, mean, rstd, eps: float):
    """(dx, dweight, dbias), empty where absent; mean and rstd are recomputed."""
    return _grads(lambda x_, w_, b_: F.layer_norm(x_, (x_.shape[-1],), w_, b_, eps), (grad,), (x, weight, bias))


def _rms_norm_inputs(dtype):
    # leading dims (2, 3) over H = 17, a transposed x read in place; weight, no weight, Gemma's offset
    x, w = _grid(2, 3, 17, seed=1), _grid(17, seed=2)
    xt = _grid(17, 5, seed=3).t()
    return [(x, w, 1e-6, False), (x, None, 1e-5, False), (xt, w, 1e-6, True)]


def _saved_stats(x, eps, layer):
    """(mean, rstd) in float32, as the forward returns them."""
    x = x.double()
    mean = x.mean(-1) if layer else torch.zeros(x.shape[:-1], dtype=torch.float64)
    var = ((x - mean.unsqueeze(-1)) ** 2).mean(-1)
    return mean.float(), (var + eps).rsqrt().float()


def _rms_norm_backward_inputs(dtype):
    return [(_grid(*x.shape, seed=4), x, w, _saved_stats(x, eps, False)[1], eps, off)
            for x, w, eps, off in _rms_norm_inputs(dtype)]


def _add_rms_norm_inputs(dtype):
    # grid values: x + residual is exact in every dtype
    x, r, w = _grid(2, 3, 17, seed=1), _grid(2, 3, 17, seed=5), _grid(17, seed=2)
    return [(x, r, w, 1e-6, False), (_grid(6, 17, seed=9), _grid(17, 6, seed=6).t(), w, 1e-5, True)]


def _add_rms_norm_backward_inputs(dtype):
    samples = []
    for x, r, w, eps, off in _add_rms_norm_inputs(dtype):
        s = x + r
        samples.append((_grid(*s.shape, seed=7), _grid(*s.shape, seed=8), s, w, _saved_stats(s, eps, False)[1], eps,
                        off))
    return samples


def _layer_norm_inputs(dtype):
    x, w, b = _grid(2, 3, 17, seed=1) + 0.5, _grid(17, seed=2), _grid(17, seed=3)
    return [(x, w, b, 1e-5), (x, None, None, 1e-5), (_grid(17, 5, seed=4).t(), w, None, 1e-6)]


def _layer_norm_backward_inputs(dtype):
    return [(_grid(*x.shape, seed=5), x, w, b, *_saved_stats(x, eps, True), eps) for x, w, b, eps in
            _layer_norm_inputs(dtype)]
# ---- softmax, log_softmax, cross_entropy ---------------------------------------------------

def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.log_softmax(x, dim)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return y * (grad - (grad * y).sum(dim, keepdim=True))


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return grad - y.exp() * grad.sum(dim, keepdim=True)


def _softmax_inputs(dtype):
    return [(_randn(5, 13, seed=1) * 3, -1), (_randn(13, 5, seed=2).t(), 0), (_randn(2, 3, 7, seed=3), 1)]


def _softmax_backward_inputs(log: bool):
    def inputs(dtype):
        out = []
        for x, dim in _softmax_inputs(dtype):
            y = (F.log_softmax if log else F.softmax)(x, dim)
            out.append((_randn(*x.shape, seed=4), y, dim))
        return out

    return inputs


def cross_entropy(logits, target, weight, ignore_index: int, label_smoothing: float, reduction: int,
                  softcap: float | None):
    """(losses, loss) of opforge's cross_entropy (class dim last); its third output, the saved lse, is
    not compared. No gradient flows to weight (as torch's)."""
    weight = None if weight is None else weight.detach()
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    flat, t = z.reshape(-1, z.shape[-1]), target.reshape(-1)
    args = dict(weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    losses = F.cross_entropy(flat, t, reduction="none", **args).reshape(target.shape)
    loss = F.cross_entropy(flat, t, reduction="mean" if reduction == 1 else "sum", **args)
    return losses, loss


def cross_entropy_backward(grad_losses, grad_loss, logits, target, weight, lse, ignore_index: int,
                           label_smoothing: float, reduction: int, softcap: float | None):
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        outs = cross_entropy(x, target, weight, ignore_index, label_smoothing, reduction, softcap)
        return torch.autograd.grad(outs, x, (grad_losses, grad_loss))[0]


def _cross_entropy_inputs(dtype):
    x, t = _randn(6, 11, seed=1) * 2, torch.tensor([0, 3, -100, 10, 5, 3])
    w = _randn(11, seed=2).abs() + 0.5
    return [(x, t, None, -100, 0.0, 1, None), (x, t, w, -100, 0.1, 2, None), (x, t, w, -100, 0.2, 0, 4.0),
            (_randn(2, 3, 11, seed=3), torch.tensor([[0, 3, 3], [10, 5, 1]]), None, 3, 0.0, 1, 2.0)]


def _cross_entropy_backward_inputs(dtype):
    out = []
    for x, t, w, ignore, eps, red, cap in _cross_entropy_inputs(dtype):
        z = x if cap is None else cap * torch.tanh(x / cap)
        lse = torch.logsumexp(z.to(dtype).double(), -1).masked_fill(t == ignore, 0)
        # the saved lse: float64 as the forward makes it; float32 (which the op also takes) where the
        # check would cast a float64 one to the op's dtype
        out.append((_randn(*t.shape, seed=5), _randn(seed=6), x, t, w, lse if dtype == torch.float64 else lse.float(),
                    ignore, eps, red, cap))
    return out
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
    "rms_norm": Reference(rms_norm, _rms_norm_inputs),
    "rms_norm_backward": Reference(rms_norm_backward, _rms_norm_backward_inputs, grad=False),
    "add_rms_norm": Reference(add_rms_norm, _add_rms_norm_inputs),
    "add_rms_norm_backward": Reference(add_rms_norm_backward, _add_rms_norm_backward_inputs, grad=False),
    "layer_norm": Reference(layer_norm, _layer_norm_inputs),
    "layer_norm_backward": Reference(layer_norm_backward, _layer_norm_backward_inputs, grad=False),
    "softmax": Reference(softmax, _softmax_inputs),
    "log_softmax": Reference(log_softmax, _softmax_inputs),
    "softmax_backward": Reference(softmax_backward, _softmax_backward_inputs(False), grad=False),
    "log_softmax_backward": Reference(log_softmax_backward, _softmax_backward_inputs(True), grad=False),
    "cross_entropy": Reference(cross_entropy, _cross_entropy_inputs),
    "cross_entropy_backward": Reference(cross_entropy_backward, _cross_entropy_backward_inputs, grad=False),
    "linear_cross_entropy": Reference(linear_cross_entropy, _lce_inputs),
    "linear_cross_entropy_backward": Reference(linear_cross_entropy_backward, _lce_backward_inputs, grad=False),
    "linear_cross_entropy_none": Reference(linear_cross_entropy_none, _lce_none_inputs),
    "linear_cross_entropy_none_backward": Reference(linear_cross_entropy_none_backward, _lce_none_backward_inputs,
                                                    grad=False),
}


# ---- gated linear units -----------------------------------------------------------------------------

GLU_ACTIVATIONS = {4: F.silu, 2: F.gelu, 3: lambda x: F.gelu(x, approximate="tanh")}  # act codes of the op


def glu(gate, up, act: int):
    """act(gate) * up, the eager formula (silu for SwiGLU, gelu for GeGLU)."""
    return GLU_ACTIVATIONS[act](gate) * up


def glu_backward(grad, gate, up, act: int):
    """(dgate, dup) of glu, by autograd of the formula."""
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(glu(gate, up, act), (gate, up), grad)


def _glu_inputs(dtype):
    gate, up = _randn(2, 3, 17, seed=1) * 3, _randn(2, 3, 17, seed=2)
    return [(gate, up, act) for act in GLU_ACTIVATIONS]


def _glu_backward_inputs(dtype):
    return [(_randn(2, 3, 17, seed=3), gate, up, act) for gate, up, act in _glu_inputs(dtype)]


# ---- rotary position embedding --------------------------------------------------------------------------


def rotate_half(x):
    """Hugging Face's rotate_half (Llama, NeoX): (-x2, x1) of the halves."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J's rotate_every_two: (-x[2i+1], x[2i]) for each pair."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope(q, k, cos, sin, position_ids=None, interleaved: bool = False):
    """(q_out, k_out) = x * cos + rotate(x) * sin over the first R = cos.shape[-1] dims, the rest passed
    through; cos / sin (N, R), (B, N, R), (B, 1, N, R), or a (P, R) table indexed by position_ids."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    rot = rotate_every_two if interleaved else rotate_half

    def apply(x):
        xr = x[..., :r]
        return torch.cat((xr * cos + rot(xr) * sin, x[..., r:]), dim=-1)

    return apply(q), apply(k)


def rope_backward(grad_q, grad_k, cos, sin, position_ids=None, interleaved: bool = False):
    """(dq, dk) of rope, by autograd of the formula."""
    q, k = grad_q.detach().clone().requires_grad_(), grad_k.detach().clone().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(rope(q, k, cos, sin, position_ids, interleaved), (q, k), (grad_q, grad_k))


def rope_cos_sin(n: int, r: int, base: float = 10000.0, dtype=torch.float64, interleaved: bool = False):
    """(cos, sin) of shape (n, r) as Hugging Face builds them: frequencies base^(-2i/r) at positions
    0..n-1, the halves repeated (cat) or, interleaved, each frequency twice in a row."""
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope_inputs(dtype):
    # grouped-query heads (4 over 2), N = 7, D = 10 with a partial rotary dim of 6; a table with positions
    q, k = _randn(2, 4, 7, 10, seed=1), _randn(2, 2, 7, 10, seed=2)
    cos, sin = rope_cos_sin(7, 6)
    tcos, tsin = rope_cos_sin(20, 10, interleaved=True)
    pos = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(3))
    return [(q, k, cos, sin, None, False), (q, k, tcos, tsin, pos, True)]


def _rope_backward_inputs(dtype):
    return [(_randn(*q.shape, seed=4), _randn(*k.shape, seed=5), *rest) for q, k, *rest in _rope_inputs(dtype)]


REFERENCES.update({
    "glu": Reference(glu, _glu_inputs),
    "glu_backward": Reference(glu_backward, _glu_backward_inputs, grad=False),
    "rope": Reference(rope, _rope_inputs),
    "rope_backward": Reference(rope_backward, _rope_backward_inputs, grad=False),
})


# ---- decoding attention ------------------------------------------------------------------------


def attention_decode(q, k_cache, v_cache, seq_lens, scale: float | None = None, causal: bool = False):
    """SDPA of each batch row against its first seq_lens[b] cached keys (grouped-query heads repeated),
    causal bottom-right aligned (query i of N sees keys j < seq_lens[b] - N + 1 + i); a query with no
    key gives zeros."""
    n, s_max = q.shape[2], k_cache.shape[2]
    j = torch.arange(s_max, device=q.device)
    limit = seq_lens.to(torch.int64).view(-1, 1, 1, 1)  # (B, 1, 1, 1) against keys (S,)
    if causal:
        limit = limit - n + 1 + torch.arange(n, device=q.device).view(1, 1, n, 1)
    keep = j < limit  # (B, 1, 1 or N, S)
    return _attention(q, k_cache, v_cache, keep, False, scale)[0]


def _attention_decode_inputs(dtype):
    # (B, H, N, D) = (3, 4, 1 or 3, 8) over a cache of 2 KV heads and 11 slots; rows of 11, 0 and 5 keys;
    # the cache as a slice of a longer (B, S_buf, Hkv, D) buffer, read in place
    q1, q3 = _randn(3, 4, 1, 8, seed=1), _randn(3, 4, 3, 8, seed=2)
    k = _randn(3, 14, 2, 8, seed=3).transpose(1, 2)[:, :, :11]
    v = _randn(3, 2, 11, 6, seed=4)
    lens = torch.tensor([11, 0, 5])
    return [(q1, k, v, lens, None, False), (q3, k, v, lens.int(), 0.3, True)]


REFERENCES.update({
    "attention_decode": Reference(attention_decode, _attention_decode_inputs, grad=False),
})
