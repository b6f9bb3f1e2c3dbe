"""``scaled_dot_product_attention``: flash-style attention (the op ``attention``), with its backward."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import namespace, ops

__all__ = ["scaled_dot_product_attention"]


@op_function(ops.attention.default)
def _attention(q, k, v, attn_mask, causal, scale):
    """(out, lse): see scaled_dot_product_attention."""


def _sdpa_error(msg: str) -> RuntimeError:
    return RuntimeError(f"[{namespace}::scaled_dot_product_attention] {msg}")


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` in one fused C
    kernel (flash style: the N x S score matrix is never stored).

    Args:
        query: (B, H, N, D) or (B, N, D); any strides, so the usual
            ``x.view(B, N, H, D).transpose(1, 2)`` is read in place.
        key, value: (B, Hkv, S, D) and (B, Hkv, S, Dv); Hkv may divide H
            (grouped-query / multi-query attention: K and V are not repeated
            in memory; ``enable_gqa`` is accepted and not required).
        attn_mask: bool (True = attend) or the dtype of query (added to the
            scores), broadcastable to (B, H, N, S).
        dropout_p: must be 0.0 (dropout is not supported).
        is_causal: top-left aligned causal mask (query i sees keys j <= i), as
            torch's; may be combined with attn_mask (both apply).
        scale: defaults to 1 / sqrt(D).

    float32, bfloat16, float16 (computed in float32, rounded once) and float64
    (reference loop, for gradcheck). Rows with no key left give zeros, as
    torch's. The output is (B, H, N, Dv) laid out as (B, N, H, Dv) in memory,
    so ``out.transpose(1, 2).reshape(B, N, H * Dv)`` is a view. Gradients
    flow to query, key and value (not to a float attn_mask), bitwise the same
    run to run and on any thread count. Empty shapes (B, H, N or S = 0)
    behave as torch's: S = 0 gives zeros. Under autocast it runs in the
    autocast dtype (policy lower), as F.scaled_dot_product_attention does.
    """
    if dropout_p != 0.0:
        raise _sdpa_error(f"argument 'dropout_p' must be 0.0 (dropout is not supported), got {dropout_p}")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise _sdpa_error("argument 'attn_mask' requires grad, but opforge computes no gradient for the mask: "
                          "pass attn_mask.detach()")
    nd = query.dim()
    if nd not in (3, 4) or key.dim() != nd or value.dim() != nd:
        raise _sdpa_error(
            "arguments 'query', 'key' and 'value' must all be 4-d (B, H, N, D) or all 3-d (B, N, D), "
            f"got {query.dim()}-d, {key.dim()}-d and {value.dim()}-d"
        )
    if nd == 3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    out = _attention(query, key, value, attn_mask, bool(is_causal), scale)[0]
    return out.squeeze(1) if nd == 3 else out
