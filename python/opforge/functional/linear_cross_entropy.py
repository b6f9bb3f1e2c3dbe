"""``linear_cross_entropy``: an LM head and its cross-entropy without the (tokens, vocab) logits."""

from __future__ import annotations

import ctypes

import torch

from .._lib import op_function, require_tensors
from .._runtime import enum_code, library, namespace, ops
from .cross_entropy import REDUCTIONS
from .linear import _operand_dtype

__all__ = ["linear_cross_entropy"]

library.dll.opforge_linear_cross_entropy_block_floats.restype = ctypes.c_int64
library.dll.opforge_linear_cross_entropy_chunk_tokens.restype = ctypes.c_int64
library.dll.opforge_linear_cross_entropy_grad_block_floats_max.restype = ctypes.c_int64
BLOCK_FLOATS = library.dll.opforge_linear_cross_entropy_block_floats()  # the kernel's logits block, read from C
CHUNK_TOKENS = library.dll.opforge_linear_cross_entropy_chunk_tokens()  # the fewest tokens of a chunk, from C
# a float32 forward that makes the gradients: blocks up to the weight's size, at most this many floats (C's)
GRAD_BLOCK_FLOATS_MAX = library.dll.opforge_linear_cross_entropy_grad_block_floats_max()


def vocab_in_one_block(tokens, vocab, budget=BLOCK_FLOATS) -> bool:
    """Whether the kernel's logits blocks span the vocabulary: a chunk of CHUNK_TOKENS tokens (all of
    them, if fewer) and the whole vocabulary fit its budget (BLOCK_FLOATS, or a float32 forward's that
    makes the gradients: :func:`grads_block_floats`; csrc/kernels/linear_cross_entropy.h), so that a
    forward asked for the gradients makes them on the way at no extra GEMM. Sizes may be symbolic (a
    compiled graph guards on the comparison)."""
    return min(max(tokens, 1), CHUNK_TOKENS) * max(vocab, 1) <= budget


def grads_block_floats(vocab, hidden) -> int:
    """The block budget of a float32 forward that makes the gradients, as the kernel sets it: the weight's
    size, at least BLOCK_FLOATS and at most GRAD_BLOCK_FLOATS_MAX."""
    return max(BLOCK_FLOATS, min(vocab * hidden, GRAD_BLOCK_FLOATS_MAX))


# bfloat16 operands: the gradients a forward makes are float32 (the loss's dtype), held to the backward
# and rounded there into new tensors; for a large head that float32 weight gradient (4 V H bytes, written,
# held, read back) costs more than the GEMM it saves. Above this many weight elements the backward
# recomputes the blocks (on torch's GEMM where the provider chose it: oneDNN's AMX tiles) and rounds each
# weight-gradient block of a single token chunk straight into the bfloat16 result. On the AMX Xeon, hidden
# 2048, fwd+bwd against eager: vocab 32000 at 64 / 256 / 1024 tokens 0.45 / 0.57 / 1.09x -> 0.91 / 0.93 /
# 1.14x, vocab 128256 at 64 tokens 0.45 -> 0.98x; the default model's head (8192 x 512) keeps the forward's
# gradients (2.4x eager under autocast). float16 keeps them at any size: its GEMMs are opforge's, where the
# fourth GEMM costs more than the float32 gradient (0.43x -> 0.37x eager at vocab 32000, 64 tokens).
FORWARD_GRADS_BF16_MAX = 1 << 24


@op_function(ops.linear_cross_entropy.default)
def _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap,
                          compute_grad, keep_dlogits):
    """(loss, lse, dhidden, dweight, dbias, dlogits) for reduction mean / sum: see linear_cross_entropy."""


@op_function(ops.linear_cross_entropy_none.default)
def _linear_cross_entropy_none(hidden, weight, target, bias, ignore_index, label_smoothing, softcap):
    """(loss per token, lse) for reduction none: see linear_cross_entropy."""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (an LM head and its loss) without
    the (tokens, vocab) logits: they are made a block of about 2048 tokens x 2048 vocab rows at a time on
    opforge's GEMM, folded into an online log-sum-exp per token, and dropped (with at most as many tokens as
    hidden features, their gradient is kept for the backward instead: see below).

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

    With reduction "mean" or "sum", a gradient needed (grad mode on), float32 or bfloat16 operands and at
    most as many tokens as hidden features (T <= H), the forward keeps the loss's gradient with respect to
    the logits (for a gradient of 1; T x V elements of hidden's dtype, no more than the weight's V x H),
    made from the blocks once each token's log-sum-exp is final, and the backward's GEMMs read it, each
    product times the incoming gradient: eager's three GEMMs (forward, dhidden, dweight), none recomputed
    and nothing scaled or copied, holding half or less of what eager holds (its logits and their
    log-softmax). Else, with the gradients of hidden and weight both needed and
    blocks that span the vocabulary (:func:`vocab_in_one_block`: 256 tokens by the vocabulary within
    about 4M floats, e.g. a vocabulary up to 16384; for float32, within the weight's size up to 64M floats
    (:func:`grads_block_floats`): any vocabulary up to 262144 with 256 or more hidden features, in chunks
    of up to the GEMM's K slice, 1024 tokens with AVX-512), the call also makes the gradients of
    hidden, weight and bias from each chunk's block while it is in the scratch (three GEMMs per block
    instead of the four a recomputing backward runs), in the loss's dtype (rounded to float16 before
    GradScaler's scale, small ones would underflow); they are held from forward to backward, which only
    scales them by the incoming gradient (nothing at a gradient of 1) and, for float32 operands, returns
    them as they are when nothing else refers to them (the graph not retained): the backward's peak holds
    one copy of the gradients (16-bit operands: the float32 ones and their rounding to hidden's dtype, made
    in the backward). With bfloat16 operands
    (or under bfloat16 autocast) only for heads of at most ``FORWARD_GRADS_BF16_MAX`` (2**24) weight
    elements: a larger head's float32 weight gradient would cost more than the GEMM it saves, and the
    backward recomputes the blocks (each weight-gradient block of a single token chunk rounded by the GEMM
    straight into the bfloat16 result).
    Larger vocabularies keep only each token's log-sum-exp (T floats) for the backward, which recomputes
    the blocks: a block then covers part of the vocabulary, a token's log-sum-exp is final only after its
    last one, and the gradients' second sweep must recompute every block wherever it runs. With "none" the per-token gradients are known only in the
    backward, which recomputes the blocks from the saved log-sum-exp. Only the gradients wanted are
    made: with a frozen weight (a frozen LM head, e.g. under LoRA) or hidden, the backward recomputes the
    blocks and runs no GEMM for, and writes nothing into, the gradient not wanted. float32; bfloat16 and float16 (the
    GEMM's 16-bit paths, float32 accumulation, gradients accumulated in float32 and rounded once; for
    bfloat16 the logits block is bfloat16, as eager's logits, half the bytes);
    float64 a reference loop (for gradcheck). The loss is promote(hidden, float32): float32 for 16-bit
    hidden (the log-sum-exp is float32 inside: a 16-bit loss would only round it, and a float16 one would
    overflow GradScaler's scaled gradient, 65536 being past float16's range), float64 for float64.
    Deterministic: the same bits on any thread count. Under ``torch.autocast`` the op runs as torch runs
    ``F.cross_entropy(F.linear(...))``: float32 hidden, weight and bias are cast to the autocast dtype for
    the GEMMs (their gradients come back in float32 through the cast), and the loss is float32. With bfloat16
    operands the logits are rounded to bfloat16 as ``F.linear``'s are (the log-sum-exp and the loss are still
    float32 sums over them).
    """
    code = enum_code(REDUCTIONS, "linear_cross_entropy", "reduction", reduction)
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and isinstance(target, torch.Tensor)):
        require_tensors(f"{namespace}::linear_cross_entropy", hidden=hidden, weight=weight, target=target)
    if hidden.dim() < 1:
        raise RuntimeError(f"[{namespace}::linear_cross_entropy] argument 'hidden' must have at least 1 dim "
                           "(..., hidden), got a 0-d tensor")
    lead = hidden.shape[:-1]
    if tuple(target.shape) != tuple(lead):
        raise RuntimeError(
            f"[{namespace}::linear_cross_entropy] argument 'target' must have the leading dims of 'hidden' "
            f"{list(lead)}, got {list(target.shape)}"
        )
    h2, t1 = hidden.reshape(target.numel(), hidden.shape[-1]), target.reshape(-1)
    if reduction == "none":
        return _linear_cross_entropy_none(h2, weight, t1, bias, ignore_index, float(label_smoothing), softcap)[0].view(
            lead)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                        or isinstance(bias, torch.Tensor) and bias.requires_grad)
    runs_in = _operand_dtype([hidden.dtype])  # autocast's, where it casts
    # at most as many tokens as hidden features: du (T x V) is no larger than the weight (V x H), and the
    # backward's GEMMs read it (eager's three GEMMs); else the forward makes the gradients when hidden's and
    # weight's are both wanted and the blocks span the vocabulary; else (a frozen head or hidden, a large
    # vocabulary) the backward recomputes the blocks and makes only the wanted ones
    keep = grad and h2.shape[0] <= h2.shape[1] and runs_in in (torch.float32, torch.bfloat16)
    # the budget is asked only here: with symbolic sizes each comparison in it is a guard of the graph
    compute_grad = (grad and not keep and hidden.requires_grad and weight.requires_grad
                    and vocab_in_one_block(h2.shape[0], weight.shape[0],
                                           grads_block_floats(weight.shape[0], weight.shape[1])
                                           if runs_in == torch.float32 else BLOCK_FLOATS)
                    and (weight.shape[0] * weight.shape[1] <= FORWARD_GRADS_BF16_MAX or runs_in != torch.bfloat16))
    return _linear_cross_entropy(h2, weight, t1, bias, ignore_index, float(label_smoothing), code, softcap,
                                 compute_grad, keep)[0]
