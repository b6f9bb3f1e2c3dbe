"""``rope``: rotary position embedding of queries and keys."""

from __future__ import annotations

import torch

from .._lib import op_function, require_tensors
from .._runtime import namespace, ops

__all__ = ["rope"]

@op_function(ops.rope.default)
def _rope(q, k, cos, sin, position_ids, interleaved):
    """(q_out, k_out): see rope."""


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: torch.Tensor | None = None, interleaved: bool = False):
    """Rotary position embedding of queries and keys, ``(q_out, k_out)``: what
    Hugging Face computes as ``q * cos + rotate_half(q) * sin`` (and the same
    for k) in one pass over q and k.

    Args:
        q: (B, Hq, N, D); k: (B, Hk, N, D), any head counts (grouped-query
            attention). Any strides: the usual ``x.view(B, N, H, D).transpose(1, 2)``
            is read in place, and the outputs keep a dense input's layout.
        cos, sin: the dtype of q; (N, R), (B or 1, N, R) or (B or 1, 1, N, R)
            as ``LlamaRotaryEmbedding`` returns them (its ``unsqueeze(1)`` is
            optional), or with ``position_ids`` a (P, R) table whose rows the
            positions pick. R is the rotary dim: even, at most D; dims R..D
            pass through unchanged (partial rotary).
        position_ids: None, or int64 (B or 1, N) rows of the table, each
            checked to lie in [0, P) before anything is computed.
        interleaved: False for the half-split convention (Llama, NeoX:
            ``rotate_half`` pairs dims j and j + R/2); True for GPT-J's
            pairs (2i, 2i + 1) (``rotate_every_two``, with cos / sin given
            per element, each frequency repeated twice).

    float32, float64, bfloat16, float16 (computed in float32, rounded once).
    Gradients flow to q and k (the backward is the transposed rotation: the
    rotation by -theta for Hugging Face's cos / sin); cos and sin are
    constants: if either requires grad while grad mode is on, this raises
    (pass ``cos.detach()``). Under autocast the op follows the widest of q, k,
    cos and sin (policy promote), as eager ``q * cos + rotate_half(q) * sin``
    does: 16-bit q and k with float32 cos / sin (Hugging Face's Llama under
    autocast) give float32, all 16-bit gives 16-bit.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(cos, torch.Tensor)
            and isinstance(sin, torch.Tensor)):
        require_tensors(f"{namespace}::rope", q=q, k=k, cos=cos, sin=sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise RuntimeError(f"[{namespace}::rope] arguments 'cos' and 'sin' must not require grad: opforge computes no "
                           "gradient for them (pass cos.detach() and sin.detach())")
    return _rope(q, k, cos, sin, position_ids, bool(interleaved))
