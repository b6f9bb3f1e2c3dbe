"""Runs opforge's ops on another device from code written for the CPU: inside ``on_device("cuda")``, a call
of an op of opforge's namespace gets its tensor arguments copied to the device with the same sizes,
strides and storage offset (so a strided view stays the same strided view there), runs there (forward
and, through autograd, backward), and its outputs come back to the CPU. Gradients flow through the
copies, so a test that differentiates CPU inputs exercises the device's backward kernels too.

The fuzzer runs a case on the GPU this way (``fuzz.py --device cuda``): every op's own draw and check
functions, and its float64 references on the CPU, serve every device.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

import opforge
from opforge.testing import copy_with_layout


class _ToDevice(torch.autograd.Function):
    """t on `device` with t's sizes, strides and storage offset; its gradient comes back to t's device."""

    @staticmethod
    def forward(ctx, t, device):
        ctx.src = t.device
        return copy_with_layout(t, device)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.src), None


def to_device(t, device: str):
    if isinstance(t, torch.Tensor) and t.device.type != torch.device(device).type:
        return _ToDevice.apply(t, device)
    if isinstance(t, (list, tuple)):
        return type(t)(to_device(v, device) for v in t)
    return t


def _back(v):
    if isinstance(v, torch.Tensor):
        return v.to("cpu")
    if isinstance(v, (list, tuple)):
        return type(v)(_back(x) for x in v)
    return v


class _OnDevice(TorchFunctionMode):
    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and func.namespace == opforge.namespace:
            self.calls += 1
            return _back(func(*to_device(args, self.device), **{k: to_device(v, self.device)
                                                                  for k, v in kwargs.items()}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_device(device: str):
    """opforge's ops on `device` (see the module's text); yields the mode, whose ``calls`` counts the
    ops it sent there (a test that sent none tested nothing)."""
    if device == "cpu":
        yield None
        return
    with _OnDevice(device) as mode:
        yield mode
