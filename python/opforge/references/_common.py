"""What the references of every op share: the Reference record, the inputs' value generators, and the
activations by the names the ops take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .._runtime import library


@dataclass(frozen=True)
class Reference:
    """A reference callable as the op is, with what checking it needs.

    inputs: dtype -> argument tuples for the op, for ops whose tensors must
    fit each other (matrix shapes); None: generated from the schema (any
    shape will do, as for an elementwise op).
    grad: whether the op has a derivative to compare (backward ops have none).
    """

    fn: Callable
    inputs: Callable[[torch.dtype], Sequence[tuple]] | None = None
    grad: bool = True

    def __call__(self, *args):
        return self.fn(*args)


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def grid(*shape, seed: int) -> torch.Tensor:
    """Values in [-1, 1] on a grid of 1/8, exact in every dtype: the products and
    sums of a short GEMM are then exact in float32 too, so a check compares the
    op's indexing and its one rounding, not the order of a sum that the
    per-dtype tolerances (made for elementwise ops) leave no room for."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g, dtype=torch.int64).to(torch.float64) / 8


_ACTIVATION_FNS = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu,
                   "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def activations(op: str, arg: str) -> dict[str, Callable]:
    """name -> torch function of each activation the op's str argument takes, in the library's order: an
    activation the library adds fails here until it has a torch function."""
    return {name: _ACTIVATION_FNS[name] for name in library.descriptor(op).enum_values(arg)}
