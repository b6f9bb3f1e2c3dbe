"""``scaled_dot_product_attention``: flash-style attention (the op ``attention``), with its backward."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .._lib import op_function, require_tensors
from .._runtime import library, namespace, ops
from .linear import _operand_dtype, _routed, _small_class

__all__ = ["scaled_dot_product_attention"]

@op_function(ops.attention.default)
def _attention(q, k, v, attn_mask, causal, scale):
    """(out, lse): see scaled_dot_product_attention."""


_attention_on_torch = library.dll.opforge_attention_on_torch
_attention_on_torch.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] * 3 + [ctypes.c_int64]
_attention_on_torch.restype = ctypes.c_int
library.dll.opforge_attention_torch_min_work.restype = ctypes.c_int64
# B H N S D multiply-adds from which the op offers a call to torch's kernel (below: timed whole, with a gradient)
_TORCH_MIN_WORK = library.dll.opforge_attention_torch_min_work()


def _sdpa_small(key, q, k, v, causal: bool, scale, needs_grad: bool) -> int:
    """Whether F.scaled_dot_product_attention runs these operands about as fast as the op or faster, timed
    whole (_small_class, whose codes it returns): for small problems, where the op's fixed costs outweigh
    its kernel's speed."""
    gqa = q.shape[1] != k.shape[1]
    return _small_class(
        key, lambda a, b, c: _attention(a, b, c, None, causal, scale)[0],
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=scale, enable_gqa=gqa),
        (q, k, v), needs_grad)


def _plain_on_torch(q, k, v, causal: bool, scale, needs_grad: bool) -> bool:
    """Whether an unmasked attention of these 4-d operands, eager and on plain CPU tensors, runs torch's
    fused CPU attention for its forward and (needs_grad) its backward: the provider's mode torch, or
    classes auto mode settled for torch (csrc/torch/attention.c: opforge_attention_on_torch). The op
    would then only add its autograd hop through Python and its copies of the log-sum-exp. Small
    problems, which the op never offers torch's kernel, are timed whole on both sides in auto mode
    (_sdpa_small: on the first call of a class and again at its 65th)."""

    def query(key, routed: int) -> int:
        if not (q.is_cpu and k.is_cpu and v.is_cpu) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return 0
        dt = _operand_dtype([q.dtype, k.dtype, v.dtype])
        # F.scaled_dot_product_attention takes torch's fused kernel for unit-stride rows only (its math path else)
        if dt is None or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return 0
        b, h, n, d = q.shape
        if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
            return 0  # the op's error
        on_torch = _attention_on_torch(b, h, k.shape[1], n, k.shape[2], d, v.shape[3], dt == torch.bfloat16, causal,
                                       needs_grad, routed)
        return _sdpa_small(key, q, k, v, causal, scale, needs_grad) if on_torch == 2 else on_torch

    return _routed("attention causal" if causal else "attention", needs_grad, query, q, k, v)


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
            in memory; ``enable_gqa`` is accepted and not required). A batch
            of 1 beside a batch of B is broadcast, as torch's (a view).
        attn_mask: bool (True = attend) or a float dtype (added to the
            scores; another float dtype than query's is rounded to it, a
            copy), broadcastable to (B, H, N, S).
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

    An unmasked call whose forward and, with a gradient, backward the provider runs on torch's fused
    CPU attention (``OPFORGE_GEMM=torch``, or classes auto mode measured faster there: float32 and
    bfloat16, key/value heads dividing the query heads, unit-stride rows) is
    ``F.scaled_dot_product_attention`` itself in eager mode (``enable_gqa`` where they differ): the same kernel without the op's autograd
    hop through Python and its copies. ``torch.compile`` and ``torch.jit.trace`` record the op.
    """
    if dropout_p != 0.0:
        raise _sdpa_error(f"argument 'dropout_p' must be 0.0 (dropout is not supported), got {dropout_p}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise _sdpa_error(f"argument 'attn_mask' must be a tensor or None, got {type(attn_mask).__name__}")
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        require_tensors(f"{namespace}::scaled_dot_product_attention", query=query, key=key, value=value)
    if attn_mask is not None and attn_mask.is_floating_point() and query.is_floating_point() and \
            attn_mask.dtype != query.dtype and not torch.is_autocast_enabled(query.device.type):
        attn_mask = attn_mask.to(query.dtype)  # as torch's takes a float32 mask beside bfloat16 q: rounded (a copy)
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
    b, bk, bv = query.shape[0], key.shape[0], value.shape[0]
    if (bk != b or bv != b) and len({b, bk, bv} - {1}) == 1:  # torch broadcasts a batch of 1: a stride-0 view
        b = max(b, bk, bv)
        query, key, value = (t if t.shape[0] == b else t.expand(b, *t.shape[1:]) for t in (query, key, value))
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # a small call without a gradient is the op's: its fixed costs there (~6 us more than SDPA's) are
    # about what the routing check would cost
    if attn_mask is None and (needs_grad or query.numel() * key.shape[-2] >= _TORCH_MIN_WORK) and \
            _plain_on_torch(query, key, value, bool(is_causal), scale, needs_grad):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=bool(is_causal), scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = _attention(query, key, value, attn_mask, bool(is_causal), scale)[0]
    return out.squeeze(1) if nd == 3 else out
