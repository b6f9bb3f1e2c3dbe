"""Patching Hugging Face ``transformers`` models onto opforge's ops, one model
instance at a time.

``report = opforge.patch_hf(model)`` works on Llama, Qwen2, Qwen3, Mistral and
GPT-2 (``*ForCausalLM``, ``*Model``) built by ``transformers``:

- RMSNorm modules -> :class:`opforge.nn.RMSNorm` (same weight), ``nn.LayerNorm``
  -> :class:`opforge.nn.LayerNorm`;
- the gated MLP (``gate_proj``/``up_proj``/``down_proj`` with silu or gelu)
  -> the same projections around ``swiglu`` / ``geglu``; GPT-2's MLP -> one
  fused linear + gelu_tanh;
- the projections of those MLPs and attentions (plain ``nn.Linear`` modules
  without hooks; adapters and quantized layers run as they are) ->
  ``opforge.linear``: opforge's GEMM or torch's, whichever is faster for the
  class of product on this machine (on CPUs without native bfloat16, torch's
  bfloat16 GEMM is 20-30 times slower than opforge's);
- attention -> the rotary embedding through ``rope`` and the attention itself
  through opforge's fused kernel, registered in transformers' own
  ``AttentionInterface`` under the name "opforge" and selected for this model's
  config only (``model.config._attn_implementation``);
- the causal-LM loss -> ``linear_cross_entropy``: when ``labels`` are given,
  the (tokens, vocab) logits are never built and ``logits`` is None in the
  output. Without labels (inference, ``generate``) logits are computed as
  before.

Only the given instance changes: each patched module gets a class of its own
(a subclass of its original class with opforge's ``forward``), and its
parameters and state_dict keys stay as they are. What cannot be honoured
(attention dropout in training, sliding-window attention, an architecture
not listed) is left as it is and reported, never run wrong.
"""

from __future__ import annotations

import torch

from . import functional as OF
from . import nn as onn
from .patch import PatchReport, _layer_norm

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
_GLU = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu:none", "gelu_pytorch_tanh": "geglu:tanh",
        "gelu_new": "geglu:tanh"}


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("opforge.patch_hf needs Hugging Face transformers: pip install transformers "
                          "(the version opforge is tested with is pinned in requirements-dev.txt)") from e


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
               sliding_window=None, **kwargs):
    """transformers' attention-function signature over opforge's kernel: (B, N, H, D) out, no weights."""
    if dropout:
        raise RuntimeError(f"[opforge.patch_hf] attention dropout {dropout} is not supported: "
                           "put the model in eval mode or set attention_dropout=0")
    if sliding_window is not None:
        raise RuntimeError(f"[opforge.patch_hf] sliding-window attention ({sliding_window}) is not supported")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    elif (attention_mask is not None and attention_mask.shape[-1] == key.shape[2] > query.shape[2]
          and not torch.compiler.is_compiling()):
        key, value, attention_mask = _attended_keys(key, value, attention_mask)
    if kwargs.get("output_attentions"):  # asked per call: the weights, as eager attention makes them
        return _attention_with_weights(query, key, value, attention_mask, causal, scaling)
    out = OF.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                          scale=scaling)
    return out.transpose(1, 2), None


def _attention_with_weights(query, key, value, mask, causal: bool, scaling):
    """(out (B, N, H, D), weights (B, H, N, S)) in eager ops, as transformers' eager attention computes them
    (masked scores at the dtype's lowest value, softmax in float32, rounded to the query's dtype): a call
    that asks for output_attentions gets them, which the fused kernel never builds."""
    h, hkv = query.shape[1], key.shape[1]
    if h != hkv:
        key, value = key.repeat_interleave(h // hkv, 1), value.repeat_interleave(h // hkv, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    low = torch.finfo(scores.dtype).min  # eager's fill: a row with no key left averages, as eager's does
    if mask is not None:
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
    if causal:
        n, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool, device=scores.device).triu(1), low)
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2), weights


def _attended_keys(key, value, mask):
    """K, V and a bool mask cut to the keys up to the last one any query attends to (views): a static
    cache hands over its whole preallocated length, masked past the tokens so far, and reading it all
    would cost each decoding step the cache's full size. The keys cut off have zero weight (and zero
    gradient) either way."""
    seen = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
    end = int(seen[-1]) + 1 if seen.numel() else mask.shape[-1]
    if end == key.shape[2]:
        return key, value, mask
    return key[:, :, :end], value[:, :, :end], mask[..., :end]


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("opforge", _attention)
    AttentionMaskInterface.register("opforge", sdpa_mask)  # bool masks (True = attend), or None when causal


def _subclass(module: torch.nn.Module, forward) -> None:
    """Gives this one instance a class of its own whose forward is opforge's."""
    cls = type(module)  # same name, so that save_pretrained records the original architecture
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "_opforge_original": cls,
                                                    "__qualname__": cls.__qualname__, "__module__": cls.__module__})


def _proj(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection on ``opforge.linear`` (opforge's GEMM or torch's, whichever is faster for the class of
    product here; ``F.linear`` off the CPU); a module that is not a plain ``nn.Linear`` (an adapter, a
    quantized layer) or has hooks runs as it is."""
    if type(m) is torch.nn.Linear and not (m._forward_hooks or m._forward_pre_hooks):
        return OF.linear(x, m.weight, m.bias)
    return m(x)


def _rope_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                            past_key_values=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = _proj(self.q_proj, hidden_states).view(hidden_shape)
    k = _proj(self.k_proj, hidden_states).view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = _proj(self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = OF.rope(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _attention)
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling,
                             sliding_window=getattr(self, "sliding_window", None), **kwargs)
    return _proj(self.o_proj, out.reshape(*input_shape, -1).contiguous()), weights


def _glu_forward(kind):
    def forward(self, x):
        gate, up = _proj(self.gate_proj, x), _proj(self.up_proj, x)
        if kind == "swiglu":
            h = OF.swiglu(gate, up)
        else:
            h = OF.geglu(gate, up, approximate=kind.split(":")[1])
        return _proj(self.down_proj, h)

    return forward


def _gpt2_mlp_forward(self, hidden_states):
    # Conv1D stores (in, out): its transpose is read in place by the fused linear
    h = OF.linear(hidden_states, self.c_fc.weight.t(), self.c_fc.bias, "gelu_tanh")
    return self.dropout(self.c_proj(h))


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    original = type(self)._opforge_original
    if labels is None:
        return original.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    kwargs.pop("shift_labels", None)
    body = getattr(self, self.base_model_prefix)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.lm_head
    loss = OF.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted.reshape(-1),
                                   head.bias, ignore_index=ignore_index,
                                   reduction="sum" if num_items is not None else "mean")
    if num_items is not None:
        loss = loss / num_items
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _replace(parent, name, new, report, full, old):
    setattr(parent, name, new)
    report.replaced.append((full, type(old).__name__, f"opforge.nn.{type(new).__name__}"))


def patch_hf(model: torch.nn.Module) -> PatchReport:
    """Patches one transformers model in place (see the module docstring);
    returns a :class:`opforge.PatchReport` of what was replaced and what was
    left, with why."""
    _require_transformers()
    report = PatchReport()
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        report.left.append(("", type(model).__name__, f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"))
        return report
    if getattr(config, "output_attentions", False):
        report.left.append(("", type(model).__name__, "output_attentions=True: the attention weights are never built"))
        return report

    attn_ok, why = True, ""
    dropout = getattr(config, "attention_dropout", getattr(config, "attn_pdrop", 0.0)) or 0.0
    if dropout > 0.0:
        attn_ok, why = False, f"attention dropout {dropout}"
    window = getattr(config, "sliding_window", None)
    if window is not None and (kind == "mistral" or getattr(config, "use_sliding_window", False)):
        attn_ok, why = False, f"sliding-window attention ({window})"
    if kind == "gpt2" and (getattr(config, "reorder_and_upcast_attn", False) or getattr(config, "add_cross_attention",
                                                                                        False)):
        attn_ok, why = False, "reorder_and_upcast_attn / cross-attention"
    if attn_ok:
        _register_attention()
        model.config._attn_implementation = "opforge"

    for full, module in list(model.named_modules()):
        if hasattr(type(module), "_opforge_original") or isinstance(module, onn.RMSNorm | onn.LayerNorm):
            continue  # patched before
        parent, _, name = full.rpartition(".")
        parent = model.get_submodule(parent) if full else None
        cname = type(module).__name__
        if cname.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            new = onn.RMSNorm(module.weight.shape[0], eps=module.variance_epsilon, device="meta")
            new.weight = module.weight
            _replace(parent, name, new, report, full, module)
        elif type(module) is torch.nn.LayerNorm:
            new = _layer_norm(module)  # the swap opforge.patch makes, with its refusal of multi-dim norms
            if isinstance(new, str):
                report.left.append((full, cname, new))
                continue
            _replace(parent, name, new, report, full, module)
        elif cname.endswith("MLP") and hasattr(module, "gate_proj"):
            act = getattr(getattr(module, "config", config), "hidden_act", None)
            if act not in _GLU:
                report.left.append((full, cname, f"activation {act!r} has no fused gated form"))
                continue
            _subclass(module, _glu_forward(_GLU[act]))
            report.replaced.append((full, cname, f"gate/up projections + opforge {_GLU[act].split(':')[0]}"))
        elif cname == "GPT2MLP":
            if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
                report.left.append((full, cname, f"activation {config.activation_function!r}"))
                continue
            _subclass(module, _gpt2_mlp_forward)
            report.replaced.append((full, cname, "opforge linear + gelu_tanh, then c_proj"))
        elif cname.endswith("Attention") and hasattr(module, "q_proj"):
            if not attn_ok:
                report.left.append((full, cname, why))
                continue
            _subclass(module, _rope_attention_forward)
            report.replaced.append((full, cname, "opforge rope + fused attention"))
        elif cname == "GPT2Attention":
            if not attn_ok:
                report.left.append((full, cname, why))
                continue
            report.replaced.append((full, cname, "fused attention (attn_implementation 'opforge')"))
    if hasattr(model, "lm_head") and hasattr(model, "base_model_prefix") and not hasattr(type(model),
                                                                                          "_opforge_original"):
        _subclass(model, _causal_lm_forward)
        report.replaced.append(("lm_head", "lm_head + loss", "opforge linear_cross_entropy when labels are given"))
    return report
