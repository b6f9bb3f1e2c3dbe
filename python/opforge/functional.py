"""opforge's ops, called like ``torch.nn.functional``.

Each function is the registered ``torch.ops.opforge.<op>`` (``opforge.ops``,
the namespace being a build parameter): autograd,
``torch.compile(fullgraph=True)``, autocast and the profiler work on it.
"""

from __future__ import annotations

import torch

from ._lib import op_function
from ._runtime import ops  # loads and registers the ops


@op_function(ops.dispersion_correction.default)
def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x * alpha + sqrt(x)``, elementwise, in one pass over memory.

    Args:
        x: float32, float64, bfloat16 or float16 tensor on the CPU; any shape
           (0-dim, empty, > 2**31 elements) and any strides: the input is read
           in place, never copied. bfloat16/float16 compute in float32 and round
           once.
        alpha: a Python float, rounded to x's compute type as torch does.

    Returns:
        A new tensor of x's shape and dtype. It takes x's strides when x is
        dense (contiguous, transposed, permuted); otherwise it is contiguous.

    Negative inputs give NaN, as ``torch.sqrt`` does. The gradient is
    ``grad * alpha + grad / (2 * sqrt(x))``, evaluated as autograd evaluates
    the reference (so x = 0 gives inf). Under ``torch.autocast`` the op runs in
    the autocast dtype.
    """


ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}


def _activation_code(activation) -> int:
    code = ACTIVATIONS.get("none" if activation is None else activation)
    if code is None:
        raise RuntimeError(
            f"[opforge.linear] argument 'activation' must be one of {', '.join(map(repr, ACTIVATIONS))} or None, "
            f"got {activation!r}"
        )
    return code


@op_function(ops.linear.default)
def _linear(x, weight, bias, activation, save_preact=True):
    """(out, preact): see linear."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "none",
           recompute: bool = False):
    """``act(x @ weight.T + bias)`` in one pass: ``torch.nn.functional.linear``
    with the bias and the activation applied while each output tile is in
    registers.

    Args:
        x: (..., in_features), any strides (read in place).
        weight: (out_features, in_features) as ``nn.Linear`` stores it, any strides.
        bias: (out_features,) or None.
        activation: "none", "relu", "gelu" (exact, erf), "gelu_tanh" or "silu".
        recompute: keep no pre-activation for the backward; the backward
            recomputes it (x @ weight.T + bias) a row chunk at a time. Saves
            an (..., out_features) tensor between forward and backward for one
            more GEMM in the backward (four instead of three).

    float32 runs opforge's GEMM (AVX-512 or AVX2 micro-kernel where
    available); bfloat16 the same GEMM on bfloat16 pairs where the CPU has
    AVX512-BF16 (AMX-BF16 tiles where it has those), else (and float16 always) on operands converted to float32
    while packed (float32 accumulation, one rounding); float64 a reference
    loop (for gradcheck). The pre-activation is kept for the backward only
    when an activation is applied, a gradient is needed (grad mode on and an
    input requires grad) and recompute is off: inference writes the output
    alone. The backward reuses the kept pre-activation as its scratch when
    the graph is not retained. Under autocast the op runs in the autocast
    dtype, as F.linear does.
    """
    code = _activation_code(activation)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return _linear(x, weight, bias, code, needs_grad and not recompute)[0]


@op_function(ops.matmul.default)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop."""


@op_function(ops.attention.default)
def _attention(q, k, v, attn_mask, causal, scale):
    """(out, lse): see scaled_dot_product_attention."""


def _sdpa_error(msg: str) -> RuntimeError:
    return RuntimeError(f"[opforge.scaled_dot_product_attention] {msg}")


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
    behave as torch's: S = 0 gives zeros.
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


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
# the floats of linear_cross_entropy's logits block (LCE_BLOCK_FLOATS in csrc/kernels/linear_cross_entropy.h):
# a problem of at most this many logits is one block, which the forward reuses for the gradients
LCE_BLOCK_FLOATS = 4 << 20


@op_function(ops.linear_cross_entropy.default)
def _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap,
                          compute_grad):
    """(loss, lse, dhidden, dweight, dbias) for reduction mean / sum: see linear_cross_entropy."""


@op_function(ops.linear_cross_entropy_none.default)
def _linear_cross_entropy_none(hidden, weight, target, bias, ignore_index, label_smoothing, softcap):
    """(loss per token, lse) for reduction none: see linear_cross_entropy."""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (an LM head and its loss) without
    the (tokens, vocab) logits: they are made a block of about 2048 tokens x 2048 vocab rows at a time on
    opforge's GEMM, folded into an online log-sum-exp per token, and dropped.

    Args:
        hidden: (..., H); its leading dims are flattened to T tokens (``reshape``: a copy only when they
            cannot be merged as a view), then read in place through its strides.
        weight: (V, H) as ``nn.Linear`` / an LM head stores it, any strides.
        target: (...) int64 class indices in [0, V), or ignore_index; the leading dims of hidden.
        bias: (V,) or None.
        ignore_index: targets equal to it add nothing (and are left out of the mean's count).
        label_smoothing: in [0, 1], as ``F.cross_entropy``'s.
        reduction: "mean" (over the tokens not ignored; NaN when all are, as torch), "sum" or "none"
            (the loss of each token, shaped like target, 0 where ignored).
        softcap: Gemma-2's logit soft-capping, ``softcap * tanh(logits / softcap)`` before the softmax;
            None for none.

    With reduction "mean" or "sum", a gradient needed (grad mode on and an input requiring grad) and
    tokens x vocab <= LCE_BLOCK_FLOATS (the logits are one block), the call also makes the gradients of
    hidden, weight and bias from that block, and the backward only scales them by the incoming gradient.
    Larger problems keep only each token's log-sum-exp (T floats) for the backward, which recomputes the
    blocks: the gradients' second sweep must recompute every block wherever it runs, so running it in the
    forward would save no work, and would hold dweight and dhidden from forward to backward and copy them
    there (twice their size at the peak). With "none" the per-token gradients are known only in the
    backward, which recomputes the blocks from the saved log-sum-exp. float32; bfloat16 and float16 (the GEMM's 16-bit paths, float32 accumulation,
    gradients accumulated in float32 and rounded once; the loss is computed in float32 and returned in the
    input dtype); float64 a reference loop (for gradcheck). Deterministic: the same bits on any thread
    count. Under ``torch.autocast`` the op runs in the autocast dtype (the GEMMs in bfloat16, the
    log-sum-exp and the loss in float32, returned rounded to bfloat16).
    """
    code = REDUCTIONS.get(reduction)
    if code is None:
        raise RuntimeError(
            f"[opforge.linear_cross_entropy] argument 'reduction' must be one of {', '.join(map(repr, REDUCTIONS))}, "
            f"got {reduction!r}"
        )
    if hidden.dim() < 1:
        raise RuntimeError("[opforge.linear_cross_entropy] argument 'hidden' must have at least 1 dim (..., hidden), "
                           "got a 0-d tensor")
    lead = hidden.shape[:-1]
    if tuple(target.shape) != tuple(lead):
        raise RuntimeError(
            f"[opforge.linear_cross_entropy] argument 'target' must have the leading dims of 'hidden' "
            f"{list(lead)}, got {list(target.shape)}"
        )
    h2, t1 = hidden.reshape(target.numel(), hidden.shape[-1]), target.reshape(-1)
    if code == 0:
        return _linear_cross_entropy_none(h2, weight, t1, bias, ignore_index, float(label_smoothing), softcap)[0].view(
            lead)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    one_block = h2.shape[0] * weight.shape[0] <= LCE_BLOCK_FLOATS
    return _linear_cross_entropy(h2, weight, t1, bias, ignore_index, float(label_smoothing), code, softcap,
                                 needs_grad and one_block)[0]
