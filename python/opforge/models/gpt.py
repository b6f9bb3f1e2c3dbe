"""A compact decoder-only Transformer, on plain PyTorch or on opforge's ops.

Llama-shaped: token embedding, rotary positions (half-split), pre-norm blocks
of grouped-query attention and a SwiGLU MLP, RMSNorm, a head tied to the
embedding, and the next-token loss. ``GPT(config, fused=False)`` runs torch's
own functions; ``fused=True`` (or :meth:`GPT.set_fused`) runs the same
parameters through opforge: ``linear`` for the projections (opforge's GEMM or
torch's, whichever is faster for the class of product on this machine),
``add_rms_norm`` for the residual stream, ``rope``, fused attention, ``swiglu`` and, when targets are given, ``linear_cross_entropy``
(the (tokens, vocab) logits are never built). The parameter names are the same
either way (and follow Hugging Face's Llama: ``layers.0.self_attn.q_proj`` ...),
so one state_dict loads into both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as TF

from .. import functional as OF


@dataclass
class GPTConfig:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    hidden_dim: int | None = None  # default: 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"GPTConfig: dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}) and n_heads "
                             f"a multiple of n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"GPTConfig: the head size dim / n_heads = {self.dim // self.n_heads} must be even (rotary)")
        if self.hidden_dim is None:
            self.hidden_dim = 64 * math.ceil(8 * self.dim / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Fusable(torch.nn.Module):
    fused = False

    def proj(self, m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection: ``opforge.linear`` fused (the faster GEMM per class of product, own or torch's;
        ``F.linear`` off the CPU), the module itself plain."""
        return OF.linear(x, m.weight, m.bias) if self.fused else m(x)


class RMSNorm(_Fusable):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return OF.rms_norm(x, self.weight, self.eps)
        return TF.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual stream."""
        if self.fused:
            return OF.add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return TF.rms_norm(s, (s.shape[-1],), self.weight, self.eps), s


class Attention(_Fusable):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = torch.nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.proj(self.q_proj, x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.proj(self.k_proj, x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.proj(self.v_proj, x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        if self.fused:
            q, k = OF.rope(q, k, cos, sin)
            out = OF.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            out = TF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(self.o_proj, out.transpose(1, 2).reshape(b, n, -1))


class MLP(_Fusable):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.gate_proj = torch.nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.up_proj = torch.nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.down_proj = torch.nn.Linear(c.hidden_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.proj(self.gate_proj, x), self.proj(self.up_proj, x)
        return self.proj(self.down_proj, OF.swiglu(gate, up) if self.fused else TF.silu(gate) * up)


class Block(torch.nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, residual: torch.Tensor | None):
        """(x, residual) -> (mlp output, its residual): the stream's add is done by the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin), residual)
        return self.mlp(h), residual


class GPT(torch.nn.Module):
    """``GPT(config, fused=False)``; ``forward(idx, targets=None) -> (logits, loss)``.

    idx and targets are (B, N) int64 token ids, N <= config.max_seq_len.
    Without targets: (logits (B, N, vocab), None). With targets: the mean
    next-token cross-entropy over all positions (targets of -100 ignored);
    the plain model returns the logits with it, the fused one returns None
    for them, because it never builds them (``linear_cross_entropy``).
    """

    def __init__(self, config: GPTConfig, fused: bool = False):
        super().__init__()
        self.config = c = config
        self.embed_tokens = torch.nn.Embedding(c.vocab_size, c.dim)
        self.layers = torch.nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self.apply(self._init)
        self.set_fused(fused)

    @staticmethod
    def _init(m: torch.nn.Module):
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)

    def set_fused(self, fused: bool = True) -> GPT:
        """Runs the same parameters on opforge's ops (True) or torch's (False)."""
        self.fused = bool(fused)
        for m in self.modules():
            if isinstance(m, _Fusable):
                m.fused = self.fused
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        n = idx.shape[1]
        if n > self.config.max_seq_len:
            raise ValueError(f"GPT: sequence length {n} exceeds config.max_seq_len ({self.config.max_seq_len})")
        cos, sin = self.rope_cos[:n], self.rope_sin[:n]
        x, residual = self.embed_tokens(idx), None
        for layer in self.layers:
            x, residual = layer(x, cos, sin, residual)
        h, _ = self.norm.add_forward(x, residual)
        head = self.embed_tokens.weight  # tied
        if targets is not None and self.fused:
            loss = OF.linear_cross_entropy(h.reshape(-1, h.shape[-1]), head, targets.reshape(-1))
            return None, loss
        logits = OF.linear(h, head) if self.fused else TF.linear(h, head)
        if targets is None:
            return logits, None
        return logits, TF.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
