"""The PyTorch reference of squared_relu: what the C kernels must compute."""

import torch


def squared_relu(x):
    return torch.relu(x) ** 2
