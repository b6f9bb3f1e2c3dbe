"""The machinery of test_thread_sweep.py: a Case is one call of an op on empty or tiny shapes, and
sweep() runs it at every thread count on every ISA against its float64 reference. Each op's test
module gives its cases in its SWEEP table (tests/python/discover.py), built from the helpers here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import opforge
from opforge.testing import assert_close

THREADS = (1, 2, 3, 7, 16, 64)
ISAS = opforge.supported_isas()
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPES = (F32, BF16, F64)
# against float64 on the rounded inputs: float32 sums of a few products; 16-bit types round once
# in float32 compute (bfloat16 attention also rounds P and dS); gradients pass more roundings
TOL = {F64: 1e-10, F32: 2e-5, BF16: 2e-2}
GTOL = {F64: 1e-9, F32: 1e-4, BF16: 5e-2}


def grid(shape, seed):
    """Values k / 8 in [-1, 1]: exact in every dtype, so a short GEMM's sums are exact in float32 too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g, dtype=torch.int64).to(F64) / 8


def randn(shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass
class Case:
    """One call: make(dtype) gives the op's arguments; fn (opforge) and ref (PyTorch, float64)
    take them and return their outputs; grads: the arguments whose gradients are checked."""

    label: str
    make: Callable[[torch.dtype], tuple]
    fn: Callable[..., Sequence[torch.Tensor]]
    ref: Callable[..., Sequence[torch.Tensor]]
    grads: tuple[int, ...] = ()
    dtypes: tuple[torch.dtype, ...] = DTYPES
    retain_graph: bool = False  # the backward keeps the graph (linear: the saved pre-activation kept)
    # the outputs' dtype for the inputs' (default: the same; linear_cross_entropy: a float32 loss of 16-bit ones)
    out_dtype: Callable[[torch.dtype], torch.dtype] | None = None
    # ref is called with dtype= the inputs' dtype (linear_cross_entropy: bfloat16 operands' logits are bfloat16)
    ref_takes_dtype: bool = False


def _run(fn, args, grads, cots, retain_graph=False):
    """fn's outputs, then the gradients of sum(out * cot) for the arguments in grads (zeros where
    unused); cots: one cotangent per differentiable output, made here on the first call."""
    args = list(args)
    leaves = []
    for i in grads:
        args[i] = args[i].detach().requires_grad_()
        leaves.append(args[i])
    if not grads:
        with torch.no_grad():
            return [o for o in fn(*args)], cots
    outs = list(fn(*args))
    diff = [o for o in outs if o.requires_grad]
    if cots is None:
        cots = [grid(o.shape, 100 + i).to(o.dtype) for i, o in enumerate(diff)]
    got = [None] * len(leaves)
    if diff:
        got = torch.autograd.grad(diff, leaves, [c.to(o.dtype) for c, o in zip(cots, diff)], allow_unused=True,
                                  retain_graph=retain_graph)
    return [o.detach() for o in outs] + [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)], cots


def _to64(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _same_bits(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _check(got, want, dtype, nout, exact, what, out_dtype=None):
    assert len(got) == len(want), f"{what}: {len(got)} results, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        name = f"{what} result {i} ({'output' if i < nout else 'gradient'})"
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        dt = out_dtype(dtype) if out_dtype is not None and i < nout else dtype
        assert g.dtype == dt, f"{name}: dtype {g.dtype}, want {dt}"
        if w.numel() == 0:
            continue
        if exact and bool((w == 0).all()):  # nothing to sum (no key, K = 0, no row): exact zeros
            bad = g.double() != 0
            assert not bad.any(), (f"{name}: want exact zeros, got {int(bad.sum())} nonzero, first "
                                   f"{g.flatten()[bad.flatten().nonzero()[0]].item()!r}")
            continue
        tol = (TOL if i < nout else GTOL)[dt]
        assert_close(g, w, dt, name, atol=tol, rtol=tol)


def sweep(case: Case, dtype: torch.dtype):
    """The case on every ISA and thread count: against the reference, and bit for bit against the
    first thread count of its ISA."""
    args = case.make(dtype)
    exact = any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args)  # an empty operand: sums of nothing
    cots = want = None
    nout = None
    for isa in ISAS:
        opforge.set_isa(isa)
        first = None
        for t in THREADS:
            torch.set_num_threads(t)
            what = f"{case.label} {dtype} isa={isa} threads={t}"
            got, cots = _run(case.fn, args, case.grads, cots, case.retain_graph)
            if want is None:
                nout = len(got) - len(case.grads)
                ref = functools.partial(case.ref, dtype=dtype) if case.ref_takes_dtype else case.ref
                want, _ = _run(ref, [_to64(a) for a in args], case.grads, [c.double() for c in cots or []])
            _check(got, want, dtype, nout, exact, what, case.out_dtype)
            if first is None:
                first = (t, got)
                continue
            for i, (a, b) in enumerate(zip(got, first[1])):
                assert _same_bits(a, b), f"{what}: result {i} differs from threads={first[0]} bit for bit"




# ---- shapes and inputs the ops' cases share ----------------------------------------------------------

# elementwise and row ops; the last, wide, splits over threads (the elementwise grains are 16384 and 32768
# elements)
ELEMENTWISE = [(), (0,), (1,), (7,), (17,), (0, 5), (5, 0), (3, 0, 2), (2, 3, 5), (1, 1, 1), (129, 257)]


def targets(shape, classes, seed, ignored):
    """Class indices in [0, classes) (-100, ignored, where there is no class); some ignored if `ignored`."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, max(classes, 1), shape, generator=g) if classes else torch.full(shape, -100)
    if ignored and t.numel():
        t.view(-1)[:: max(2, t.numel() // 2)] = -100
    return t

