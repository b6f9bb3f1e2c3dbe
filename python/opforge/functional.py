"""opforge's ops, called like ``torch.nn.functional``.

Each function is the registered ``torch.ops.opforge.<op>`` (``opforge.ops``,
the namespace being a build parameter): autograd,
``torch.compile(fullgraph=True)``, autocast and the profiler work on it.

Autocast: each op's policy is its descriptor's ``.autocast`` (registered for
AutocastCPU and AutocastCUDA alike), and under ``torch.autocast("cpu",
dtype=torch.bfloat16 / torch.float16)`` each returns the dtype its torch twin
returns (tests/python/test_training.py checks every op):

=============================  ========  ==================================================
op                             policy    returns the dtype of
=============================  ========  ==================================================
linear, matmul,                lower     F.linear, torch.matmul,
scaled_dot_product_attention             F.scaled_dot_product_attention (autocast dtype)
cross_entropy,                 fp32      F.cross_entropy (float32; linear_cross_entropy:
linear_cross_entropy                     F.cross_entropy(F.linear(...)), float32)
dispersion_correction,         promote   eager elementwise ops: the widest floating input
swiglu, geglu, rope                      (16-bit stays 16-bit, with a float32 one: float32)
softmax, log_softmax,          none      F.softmax, F.log_softmax, F.rms_norm, F.layer_norm:
rms_norm, add_rms_norm,                  x's dtype (the norms cast float32 parameters to a
layer_norm                               16-bit x's dtype; add_rms_norm promotes x, residual)
=============================  ========  ==================================================

float64 tensors are never cast, as torch's autocast leaves them. Gradients
come back in each input's own dtype (the casts are in the graph). The table is
torch's CPU autocast; its CUDA autocast runs softmax, log_softmax and
layer_norm in float32, which opforge's one policy per op does not (no op has a
CUDA kernel yet).
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
    the reference (so x = 0 gives inf). Under ``torch.autocast`` the op follows
    its input (policy promote), as eager ``x * alpha + torch.sqrt(x)`` does: a
    float32 x gives float32, a 16-bit x its own dtype.
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
    dtype (policy lower), as F.linear does.
    """
    code = _activation_code(activation)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return _linear(x, weight, bias, code, needs_grad and not recompute)[0]


@op_function(ops.matmul.default)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop. Under autocast
    it runs in the autocast dtype (policy lower), as torch.matmul does."""


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


# ---- normalisation -------------------------------------------------------------------------------


def _autocast_params(x: torch.Tensor, *params):
    """Under CPU autocast torch runs F.rms_norm / F.layer_norm in the dtype of their input (they are on
    none of its autocast lists) and accepts float32 parameters beside 16-bit activations; the C ops take
    one dtype, so there the parameters are cast to x's dtype (a cast in the graph: their gradients come
    back in float32)."""
    if x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
        return tuple(p.to(x.dtype) if p is not None and p.dtype == torch.float32 else p for p in params)
    return params


@op_function(ops.rms_norm.default)
def _rms_norm(x, weight, eps, offset):
    """(y, rstd): see rms_norm."""


@op_function(ops.add_rms_norm.default)
def _add_rms_norm(x, residual, weight, eps, offset):
    """(y, sum, rstd): see add_rms_norm."""


@op_function(ops.layer_norm.default)
def _layer_norm(x, weight, bias, eps):
    """(y, mean, rstd): see layer_norm."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)`` without
    the normalized_shape argument (the last dimension is normalised).

    Args:
        x: (..., H): float32, float64, bfloat16 or float16, any leading dims and
            any strides: read in place, never copied (a row whose last dim is
            not contiguous runs the scalar loop).
        weight: (H,) of x's dtype, or None (no scaling).
        eps: > 0, added to the mean of squares (rounded to float32 except for
            float64).
        offset: scale by ``1 + weight`` (Gemma) instead of ``weight``.

    Numerics: float32 and the 16-bit types compute in float32 (16-bit values
    converted on load): per row, ``rstd = 1 / sqrt(sum(x*x) / H + eps)``, then
    ``y = (x * rstd) * w`` (``w = 1 + weight`` with offset), rounded once to x's
    dtype -- what torch's F.rms_norm computes for these dtypes. float64
    computes in double. The output is contiguous. The backward saves the
    per-row rstd (float32, R floats) and x, never x-hat; the weight gradient is
    summed over fixed blocks of rows in a fixed order, so it has the same bits
    on any thread count. Under autocast the op runs in x's dtype (policy
    none), as torch's does (float32 parameters are cast to a 16-bit x's dtype,
    their gradients come back in float32).
    """
    (weight,) = _autocast_params(x, weight)
    return _rms_norm(x, weight, eps, offset)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual; (rms_norm(s, weight, eps, offset), s)`` in one pass:
    the pre-norm residual stream of Llama-style blocks.

    Args:
        x, residual: (..., H) of one shape and dtype, any strides (read in place).
        weight, eps, offset: as in :func:`rms_norm`.

    Returns:
        ``(y, s)``, both contiguous, of x's dtype. ``s`` is ``x + residual``
        computed in float32 (double for float64) and rounded once to x's dtype,
        exactly torch's ``x + residual``; ``y`` is normalised from that rounded
        ``s`` with float32 accumulation and rounded once, exactly as
        :func:`rms_norm` of the eager ``x + residual`` would be. Gradients flow
        from both outputs: ``dx = dresidual = d rms_norm(s) + grad_s``, computed
        in float32 and rounded once.

    Under autocast, where a 16-bit branch output meets a float32 residual
    stream, x and residual of different dtypes are both cast to the wider one
    (a copy of the narrower), as eager ``x + residual`` promotes; outside
    autocast they must have one dtype.
    """
    if x.dtype != residual.dtype and torch.is_autocast_enabled(x.device.type):
        # autocast adds a 16-bit branch output to a float32 stream: x + residual is then float32, as in eager
        wide = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(wide), residual.to(wide)
    (weight,) = _autocast_params(x, weight)
    y, s, _ = _add_rms_norm(x, residual, weight, eps, offset)
    return y, s


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) * rsqrt(var + eps) * weight + bias``
    (biased variance), ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)``.

    Args:
        x: (..., H), float32, float64, bfloat16 or float16, any strides (read in place).
        weight, bias: (H,) of x's dtype, or None.
        eps: > 0.

    float32 and the 16-bit types compute in float32: per row the mean, then
    the variance of ``x - mean`` (two passes over the row while it is in
    cache), ``y = ((x - mean) * rstd) * weight + bias`` rounded once. float64
    computes in double. The backward saves mean and rstd per row (float32),
    never x-hat; weight and bias gradients are deterministic across thread
    counts. Under autocast the op runs in x's dtype (policy none), as torch's
    does (float32 parameters cast as :func:`rms_norm` casts them).
    """
    weight, bias = _autocast_params(x, weight, bias)
    return _layer_norm(x, weight, bias, eps)[0]
# ---- gated linear units -----------------------------------------------------------------

GLU_ACTIVATIONS = {"silu": 4, "gelu": 2, "gelu_tanh": 3}  # act_kind codes of csrc/kernels/act.h
GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}


@op_function(ops.glu.default)
def _glu(gate, up, act):
    """act(gate) * up, act an int code of GLU_ACTIVATIONS: see swiglu and geglu."""


def _glu_halves(name: str, gate: torch.Tensor, up: torch.Tensor | None):
    """(gate, up), splitting a packed (..., 2F) gate as x.chunk(2, -1) does: two views, no copy."""
    if up is not None:
        return gate, up
    if gate.dim() == 0 or gate.shape[-1] % 2 != 0:
        got = "a 0-d tensor" if gate.dim() == 0 else f"last size {gate.shape[-1]}"
        raise RuntimeError(f"[opforge.{name}] argument 'gate' given alone must be packed (..., 2F) (gate then up), "
                           f"with an even last size, got {got}")
    return gate.chunk(2, -1)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP activation) in one pass.

    Args:
        gate, up: (..., F) tensors of one shape, dtype (float32, float64,
            bfloat16, float16) and device; any strides, read in place.
            ``up=None``: ``gate`` is the packed (..., 2F) tensor of a fused
            gate-up projection, split as ``gate.chunk(2, -1)`` (gate first)
            into two views, read in place.

    Returns a new (..., F) tensor, with gate's strides when gate is dense
    (contiguous otherwise). bfloat16 / float16 compute in float32 and round
    once. The backward recomputes silu from gate (nothing else is saved) and
    gives gradients of gate and up (of the packed tensor through autograd's
    chunk, which assembles the two halves in one copy). Under autocast the op
    follows the widest of gate and up (policy promote), as eager
    ``silu(gate) * up`` does: 16-bit with 16-bit stays 16-bit, a float32 one
    makes it float32.
    """
    gate, up = _glu_halves("swiglu", gate, up)
    return _glu(gate, up, GLU_ACTIVATIONS["silu"])


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` (GeGLU) in one pass; ``approximate`` is
    "none" (exact, erf) or "tanh", as ``torch.nn.functional.gelu`` takes it.
    Everything else as :func:`swiglu` (packed form with ``up=None``)."""
    act = GELU_APPROXIMATE.get(approximate)
    if act is None:
        raise RuntimeError(f"[opforge.geglu] argument 'approximate' must be 'none' or 'tanh', got {approximate!r}")
    gate, up = _glu_halves("geglu", gate, up)
    return _glu(gate, up, GLU_ACTIVATIONS[act])


# ---- rotary position embedding ---------------------------------------------------------------


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
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise RuntimeError("[opforge.rope] arguments 'cos' and 'sin' must not require grad: opforge computes no "
                           "gradient for them (pass cos.detach() and sin.detach())")
    return _rope(q, k, cos, sin, position_ids, bool(interleaved))
@op_function(ops.softmax.default)
def _softmax(x, dim):
    """See softmax."""


@op_function(ops.log_softmax.default)
def _log_softmax(x, dim):
    """See log_softmax."""


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.nn.functional.softmax(x, dim)``: ``exp(x - max) / sum(exp(x - max))`` along ``dim``.

    Any dim and any strides, read in place (never copied): when ``dim`` has
    stride 1 the rows run vectorised along it; otherwise, when another dim has
    stride 1, the reduction walks down the strided ``dim`` with that dim's
    lines vectorised; otherwise each line is a strided scalar loop. The output
    takes x's strides when x is dense, else it is contiguous. float32,
    bfloat16 and float16 compute in float32 (halves round once), float64 in
    double. Entries of -inf give exactly 0 (and a finite gradient); a row of
    -inf only, or one holding +inf or NaN, is NaN, as torch's. The backward
    uses the saved output alone: ``dx = y * (dy - sum(dy * y))``. Under
    ``torch.autocast`` the op runs in the dtype it is given (policy none), as
    F.softmax does on the CPU (torch's CPU autocast lists neither softmax nor
    log_softmax; its CUDA autocast runs them in float32, opforge's does not).
    """
    return _softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.nn.functional.log_softmax(x, dim)``: ``x - max - log(sum(exp(x - max)))`` along ``dim``.

    Layouts, dtypes and autocast as :func:`softmax`. Entries of -inf give
    exactly -inf (and a finite gradient); a row of -inf only, or one holding
    +inf or NaN, is NaN, as torch's. The backward uses the saved output alone:
    ``dx = dy - exp(y) * sum(dy)``.
    """
    return _log_softmax(x, dim)


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@op_function(ops.cross_entropy.default)
def _cross_entropy(logits, target, weight, ignore_index, label_smoothing, reduction, softcap):
    """(losses, loss, lse): see cross_entropy."""


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                  softcap: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` with class-index targets, fused
    with its backward: no (rows, C) tensor is kept between forward and
    backward, only a float64 logsumexp per row; the backward recomputes the
    softmax from the logits.

    Args:
        logits: (N, C) as F.cross_entropy takes it, (C,) for one sample, or
            (..., C) with the class dim LAST (F.cross_entropy puts the class
            dim at 1 for inputs of more than 2 dims: pass
            ``logits.movedim(1, -1)``, read in place). Any strides.
        target: int64 class indices of logits' shape without its last dim;
            each in [0, C) or ``ignore_index`` (checked before computing).
            Class probabilities are not supported.
        weight: (C,) class weights of logits' dtype, or None. No gradient
            flows to it.
        ignore_index: rows with this target get loss 0 and gradient 0 and do
            not count in the mean.
        label_smoothing: in [0, 1], as torch defines it (also with weight).
        reduction: "mean" (over the summed target weights, as torch: NaN
            when every row is ignored), "sum" or "none" (per row).
        softcap: None, or c > 0: logits become ``c * tanh(logits / c)``
            before the softmax (Gemma-2 soft-capping), with its derivative in
            the backward.

    float32, bfloat16, float16 (computed in float32) and float64 (double).
    The mean and the sum add fixed blocks of rows in a fixed order: the same
    bits on any thread count. Under ``torch.autocast`` the op runs in float32
    (policy fp32), as torch's autocast runs F.cross_entropy.
    """
    code = REDUCTIONS.get(reduction)
    if code is None:
        raise RuntimeError(
            f"[opforge.cross_entropy] argument 'reduction' must be one of {', '.join(map(repr, REDUCTIONS))}, "
            f"got {reduction!r}"
        )
    losses, loss, _ = _cross_entropy(logits, target, weight, int(ignore_index), float(label_smoothing), code,
                                     None if softcap is None else float(softcap))
    return losses if code == 0 else loss


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
    count. Under ``torch.autocast`` the op runs in float32 (policy fp32) and returns a float32 loss, the
    dtype of torch's ``F.cross_entropy(F.linear(...))`` under autocast (torch rounds its logits to the
    autocast dtype, opforge keeps them float32). A 16-bit loss would overflow GradScaler's scaled float16
    gradient (65536 is past float16's range) and skip the step.
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
