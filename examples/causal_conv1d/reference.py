"""The PyTorch reference of causal_conv1d: what the C kernels must compute."""

import torch.nn.functional as F


def causal_conv1d(x, weight, bias=None, activation="none"):
    """y[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - W + 1 + k]), x zero before t = 0."""
    y = F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[1])
    return F.silu(y) if activation == "silu" else y
