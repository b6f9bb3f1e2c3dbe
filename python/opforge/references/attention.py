"""The reference of attention (scaled_dot_product_attention) and its backward."""

from __future__ import annotations

import torch

from ._common import Reference, randn

__all__ = ["attention", "attention_backward"]


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
    q, k, v = randn(2, 4, 13, 8, seed=1), randn(2, 2, 21, 8, seed=2), randn(2, 2, 21, 5, seed=3)
    mask = randn(13, 21, seed=4) > -1.0
    return [(q, k, v, None, False, None), (q, k, v, None, True, None), (q, k, v, mask, False, 0.3)]


def _attention_backward_inputs(dtype):
    samples = []
    for q, k, v, mask, causal, scale in _attention_inputs(dtype):
        # in dtype, with out and lse as the forward returns them (lse float32 always)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        out, lse = _attention(q.double(), k.double(), v.double(), mask, causal, scale)
        samples.append((randn(*out.shape, seed=5).to(dtype), q, k, v, mask, out.to(dtype), lse.float(), causal, scale))
    return samples


REFERENCES: dict[str, Reference] = {
    "attention": Reference(attention, _attention_inputs),
    "attention_backward": Reference(attention_backward, _attention_backward_inputs, grad=False),
}
