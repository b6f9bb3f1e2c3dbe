"""Checking an op against a PyTorch reference (the msProbe-style figures).

    import opforge.testing as ot
    report = ot.check(torch.ops.opforge.dispersion_correction, ot.REFERENCES["dispersion_correction"])
    print(report)            # per dtype: max abs/rel error, ULPs, cosine, shares beyond 1e-3 / 5e-3, grads
    assert report.passed

The PyTorch references of opforge's own ops, with the inputs each is checked
on, live in opforge.references (REFERENCES, also reachable from here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ._lib import is_tensor_arg
from .references import REFERENCES, Reference, dispersion_correction  # noqa: F401  (re-exported)

# |op - float64 reference| <= atol + rtol * |reference|. Half types are computed
# in fp32 and rounded once, so the bound is about half an ulp of the type; fp16
# meets the brief's checklist (absolute error < 1e-3 on values below 2).
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.bfloat16: dict(atol=1e-2, rtol=4e-3),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
DTYPES = list(TOLERANCES)
# gradients pass through more roundings (and eager autograd of half types rounds after every op)
GRAD_TOLERANCE_FACTOR = 4.0


def tolerance(dtype: torch.dtype, atol: float | None = None, rtol: float | None = None) -> dict:
    """TOLERANCES[dtype], loosened to atol and/or rtol where given and looser: a bound
    a float32 reduction needs (rtol 1e-5) leaves bfloat16's own (4e-3) as it is."""
    tol = dict(TOLERANCES[dtype])
    tol.update({k: max(v, tol[k]) for k, v in (("atol", atol), ("rtol", rtol)) if v is not None})
    return tol


def assert_close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype, what: str = "",
                 atol: float | None = None, rtol: float | None = None) -> None:
    """Compares with a float64 reference within tolerance(dtype, atol, rtol);
    on failure names the worst element."""
    tol = tolerance(dtype, atol, rtol)
    got64 = got.double()
    err = (got64 - want64).abs()
    bound = tol["atol"] + tol["rtol"] * want64.abs()
    both_nan = got64.isnan() & want64.isnan()
    same_inf = (got64 == want64) & want64.isinf()
    bad = ~((err <= bound) | both_nan | same_inf)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        rest = ~both_nan & ~same_inf
        raise AssertionError(
            f"{what} {dtype}: {int(bad.sum())} of {bad.numel()} elements out of tolerance {tol}; "
            f"first at flat index {i}: got {got64.flatten()[i].item()!r}, want {want64.flatten()[i].item()!r}; "
            f"max error {err[rest].max().item() if rest.any() else 0.0}. A looser bound, if this is "
            "rounding (a float32 reduction): atol=/rtol= (--atol/--rtol)"
        )


# ---- generated inputs ----------------------------------------------------------------

EDGE_VALUES = [0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-40, 1e-6, 65000.0]


def _tensor(shape, dtype, seed, edges):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, generator=g, dtype=torch.float64) * 4
    if edges and t.numel() >= len(EDGE_VALUES):
        t.view(-1)[: len(EDGE_VALUES)] = torch.tensor(EDGE_VALUES, dtype=torch.float64)
    return t.to(dtype)


def schema_args(op: torch._ops.OpOverload, make_tensor: Callable[[int], torch.Tensor]) -> tuple:
    """One argument tuple for op from its schema: make_tensor(i) for the i-th
    Tensor argument, 0.8 for floats, 2 for ints, False for bools."""
    args = []
    for a in op._schema.arguments:
        ty = str(a.type)
        if is_tensor_arg(a):
            args.append(make_tensor(len(args)))
        elif ty in ("float", "float?"):
            args.append(0.8)
        elif ty in ("int", "SymInt", "int?"):
            args.append(2)
        elif ty in ("bool", "bool?"):
            args.append(False)
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            raise ValueError(f"cannot generate an argument of type {ty} for {op}: pass the inputs")
    return tuple(args)


def sample_inputs(op: torch._ops.OpOverload, dtype: torch.dtype, edges: bool = True) -> list[tuple]:
    """Argument tuples for op from its schema: tensors of odd shapes (flat,
    2-d, a transposed view, a 0-dim), edge values first (0, -0, negative,
    +-inf, nan, a denormal, near fp16's max); floats 0.8, ints 2, bools False."""
    samples = []
    for k, shape in enumerate([(4099,), (33, 17), "transposed", ()]):
        if shape == "transposed":
            make = lambda i, k=k: _tensor((19, 23), dtype, 10 + k + i, edges).t()  # noqa: E731
        else:
            make = lambda i, k=k, shape=shape: _tensor(shape, dtype, 10 + k + i, edges)  # noqa: E731
        samples.append(schema_args(op, make))
    return samples


# ---- the check --------------------------------------------------------------------------


@dataclass
class DtypeResult:
    dtype: torch.dtype
    supported: bool = True
    error: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: float = 0.0
    cosine: float = 1.0
    share_rel_1e3: float = 0.0
    share_rel_5e3: float = 0.0
    special_mismatches: int = 0
    out_of_tolerance: int = 0
    grad_max_abs: float | None = None
    grad_max_rel: float | None = None
    grad_out_of_tolerance: int = 0
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def passed(self) -> bool:
        return self.supported and not self.error and self.out_of_tolerance == 0 and self.special_mismatches == 0 \
            and self.grad_out_of_tolerance == 0

    @property
    def reason(self) -> str:
        """Why it did not pass, in full ("" when it passed)."""
        why = [self.error] if self.error else []
        if self.special_mismatches:
            why.append(f"{self.special_mismatches} NaN/inf values differ from the reference's "
                       "(a NaN not propagated, or an inf where it is finite)")
        if self.out_of_tolerance:
            why.append(f"{self.out_of_tolerance} values out of tolerance")
        if self.grad_out_of_tolerance:
            why.append(f"{self.grad_out_of_tolerance} gradient values out of {GRAD_TOLERANCE_FACTOR:g}x the tolerance")
        return "; ".join(why)


@dataclass
class CheckReport:
    op: str
    results: list[DtypeResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        tried = [r for r in self.results if r.supported]
        return bool(tried) and all(r.passed for r in tried)

    def __str__(self) -> str:
        head = ("dtype", "max abs", "max rel", "max ulp", "cosine", ">1e-3 rel", ">5e-3 rel", "grad max rel", "tolerance",
                "result", "reason")
        rows = []
        for r in self.results:
            name = str(r.dtype).split(".")[1]
            if not r.supported:
                rows.append((name, *["-"] * 8, "unsupported", r.error))  # the whole message: the last column
                continue
            rows.append((
                name, f"{r.max_abs:.3g}", f"{r.max_rel:.3g}", f"{r.max_ulp:.3g}", f"{r.cosine:.9f}",
                f"{r.share_rel_1e3:.3%}", f"{r.share_rel_5e3:.3%}",
                "-" if r.grad_max_rel is None else f"{r.grad_max_rel:.3g}",
                f"atol {r.atol:g} rtol {r.rtol:g}",
                "PASS" if r.passed else "FAIL", r.reason,
            ))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        out = [f"opforge check {self.op}: {'PASS' if self.passed else 'FAIL'}", line(head).rstrip()] + \
            [line(r).rstrip() for r in rows]
        return "\n".join(out)


def _ulps(got64: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - want| in units in the last place of dtype at want's magnitude."""
    fi = torch.finfo(dtype)
    _, exp = torch.frexp(want64.abs().clamp_min(fi.tiny))
    ulp = torch.ldexp(torch.full_like(want64, fi.eps), exp - 1)
    return (got64 - want64).abs() / ulp


def _compare(got: torch.Tensor, want64: torch.Tensor, dtype, acc: dict, tol: dict) -> None:
    got64 = got.detach().double().flatten()
    want = want64.detach().flatten()
    # a value beyond the dtype's range is inf in it: 65000 ** 2 in float16
    want = torch.where(want.isfinite() & want.to(dtype).isinf(), want.to(dtype).double(), want)
    special = want.isnan() | want.isinf() | got64.isnan() | got64.isinf()
    same_special = (want.isnan() & got64.isnan()) | ((got64 == want) & want.isinf())
    acc["special"] += int((special & ~same_special).sum())
    ok = ~special
    g, w = got64[ok], want[ok]
    if g.numel():
        err = (g - w).abs()
        rel = err / w.abs().clamp_min(torch.finfo(dtype).tiny)
        acc["max_abs"] = max(acc["max_abs"], err.max().item())
        acc["max_rel"] = max(acc["max_rel"], rel.max().item())
        acc["max_ulp"] = max(acc["max_ulp"], _ulps(g, w, dtype).max().item())
        acc["n"] += g.numel()
        acc["rel_1e3"] += int((rel > 1e-3).sum())
        acc["rel_5e3"] += int((rel > 5e-3).sum())
        acc["bad"] += int((err > tol["atol"] + tol["rtol"] * w.abs()).sum())
        acc["dot"] += float((g * w).sum())
        acc["gg"] += float((g * g).sum())
        acc["ww"] += float((w * w).sum())


def _as_overload(op):
    """An OpOverload from one, its packet, "ns::name", or an op's Python function (lib.<op>)."""
    if isinstance(getattr(op, "op", None), torch._ops.OpOverload):
        return op.op
    if isinstance(op, str):
        ns, _, name = op.partition("::")
        op = getattr(getattr(torch.ops, ns), name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    return op


def check(
    op,
    reference: Callable,
    inputs: Sequence[tuple] | Callable[[torch.dtype], Sequence[tuple]] | None = None,
    dtypes: Sequence[torch.dtype] = tuple(DTYPES),
    grad: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    device: str | None = None,
) -> CheckReport:
    """Runs op and reference on the same inputs in every dtype and compares op
    against the reference evaluated in float64.

    inputs: argument tuples (cast to each dtype), a function dtype -> tuples
    (float64 tensors cast to dtype, others kept: a float32 saved value), or
    None: the reference's own (a Reference's inputs), else generated from the
    op's schema (sample_inputs). Gradients are compared on inputs without edge
    values (a finite, positive range), and not for a Reference without grad.
    A reference returning fewer outputs than the op is compared on those.
    atol/rtol loosen TOLERANCES (every dtype, where looser than its own) where given.
    device: where the op runs ("cuda": its CUDA kernel, on inputs of the same layouts copied there);
    the reference runs on the CPU in float64 either way."""
    op = _as_overload(op)
    if isinstance(reference, Reference):
        inputs = reference.inputs if inputs is None else inputs
        grad = grad and reference.grad
    report = CheckReport(str(op._name) if hasattr(op, "_name") else str(op))
    for dtype in dtypes:
        tol = tolerance(dtype, atol, rtol)
        r = DtypeResult(dtype, atol=tol["atol"], rtol=tol["rtol"])
        acc = dict(max_abs=0.0, max_rel=0.0, max_ulp=0.0, n=0, rel_1e3=0, rel_5e3=0, bad=0, special=0,
                   dot=0.0, gg=0.0, ww=0.0)
        samples = _cast_samples(inputs, op, dtype, edges=True)
        try:
            for args in samples:
                out = op(*[to_device(a, device) for a in args])
                want = reference(*[_to64(a) for a in args])
                for o, w in zip(_tuple(out), _tuple(want)):
                    _compare(o.cpu() if isinstance(o, torch.Tensor) else o, w, dtype, acc, tol)
        except RuntimeError as e:
            r.supported, r.error = False, str(e).splitlines()[0]
            report.results.append(r)
            continue
        r.max_abs, r.max_rel, r.max_ulp = acc["max_abs"], acc["max_rel"], acc["max_ulp"]
        r.cosine = acc["dot"] / math.sqrt(acc["gg"] * acc["ww"]) if acc["gg"] and acc["ww"] else 1.0
        r.share_rel_1e3 = acc["rel_1e3"] / max(acc["n"], 1)
        r.share_rel_5e3 = acc["rel_5e3"] / max(acc["n"], 1)
        r.special_mismatches, r.out_of_tolerance = acc["special"], acc["bad"]
        if grad:
            _check_grads(op, reference, _cast_samples(inputs, op, dtype, edges=False), dtype, r, device)
        report.results.append(r)
    return report


def _check_grads(op, reference, samples, dtype, r: DtypeResult, device=None) -> None:
    tol = dict(atol=r.atol, rtol=r.rtol)
    r.grad_max_abs = r.grad_max_rel = 0.0
    for args in samples:
        ref_args = tuple(_to64(a).detach().requires_grad_() if _is_float_tensor(a) else a for a in args)
        args = tuple(to_device(a, device).detach().clone().requires_grad_() if _is_float_tensor(a)
                     else to_device(a, device) for a in args)
        wants = _tuple(reference(*ref_args))
        outs = _tuple(op(*args))[: len(wants)]
        g = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) for o in outs]
        leaves = [a for a in args if _is_float_tensor(a)]
        ref_leaves = [a for a in ref_args if _is_float_tensor(a)]
        got = torch.autograd.grad(outs, leaves, [x.to(dtype).to(o.device) for x, o in zip(g, outs)],
                                  allow_unused=True)
        got = [a.cpu() if a is not None else None for a in got]
        want = torch.autograd.grad(wants, ref_leaves, g, allow_unused=True)
        for a, b in zip(got, want):
            if a is None or b is None:
                continue
            err = (a.double() - b).abs()
            r.grad_max_abs = max(r.grad_max_abs, err.max().item() if err.numel() else 0.0)
            scale = b.abs().clamp_min(torch.finfo(dtype).tiny)
            r.grad_max_rel = max(r.grad_max_rel, (err / scale).max().item() if err.numel() else 0.0)
            f = GRAD_TOLERANCE_FACTOR
            r.grad_out_of_tolerance += int((err > f * (tol["atol"] + tol["rtol"] * b.abs())).sum())


def to_device(a, device: str | torch.device | None):
    """a on device with its sizes, strides and storage offset (a strided view stays that view there,
    so the device's kernel meets the layout the CPU's did); non-tensors and device None as they are."""
    if device is None or not isinstance(a, torch.Tensor) or a.device == torch.device(device):
        return a
    return copy_with_layout(a, device)


def copy_with_layout(a: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A copy of a on device with a's sizes, strides and storage offset: the storage a reaches is copied
    from its offset on, and viewed there as a views it."""
    off = a.storage_offset()
    span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())) if a.numel() else 0
    there = torch.empty(off + span, dtype=a.dtype, device=device)
    if span:
        there[off:].copy_(torch.as_strided(a.detach(), (span,), (1,), off))
    return there.as_strided(a.shape, a.stride(), off)


def _is_float_tensor(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _to64(a):
    return a.double() if _is_float_tensor(a) else a


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _cast_samples(inputs, op, dtype, edges):
    if inputs is None:
        samples = sample_inputs(op, dtype, edges=edges)
        if not edges:  # gradients: a finite range away from sqrt-like singularities
            samples = [tuple(a.abs() + 0.1 if _is_float_tensor(a) else a for a in s) for s in samples]
        return samples
    samples = inputs(dtype) if callable(inputs) else inputs

    def cast(a):
        if not _is_float_tensor(a) or (callable(inputs) and a.dtype != torch.float64):
            return a
        if a.is_contiguous():
            return a.to(dtype)
        return torch.empty_strided(a.shape, a.stride(), dtype=dtype).copy_(a)  # keep the layout

    return [tuple(cast(a) for a in s) for s in samples]
