"""Swapping opforge's fused modules into a plain PyTorch model, in place.

``report = opforge.patch(model)`` replaces, in the one model it is given:

- ``nn.Linear`` directly followed, inside an ``nn.Sequential``, by ``nn.ReLU``,
  ``nn.GELU`` (exact or tanh) or ``nn.SiLU``: one :class:`opforge.nn.Linear`
  with that activation fused, the activation module replaced by
  ``nn.Identity``; any other ``nn.Linear``: ``opforge.nn.Linear`` without
  activation (what follows it is code, which patching cannot see), whose GEMM
  is opforge's or torch's, whichever is faster for the class of product on
  this machine (on CPUs without native bfloat16, torch's bfloat16 GEMM is
  20-30 times slower than opforge's);
- ``nn.LayerNorm`` over one dimension: :class:`opforge.nn.LayerNorm`;
- ``nn.RMSNorm`` over one dimension: :class:`opforge.nn.RMSNorm`;
- ``nn.MultiheadAttention(batch_first=True)`` without ``add_bias_kv`` /
  ``add_zero_attn`` / dropout: :class:`opforge.nn.MultiheadAttention`, fused
  for calls with ``need_weights=False`` (as torch's own fast path); torch's
  default ``need_weights=True`` still returns the weights, from torch's
  attention.

The new modules hold the very ``Parameter`` objects of the old ones (an
optimizer built before patching keeps working) and compute the same function.
Everything else, any of the above with a configuration opforge cannot
honour, and a module with forward hooks (which the new module would not run),
is left as it is and listed in the report with the reason: nothing is
patched silently wrong. Classes are never patched globally.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import nn as onn

_ACTIVATIONS = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}


@dataclass
class PatchReport:
    """What :func:`patch` did: (module name, old type, new type) per swap,
    (module name, type, reason) per module it left, and (module name, what)
    where a replaced module serves some calls on torch's kernels."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (module name, how a replaced one behaves)

    def __str__(self) -> str:
        lines = [f"opforge.patch: {len(self.replaced)} module(s) replaced, {len(self.left)} left"]
        lines += [f"  replaced {name or '<root>'}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  left     {name or '<root>'} ({kind}): {why}" for name, kind, why in self.left]
        lines += [f"  note     {name or '<root>'}: {what}" for name, what in self.notes]
        return "\n".join(lines)


def _activation_name(m: torch.nn.Module) -> str | None:
    if isinstance(m, torch.nn.GELU):
        return "gelu" if m.approximate == "none" else "gelu_tanh"
    for cls, name in _ACTIVATIONS.items():
        if type(m) is cls:
            return name
    return None


def _linear(old: torch.nn.Linear, activation: str) -> onn.Linear:
    new = onn.Linear(old.in_features, old.out_features, bias=old.bias is not None, activation=activation,
                     device="meta")
    new.weight, new.bias = old.weight, old.bias
    new.train(old.training)
    return new


def _layer_norm(old: torch.nn.LayerNorm) -> onn.LayerNorm | str:
    if len(old.normalized_shape) != 1:
        return f"normalized_shape {tuple(old.normalized_shape)} spans more than the last dimension"
    new = onn.LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                        bias=old.bias is not None, device="meta")
    new.weight, new.bias = old.weight, old.bias
    return new


def _rms_norm(old: torch.nn.RMSNorm) -> onn.RMSNorm | str:
    if len(old.normalized_shape) != 1:
        return f"normalized_shape {tuple(old.normalized_shape)} spans more than the last dimension"
    if old.weight is None:
        return "elementwise_affine=False"
    eps = old.eps if old.eps is not None else torch.finfo(old.weight.dtype).eps
    new = onn.RMSNorm(old.normalized_shape[0], eps=eps, device="meta")
    new.weight = old.weight
    return new


def _mha(old: torch.nn.MultiheadAttention) -> onn.MultiheadAttention | str:
    if not old.batch_first:
        return "batch_first=False"
    if old.bias_k is not None or old.add_zero_attn:
        return "add_bias_kv / add_zero_attn"
    if old.dropout > 0.0:
        return f"attention dropout {old.dropout}"
    new = onn.MultiheadAttention(old.embed_dim, old.num_heads, 0.0, bias=old.in_proj_bias is not None,
                                 kdim=old.kdim, vdim=old.vdim, batch_first=True, device="meta")
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    new.out_proj.weight, new.out_proj.bias = old.out_proj.weight, old.out_proj.bias
    new.weights_on_torch = True  # torch's need_weights=True default, and its weights, kept
    new.train(old.training)
    return new


_SWAPS = {torch.nn.LayerNorm: _layer_norm, torch.nn.RMSNorm: _rms_norm, torch.nn.MultiheadAttention: _mha}


def patch(model: torch.nn.Module) -> PatchReport:
    """Swaps opforge's fused modules into ``model`` in place (see the module's
    docstring for what is swapped) and returns a :class:`PatchReport`."""
    report = PatchReport()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch: expected a torch.nn.Module, got {type(model).__name__}")
    if type(model) in _SWAPS:
        raise TypeError(f"opforge.patch: the model itself is a {type(model).__name__}; patch the module that holds it")

    def visit(parent: torch.nn.Module, prefix: str):
        children = list(parent.named_children())
        for i, (name, child) in enumerate(children):
            if child is None:
                continue  # an activation fused into the Linear before it
            full = f"{prefix}{name}"
            if isinstance(child, onn.Linear | onn.LayerNorm | onn.RMSNorm | onn.MultiheadAttention):
                continue  # already opforge's
            if (type(child) in _SWAPS or type(child) is torch.nn.Linear) and (child._forward_hooks or
                                                                               child._forward_pre_hooks):
                report.left.append((full, type(child).__name__, "has forward hooks, which a swapped module would "
                                    "not run"))
                continue
            swap = _SWAPS.get(type(child))
            if swap is not None:
                new = swap(child)
                if isinstance(new, str):
                    report.left.append((full, type(child).__name__, new))
                else:
                    setattr(parent, name, new)
                    report.replaced.append((full, type(child).__name__, f"opforge.nn.{type(new).__name__}"))
                    if getattr(new, "weights_on_torch", False):
                        report.notes.append((full, "fused where called with need_weights=False; torch's default, "
                                             "need_weights=True, runs torch's attention, which returns the weights"))
                continue
            if type(child) is torch.nn.Linear:
                nxt = children[i + 1][1] if i + 1 < len(children) else None
                act = _activation_name(nxt) if isinstance(parent, torch.nn.Sequential) and nxt is not None else None
                if act is None:  # nothing to fuse: the faster GEMM of the class
                    setattr(parent, name, _linear(child, "none"))
                    report.replaced.append((full, "Linear", "opforge.nn.Linear('none')"))
                    continue
                setattr(parent, name, _linear(child, act))
                setattr(parent, children[i + 1][0], torch.nn.Identity())
                children[i + 1] = (children[i + 1][0], None)  # consumed
                report.replaced.append((full, f"Linear + {type(nxt).__name__}", f"opforge.nn.Linear({act!r})"))
                continue
            visit(child, full + ".")

    visit(model, "")
    return report
