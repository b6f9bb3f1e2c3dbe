"""The reference of rope and its backward, with Hugging Face's helpers."""

from __future__ import annotations

import torch

from ._common import Reference, randn

__all__ = ["rope", "rope_backward", "rope_cos_sin", "rotate_every_two", "rotate_half"]


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
    q, k = randn(2, 4, 7, 10, seed=1), randn(2, 2, 7, 10, seed=2)
    cos, sin = rope_cos_sin(7, 6)
    tcos, tsin = rope_cos_sin(20, 10, interleaved=True)
    pos = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(3))
    return [(q, k, cos, sin, None, False), (q, k, tcos, tsin, pos, True)]


def _rope_backward_inputs(dtype):
    return [(randn(*q.shape, seed=4), randn(*k.shape, seed=5), *rest) for q, k, *rest in _rope_inputs(dtype)]


REFERENCES: dict[str, Reference] = {
    "rope": Reference(rope, _rope_inputs),
    "rope_backward": Reference(rope_backward, _rope_backward_inputs, grad=False),
}
