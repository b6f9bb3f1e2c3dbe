"""The reference of attention_decode (attention against a KV cache)."""

from __future__ import annotations

import torch

from ._common import Reference, randn
from .attention import _attention

__all__ = ["attention_decode"]


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
    q1, q3 = randn(3, 4, 1, 8, seed=1), randn(3, 4, 3, 8, seed=2)
    k = randn(3, 14, 2, 8, seed=3).transpose(1, 2)[:, :, :11]
    v = randn(3, 2, 11, 6, seed=4)
    lens = torch.tensor([11, 0, 5])
    return [(q1, k, v, lens, None, False), (q3, k, v, lens.int(), 0.3, True)]


REFERENCES: dict[str, Reference] = {
    "attention_decode": Reference(attention_decode, _attention_decode_inputs, grad=False),
}
