"""Modules holding parameters; the work is in opforge.functional."""

from __future__ import annotations

import torch

from . import functional as F
from ._runtime import library
from .functional.attention import _attention


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with a fused activation: ``act(x W^T + b)``.

    Same parameters, initialisation and state_dict keys as ``torch.nn.Linear``
    (a checkpoint of one loads into the other); ``activation`` is "none",
    "relu", "gelu", "gelu_tanh" or "silu". ``recompute=True`` keeps no
    pre-activation for the backward, which recomputes it (see
    :func:`opforge.functional.linear`). Without activation, off the CPU
    (opforge's linear has CPU kernels only) it is ``torch.nn.functional.linear``:
    what :func:`opforge.patch` makes of a plain ``nn.Linear`` keeps working on a
    model moved to the GPU.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "none",
                 device=None, dtype=None, recompute: bool = False):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        library.descriptor("linear").check_enum("activation", activation)  # fail early on an unknown name
        self.activation = activation
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias, self.activation, self.recompute)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}" + (", recompute=True" if self.recompute else "")


def _mha_error(msg: str) -> RuntimeError:
    return RuntimeError(f"[opforge.nn.MultiheadAttention] {msg}")


def _merge_masks(attn_mask, key_padding_mask, b, h, n, s, dtype):
    """nn.MultiheadAttention's masks (bool True = do NOT attend; float added)
    as one scaled_dot_product_attention mask (bool True = attend)."""
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            if attn_mask.shape[0] != b * h:
                raise _mha_error(f"argument 'attn_mask' must be (N, S) or (B * num_heads, N, S) = ({b * h}, {n}, {s}), "
                                 f"got {tuple(attn_mask.shape)}")
            attn_mask = attn_mask.view(b, h, n, s)
        masks.append(attn_mask)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, s):
            raise _mha_error(f"argument 'key_padding_mask' must be (B, S) = ({b}, {s}), got {tuple(key_padding_mask.shape)}")
        masks.append(key_padding_mask.view(b, 1, 1, s))
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        keep = ~masks[0]
        for m in masks[1:]:
            keep = keep & ~m
        return keep
    total = None
    for m in masks:
        add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        total = add if total is None else total + add
    return total


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention(batch_first=True)`` on opforge's linear
    and fused attention.

    Same parameters, initialisation and state_dict keys as torch's module
    (including separate q/k/v projections when kdim/vdim differ), so a
    checkpoint of one loads into the other. Self-attention (query is key is
    value) runs one fused QKV projection whose output is read by the
    attention kernel in place; the heads' output is a free view into the
    output projection.

    Differences: ``need_weights`` defaults to False and True is an error (the
    attention weights are never materialised), except in a module that
    :func:`opforge.patch` swapped in (``weights_on_torch``), which keeps
    torch's default (True) and answers it with torch's own attention, weights
    included: there ``need_weights=False`` runs the fused kernel; ``batch_first`` must be True;
    ``add_bias_kv``, ``add_zero_attn`` and dropout during training are not
    supported (clear errors). ``is_causal=True`` applies the causal mask
    itself (``attn_mask`` may be None; if given, it is taken to be that
    causal mask, as torch documents the hint).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=True, device=None, dtype=None):
        if not batch_first:
            raise _mha_error("argument 'batch_first' must be True (inputs are (B, N, E))")
        if add_bias_kv or add_zero_attn:
            raise _mha_error("'add_bias_kv' and 'add_zero_attn' are not supported")
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                         batch_first=True, device=device, dtype=dtype)
        self.weights_on_torch = False  # opforge.patch's modules: need_weights as torch's (default True, on torch's)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=None, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if need_weights is None:  # the module's default: False, or torch's True where patch() swapped it in
            need_weights = self.weights_on_torch
        if need_weights and self.weights_on_torch:
            return torch.nn.MultiheadAttention.forward(self, query, key, value, key_padding_mask, True, attn_mask,
                                                       average_attn_weights, is_causal)
        if need_weights:
            raise _mha_error("need_weights=True is not supported: the attention weights are never materialised")
        if self.training and self.dropout > 0.0:
            raise _mha_error(f"dropout ({self.dropout}) is not supported in training mode")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.dim() != 3:
            raise _mha_error(f"argument 'query' must be (B, N, E) or (N, E), got {query.dim()}-d")
        b, n, e = query.shape
        s, h = key.shape[1], self.num_heads
        hd = e // h
        bias = self.in_proj_bias
        bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
        if self._qkv_same_embed_dim and query is key and key is value:
            qkv = F.linear(query, self.in_proj_weight, bias).view(b, n, 3, h, hd)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # read in place
        else:
            if self._qkv_same_embed_dim:
                wq, wk, wv = self.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            q = F.linear(query, wq, bq).view(b, n, h, hd).transpose(1, 2)
            k = F.linear(key, wk, bk).view(b, s, h, hd).transpose(1, 2)
            v = F.linear(value, wv, bv).view(b, s, h, hd).transpose(1, 2)
        mask = _merge_masks(None if is_causal else attn_mask, key_padding_mask, b, h, n, s, q.dtype)
        out = _attention(q, k, v, mask, bool(is_causal), None)[0]
        out = F.linear(out.transpose(1, 2).reshape(b, n, e), self.out_proj.weight, self.out_proj.bias)
        return (out.squeeze(0) if unbatched else out), None


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with a weight of shape (hidden_size,).

    Loads the state_dict of ``torch.nn.RMSNorm`` and of Hugging Face's
    ``LlamaRMSNorm`` (both keep one key, ``weight``). ``eps`` (also readable
    and settable as ``variance_epsilon``, the Hugging Face name) defaults to
    1e-6, as LlamaRMSNorm's (``torch.nn.RMSNorm``'s default is None); None
    gives ``torch.finfo(x.dtype).eps``, as in torch's module. ``offset=True``
    scales by ``1 + weight`` (Gemma) and initialises the weight to zeros.
    ``hidden_size`` may be given as torch's ``normalized_shape`` (an int or a
    1-tuple).
    """

    def __init__(self, hidden_size, eps: float | None = 1e-6, elementwise_affine: bool = True, offset: bool = False,
                 device=None, dtype=None):
        super().__init__()
        shape = (hidden_size,) if isinstance(hidden_size, int) else tuple(hidden_size)
        if len(shape) != 1:
            raise RuntimeError(f"[opforge.nn.RMSNorm] argument 'hidden_size' must be an int or a 1-tuple (the last "
                               f"dim is normalised), got {hidden_size!r}")
        self.normalized_shape = shape
        self.eps = eps
        self.offset = offset
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = torch.nn.Parameter(init(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @property
    def variance_epsilon(self):
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value):
        self.eps = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return F.rms_norm(x, self.weight, eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}" + (
            ", offset=True" if self.offset else "")


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on opforge's kernel: same parameters,
    initialisation and state_dict keys. A normalized_shape of several dims is
    normalised as one flattened last dim (``x.flatten(-k)``, a view when those
    dims are contiguous, else a copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if k == 1:
            return F.layer_norm(x, self.weight, self.bias, self.eps)
        w = None if self.weight is None else self.weight.flatten()
        b = None if self.bias is None else self.bias.flatten()
        return F.layer_norm(x.flatten(-k), w, b, self.eps).view(x.shape)
class SwiGLU(torch.nn.Module):
    """Llama's MLP: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.

    The three projections are :class:`Linear` layers without bias named as in
    Hugging Face's ``LlamaMLP`` (``gate_proj``, ``up_proj``: hidden ->
    intermediate; ``down_proj``: intermediate -> hidden), so a ``LlamaMLP``
    state_dict loads as is.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class RotaryEmbedding(torch.nn.Module):
    """(cos, sin) of rotary position embedding as Hugging Face's
    ``LlamaRotaryEmbedding`` (default rope type) makes them.

    ``inv_freq = 1 / base ** (arange(0, dim, 2) / dim)`` is a non-persistent
    buffer (not in the state_dict, as in Hugging Face). ``forward(x,
    position_ids)`` returns cos and sin of shape (B, N, dim) in x's dtype,
    computed in float32 (``emb = cat(freqs, freqs)``, the half-split layout);
    :meth:`apply` rotates q and k with them (:func:`opforge.functional.rope`).
    """

    inv_freq: torch.Tensor

    def __init__(self, dim: int, max_position_embeddings: int = 2048, base: float = 10000.0, device=None):
        super().__init__()
        self.dim, self.max_position_embeddings, self.base = dim, max_position_embeddings, base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_out, k_out) for q (B, Hq, N, D), k (B, Hk, N, D) and this module's (cos, sin)."""
        return F.rope(q, k, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_position_embeddings={self.max_position_embeddings}, base={self.base}"


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's ``apply_rotary_pos_emb`` (Llama) on :func:`opforge.functional.rope`:
    q (B, Hq, N, D), k (B, Hk, N, D), cos / sin (B, N, R). ``position_ids`` is
    ignored, as in Hugging Face; ``unsqueeze_dim`` must be 1 (the head axis)."""
    if unsqueeze_dim != 1:
        raise RuntimeError(f"[opforge.nn.apply_rotary_pos_emb] argument 'unsqueeze_dim' must be 1 (q and k are "
                           f"(B, H, N, D)), got {unsqueeze_dim}")
    return F.rope(q, k, cos, sin)
class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` on opforge's fused cross-entropy
    (:func:`opforge.functional.cross_entropy`): the same constructor
    arguments (weight kept as the same buffer) plus ``softcap``.

    Class-index targets only. Inputs as torch's module takes them: (C,),
    (N, C), and (N, C, d1, ...) with the class dim at 1, read in place as
    the op's class-last (N, d1, ..., C) view (``movedim(1, -1)``: no copy).
    :func:`opforge.functional.cross_entropy` itself takes the class dim last.
    """

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0, softcap=None):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.softcap = softcap

    def forward(self, input, target):
        if isinstance(input, torch.Tensor) and input.dim() > 2:  # torch's (N, C, d1, ...): the op's class dim is last
            input = input.movedim(1, -1)
        return F.cross_entropy(input, target, self.weight, self.ignore_index, self.label_smoothing, self.reduction,
                               self.softcap)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of an LM head, ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)``, without
    the (tokens, vocab) logits (see :func:`opforge.functional.linear_cross_entropy`).

    It holds no parameter: the head's weight stays where the model keeps it (an ``nn.Linear``, or an
    embedding tied to it), and is passed in: ``loss_fn(hidden, lm_head.weight, target, lm_head.bias)``.
    A module that owned a copy would break weight tying and checkpoints.
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: float | None = None):
        super().__init__()
        if reduction not in F.REDUCTIONS:
            raise RuntimeError(f"[opforge.nn.LinearCrossEntropyLoss] argument 'reduction' must be one of "
                               f"{', '.join(map(repr, F.REDUCTIONS))}, got {reduction!r}")
        self.ignore_index, self.label_smoothing, self.reduction, self.softcap = (ignore_index, label_smoothing,
                                                                                  reduction, softcap)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.label_smoothing,
                                      self.reduction, self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r}, softcap={self.softcap}")
