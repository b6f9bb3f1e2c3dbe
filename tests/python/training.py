"""What test_training.py runs of each op: the Case each op's test module gives in its TRAINING table
(tests/python/discover.py), and the inputs those cases are made of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Case:
    """One op as a user calls it, and the torch function it stands for."""

    ops: tuple[str, ...]  # the registered forward ops the call runs
    make: Callable  # (dtype, big) -> argument list; big: sizes that span several row blocks and threads
    grads: tuple[int, ...]  # the arguments that get gradients
    opforge: Callable
    torch: Callable
    # the autocast policy of its ops (their descriptors' .autocast), by its name in opforge._lib (AUTOCAST_<NAME>,
    # lower case): "lower", "fp32", "promote", "none", "follow"
    autocast: str


def randn(*shape, dtype, lo=None):
    """Normal values (|x| + lo with lo) from torch's global generator (seeded per test), in dtype."""
    t = torch.randn(shape, dtype=torch.float32)
    if lo is not None:
        t = t.abs() + lo
    return t.to(dtype)


def target(n, classes, ignored=3):
    """n class indices in [0, classes), the first `ignored` of them -100 (ignored)."""
    t = torch.randint(0, classes, (n,))
    t[:ignored] = -100
    return t
