"""Modules holding parameters; the work is in opforge.functional."""

from __future__ import annotations

import torch

from . import functional as F


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with a fused activation: ``act(x W^T + b)``.

    Same parameters, initialisation and state_dict keys as ``torch.nn.Linear``
    (a checkpoint of one loads into the other); ``activation`` is "none",
    "relu", "gelu", "gelu_tanh" or "silu".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "none",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        F._activation_code(activation)  # fail early on an unknown name
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"
