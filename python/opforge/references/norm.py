"""The references of rms_norm, add_rms_norm and layer_norm and their backwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import Reference, grid

__all__ = ["add_rms_norm", "add_rms_norm_backward", "layer_norm", "layer_norm_backward", "rms_norm",
           "rms_norm_backward"]


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
    x, w = grid(2, 3, 17, seed=1), grid(17, seed=2)
    xt = grid(17, 5, seed=3).t()
    return [(x, w, 1e-6, False), (x, None, 1e-5, False), (xt, w, 1e-6, True)]


def _saved_stats(x, eps, layer):
    """(mean, rstd) in float32, as the forward returns them."""
    x = x.double()
    mean = x.mean(-1) if layer else torch.zeros(x.shape[:-1], dtype=torch.float64)
    var = ((x - mean.unsqueeze(-1)) ** 2).mean(-1)
    return mean.float(), (var + eps).rsqrt().float()


def _rms_norm_backward_inputs(dtype):
    return [(grid(*x.shape, seed=4), x, w, _saved_stats(x, eps, False)[1], eps, off)
            for x, w, eps, off in _rms_norm_inputs(dtype)]


def _add_rms_norm_inputs(dtype):
    # grid values: x + residual is exact in every dtype
    x, r, w = grid(2, 3, 17, seed=1), grid(2, 3, 17, seed=5), grid(17, seed=2)
    return [(x, r, w, 1e-6, False), (grid(6, 17, seed=9), grid(17, 6, seed=6).t(), w, 1e-5, True)]


def _add_rms_norm_backward_inputs(dtype):
    samples = []
    for x, r, w, eps, off in _add_rms_norm_inputs(dtype):
        s = x + r
        samples.append((grid(*s.shape, seed=7), grid(*s.shape, seed=8), s, w, _saved_stats(s, eps, False)[1], eps,
                        off))
    return samples


def _layer_norm_inputs(dtype):
    x, w, b = grid(2, 3, 17, seed=1) + 0.5, grid(17, seed=2), grid(17, seed=3)
    return [(x, w, b, 1e-5), (x, None, None, 1e-5), (grid(17, 5, seed=4).t(), w, None, 1e-6)]


def _layer_norm_backward_inputs(dtype):
    return [(grid(*x.shape, seed=5), x, w, b, *_saved_stats(x, eps, True), eps) for x, w, b, eps in
            _layer_norm_inputs(dtype)]


REFERENCES: dict[str, Reference] = {
    "rms_norm": Reference(rms_norm, _rms_norm_inputs),
    "rms_norm_backward": Reference(rms_norm_backward, _rms_norm_backward_inputs, grad=False),
    "add_rms_norm": Reference(add_rms_norm, _add_rms_norm_inputs),
    "add_rms_norm_backward": Reference(add_rms_norm_backward, _add_rms_norm_backward_inputs, grad=False),
    "layer_norm": Reference(layer_norm, _layer_norm_inputs),
    "layer_norm_backward": Reference(layer_norm_backward, _layer_norm_backward_inputs, grad=False),
}
