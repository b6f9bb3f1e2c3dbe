"""``attention_decode``: attention of a few new tokens against a KV cache (flash-decoding)."""

from __future__ import annotations

import torch

from .._lib import op_function
from .._runtime import ops

__all__ = ["attention_decode"]


@op_function(ops.attention_decode.default)
def _attention_decode(q, k_cache, v_cache, seq_lens, scale, causal):
    """out: see attention_decode."""


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Attention of a few new tokens against a KV cache (flash-decoding), for inference.

    Args:
        q: (B, H, N, D), the N = 1..16 new tokens' queries; any strides.
        k_cache, v_cache: (B, Hkv, S_max, D) and (B, Hkv, S_max, Dv): the preallocated cache, or any
            strided view of it (e.g. ``buf[:, :, :S_max]`` of a ``(B, S_buf, Hkv, D)`` buffer
            transposed), read in place, never copied. Hkv divides H (grouped-query attention: K/V
            heads are not repeated).
        seq_lens: (B,) int32 or int64, each in [0, S_max]: row b attends to its first seq_lens[b]
            keys, so a padded cache needs no mask; the rest of the cache is never read.
        scale: defaults to 1 / sqrt(D).
        causal: for N > 1, bottom-right aligned: the N new tokens are already appended to the cache
            (at positions seq_lens[b] - N .. seq_lens[b] - 1) and query i sees the keys
            j < seq_lens[b] - N + 1 + i, itself included. With N = 1 it changes nothing.

    Returns (B, H, N, Dv), laid out as (B, N, H, Dv) so that ``out.transpose(1, 2).reshape(B, N, H * Dv)``
    is a view. A query with no key (seq_lens[b] = 0) gives zeros.

    The keys are split into chunks spread over the threads, each chunk's K and V read once for all
    the query heads sharing them; the chunks' partial softmaxes are combined in float32 in a fixed
    order, so results are bitwise the same on any thread count. float32, bfloat16 and float16
    (float32 accumulation; a 16-bit cache read in place and converted in registers) and float64 (a reference loop).
    Forward only: the op has no derivative (an input that requires grad is refused; call it under
    ``torch.no_grad()`` or ``torch.inference_mode()``). Under autocast it runs in the autocast dtype:
    keep the cache in that dtype, or each call converts the whole cache.

    Greedy decoding with a preallocated cache (one layer shown; ``embed``, ``proj_q``, ``proj_kv`` and
    ``head`` stand for the model's own modules)::

        k_buf = torch.zeros(B, Hkv, S_max, D); v_buf = torch.zeros(B, Hkv, S_max, D)
        lens = torch.zeros(B, dtype=torch.int32)
        with torch.inference_mode():
            for step in range(steps):
                q = proj_q(x)                           # (B, H, 1, D)
                k, v = proj_kv(x)                       # (B, Hkv, 1, D) each
                rows = torch.arange(B)
                k_buf[rows, :, lens.long()] = k[:, :, 0]  # append at each row's own length
                v_buf[rows, :, lens.long()] = v[:, :, 0]
                lens += 1
                o = opforge.attention_decode(q, k_buf, v_buf, lens)
                x = embed(head(o.transpose(1, 2).reshape(B, 1, H * D)).argmax(-1))
    """
    return _attention_decode(q, k_cache, v_cache, seq_lens, scale, bool(causal))
