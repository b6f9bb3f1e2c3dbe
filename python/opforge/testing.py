"""Checking an op against a PyTorch reference (the msProbe-style figures).

    import opforge.testing as ot
    report = ot.check(torch.ops.opforge.dispersion_correction, ot.REFERENCES["dispersion_correction"])
    print(report)            # per dtype: max abs/rel error, ULPs, cosine, shares beyond 1e-3 / 5e-3, grads
    assert report.passed     # else report.failures: each output or gradient out of tolerance, its worst element

The PyTorch references of opforge's own ops, with the inputs each is checked
on, live in opforge.references (REFERENCES, also reachable from here).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

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
# a check runs every combination of an op's bool and enum arguments up to this many, else a sample of it
MAX_COMBINATIONS = 16

Tol = float | Mapping[torch.dtype, float] | None  # one bound for every dtype, or per dtype


def tolerance(dtype: torch.dtype, atol: Tol = None, rtol: Tol = None) -> dict:
    """TOLERANCES[dtype], loosened to atol and/or rtol where given and looser: a bound
    a float32 reduction needs (rtol 1e-5) leaves bfloat16's own (4e-3) as it is.
    atol/rtol: a float for every dtype, or {dtype: float} for those dtypes alone."""
    tol = dict(TOLERANCES[dtype])
    for k, v in (("atol", atol), ("rtol", rtol)):
        v = v.get(dtype) if isinstance(v, Mapping) else v
        if v is not None:
            tol[k] = max(v, tol[k])
    return tol


def assert_close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype, what: str = "",
                 atol: Tol = None, rtol: Tol = None) -> None:
    """Compares with a float64 reference within tolerance(dtype, atol, rtol);
    on failure names the worst element."""
    tol = tolerance(dtype, atol, rtol)
    bad = _worst(what, _judge(got, want64, dtype, tol))
    if bad is not None:
        raise AssertionError(f"{dtype} {bad}; tolerance {tol}. A looser bound, if this is rounding "
                             "(a float32 reduction): atol=/rtol= (--atol/--rtol)")


@dataclass
class Mismatch:
    """One output or gradient out of tolerance: how many of its elements, and the worst of them
    (the largest error / bound; a NaN or inf the reference does not have counts as infinitely far)."""

    what: str  # "output 0", "grad of weight" (the schema's argument name)
    count: int  # elements out of tolerance (NaN/inf mismatches included), over every argument tuple
    numel: int  # elements compared
    index: tuple[int, ...]  # of the worst element, in its argument tuple's output or gradient
    got: float
    want: float
    bound: float  # the bound at that element: factor * (atol + rtol * |want|)
    ratio: float  # |got - want| / bound there
    sample: int = 0  # which argument tuple (0-based)
    shape: tuple[int, ...] = ()  # that tuple's output or gradient shape

    def __str__(self) -> str:
        far = "a NaN/inf mismatch" if math.isinf(self.ratio) else f"{self.ratio:.3g}x the bound"
        return (f"{self.what}: {self.count} of {self.numel} out of tolerance; worst at {list(self.index)} of "
                f"{list(self.shape)} (argument tuple {self.sample}): got {self.got:.6g}, want {self.want:.6g}, "
                f"bound {self.bound:.3g} ({far})")


def _judge(got, want64: torch.Tensor, dtype: torch.dtype, tol: dict, factor: float = 1.0) -> dict:
    """got against its float64 reference, elementwise in their shape: got64, want (a value beyond
    dtype's range is inf in it: 65000 ** 2 in float16), err, bound, special (NaN or inf on either side),
    bad (beyond the bound, or a NaN/inf the reference does not have)."""
    got64 = torch.as_tensor(got).detach().cpu().double()
    want = want64.detach().double()
    rounded = want.to(dtype)
    want = torch.where(want.isfinite() & rounded.isinf(), rounded.double(), want)
    special = ~(want.isfinite() & got64.isfinite())
    same_special = (want.isnan() & got64.isnan()) | ((got64 == want) & want.isinf())
    err = (got64 - want).abs()
    bound = factor * (tol["atol"] + tol["rtol"] * want.abs())
    bad = torch.where(special, ~same_special, err > bound)
    return dict(got64=got64, want=want, err=err, bound=bound, special=special, bad=bad)


def _worst(what: str, j: dict, sample: int = 0) -> Mismatch | None:
    """The Mismatch of one compared tensor (_judge's), None when every element is within its bound."""
    bad = j["bad"]
    count = int(bad.sum())
    if not count:
        return None
    ratio = torch.where(j["special"], math.inf, j["err"] / j["bound"])
    flat = int(torch.where(bad, ratio, -1.0).flatten().argmax())
    index, rest = [], flat
    for n in reversed(bad.shape):
        index.insert(0, rest % n)
        rest //= n
    at = tuple(index)
    return Mismatch(what, count, bad.numel(), at, j["got64"][at].item(), j["want"][at].item(),
                    j["bound"][at].item(), ratio[at].item(), sample, tuple(bad.shape))


def _tally(found: dict[str, Mismatch], compared: dict[str, int], what: str, j: dict, sample: int) -> None:
    """Adds one compared tensor (_judge's) to found (what -> Mismatch) and compared (what -> elements):
    counts add up over argument tuples, the worst element of them all stays."""
    compared[what] = compared.get(what, 0) + j["bad"].numel()
    m, old = _worst(what, j, sample), found.get(what)
    if m is not None:
        found[what] = m if old is None else dataclasses.replace(m if m.ratio > old.ratio else old,
                                                                count=old.count + m.count)


# ---- generated inputs ----------------------------------------------------------------

EDGE_VALUES = [0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-40, 1e-6, 65000.0]


def _tensor(shape, dtype, seed, edges):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, generator=g, dtype=torch.float64) * 4
    if edges and t.numel() >= len(EDGE_VALUES):
        t.view(-1)[: len(EDGE_VALUES)] = torch.tensor(EDGE_VALUES, dtype=torch.float64)
    return t.to(dtype)


def _scalar_type(arg) -> tuple[str, bool]:
    """(type, optional) of a schema argument: ("float", True) for float?."""
    ty = str(arg.type)
    return (ty[len("Optional["):-1], True) if ty.startswith("Optional[") else (ty, False)


def _descriptor(op: torch._ops.OpOverload):
    """op's OpDescriptor, from opforge's own library or one opforge.load / load_library loaded; None for
    an op opforge did not load."""
    from . import _runtime, build

    ns, _, name = op._schema.name.partition("::")
    libs = [_runtime.library, *(lib for _, lib in build._loaded.values())]
    return next((d for lib in libs if lib.namespace == ns for d in lib.ops if d.name == name), None)


def _enums(op: torch._ops.OpOverload) -> dict[str, tuple[str, ...]]:
    """op's str arguments that take one of a fixed list of values (its descriptor's enums)."""
    return dict(getattr(_descriptor(op), "enums", ()))


def scalar_arguments(op: torch._ops.OpOverload) -> dict[str, str]:
    """op's non-Tensor arguments, name -> schema type ("float", "int", "bool", "str"; "float?" when optional)."""
    out = {}
    for a in op._schema.arguments:
        if not is_tensor_arg(a):
            ty, optional = _scalar_type(a)
            out[a.name] = ty + "?" * optional
    return out


def _checked_scalars(op: torch._ops.OpOverload, scalars: Mapping[str, object] | None) -> dict:
    """scalars, each a scalar argument of op and, for an enum, one of its values; else a ValueError
    naming the op, the argument, what it takes and what was given."""
    known, enums = scalar_arguments(op), _enums(op)
    for name, value in (scalars or {}).items():
        if name not in known:
            raise ValueError(f"[{op._schema.name}] has no scalar argument '{name}' (its scalar arguments: "
                             f"{', '.join(f'{n}: {t}' for n, t in known.items()) or 'none'})")
        if name in enums and value is not None and value not in enums[name]:
            raise ValueError(f"[{op._schema.name}] argument '{name}' must be one of {', '.join(enums[name])}, "
                             f"got {value!r}")
    return dict(scalars or {})


def schema_args(op: torch._ops.OpOverload, make_tensor: Callable[[int], torch.Tensor],
                scalars: Mapping[str, object] | None = None) -> tuple:
    """One argument tuple for op from its schema: make_tensor(i) for the i-th
    argument when a Tensor, scalars[name] where given, else 0.8 for floats, 2 for ints,
    False for bools, an enum's first value, the default of an argument that has one, None
    for an optional one."""
    scalars, enums = scalars or {}, _enums(op)
    args = []
    for a in op._schema.arguments:
        ty, optional = _scalar_type(a)
        if is_tensor_arg(a):
            args.append(make_tensor(len(args)))
        elif a.name in scalars:
            args.append(scalars[a.name])
        elif ty == "float":
            args.append(0.8)
        elif ty in ("int", "SymInt"):
            args.append(2)
        elif ty == "bool":
            args.append(False)
        elif a.name in enums:
            args.append(enums[a.name][0])
        elif a.has_default_value() or optional:
            args.append(a.default_value if a.has_default_value() else None)
        else:
            raise ValueError(f"cannot generate an argument of type {ty} for {op}: pass the inputs")
    return tuple(args)


def sample_inputs(op: torch._ops.OpOverload, dtype: torch.dtype, edges: bool = True,
                  scalars: Mapping[str, object] | None = None) -> list[tuple]:
    """Argument tuples for op from its schema: tensors of odd shapes (flat,
    2-d, a transposed view, a 0-dim), edge values first (0, -0, negative,
    +-inf, nan, a denormal, near fp16's max); scalars as schema_args makes them."""
    samples = []
    for k, shape in enumerate([(4099,), (33, 17), "transposed", ()]):
        if shape == "transposed":
            make = lambda i, k=k: _tensor((19, 23), dtype, 10 + k + i, edges).t()  # noqa: E731
        else:
            make = lambda i, k=k, shape=shape: _tensor(shape, dtype, 10 + k + i, edges)  # noqa: E731
        samples.append(schema_args(op, make, scalars))
    return samples


def shaped_args(op: torch._ops.OpOverload, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                scalars: Mapping[str, object] | None = None) -> tuple:
    """One argument tuple for op: each Tensor argument of shapes[name] (default 1024 elements), values
    in [0.01, 1.01) (finite, positive: gradients too are compared on them); scalars as schema_args makes them."""
    names = [a.name for a in op._schema.arguments]

    def make(i):
        g = torch.Generator().manual_seed(i)
        return (torch.rand(shapes.get(names[i], (1024,)), generator=g, dtype=torch.float64) + 0.01).to(dtype)

    return schema_args(op, make, scalars)


def combinations(op: torch._ops.OpOverload, fixed: Sequence[str] = ()) -> tuple[list[dict], int]:
    """(combinations, how many there are): the values of op's bool arguments (False, True) and enum
    arguments (a str taking a fixed list of values) that a check runs, each a {name: value}, the arguments
    named in fixed left out. All of them up to MAX_COMBINATIONS; beyond, a sample the same on every run:
    the first combination (bools False, each enum's first value), then each value of every argument in at
    least one combination (so more than MAX_COMBINATIONS only for an enum of more values), then
    combinations drawn at random (seed 0) up to MAX_COMBINATIONS, in the order of the full list."""
    enums = _enums(op)
    swept = {}
    for a in op._schema.arguments:
        if a.name not in fixed and not is_tensor_arg(a):
            if _scalar_type(a)[0] == "bool":
                swept[a.name] = (False, True)
            elif a.name in enums:
                swept[a.name] = tuple(enums[a.name])
    every = [dict(zip(swept, values)) for values in itertools.product(*swept.values())]
    if len(every) <= MAX_COMBINATIONS:
        return every, len(every)
    rest = every[1:]
    random.Random(0).shuffle(rest)
    picked = [every[0]]
    for name, values in swept.items():
        for v in values:
            if not any(c[name] == v for c in picked):
                picked.append(next(c for c in rest if c[name] == v))
    picked += [c for c in rest if c not in picked][: max(MAX_COMBINATIONS - len(picked), 0)]
    return sorted(picked, key=every.index), len(every)


# ---- the check --------------------------------------------------------------------------


def _label(values: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


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
    combination: dict = field(default_factory=dict)  # the bool and enum values it ran with ({}: no sweep)
    mismatches: list[Mismatch] = field(default_factory=list)  # each output, then gradient, out of tolerance

    @property
    def passed(self) -> bool:
        return self.supported and not self.error and self.out_of_tolerance == 0 and self.special_mismatches == 0 \
            and self.grad_out_of_tolerance == 0

    @property
    def reason(self) -> str:
        """Why it did not pass, in full ("" when it passed)."""
        why = [self.error] if self.error else []
        outputs = ", ".join(m.what for m in self.mismatches if not m.what.startswith("grad of "))
        grads = ", ".join(m.what for m in self.mismatches if m.what.startswith("grad of "))
        if self.special_mismatches:
            why.append(f"{self.special_mismatches} NaN/inf values differ from the reference's "
                       "(a NaN not propagated, or an inf where it is finite)")
        if self.out_of_tolerance:
            why.append(f"{self.out_of_tolerance} values out of tolerance")
        if outputs:
            why[-1] += f" in {outputs}"
        if self.grad_out_of_tolerance:
            why.append(f"{self.grad_out_of_tolerance} gradient values out of {GRAD_TOLERANCE_FACTOR:g}x the "
                       f"tolerance in {grads}")
        return "; ".join(why)


@dataclass
class CheckReport:
    op: str
    results: list[DtypeResult] = field(default_factory=list)  # per combination, per dtype
    combinations: list[dict] = field(default_factory=lambda: [{}])  # the bool and enum values run
    combinations_total: int = 1  # how many there are (more than run: a sample, see combinations())
    scalars: dict = field(default_factory=dict)  # values given for scalar arguments (scalars=, --arg)

    @property
    def passed(self) -> bool:
        tried = [r for r in self.results if r.supported]
        return bool(tried) and all(r.passed for r in tried)

    @property
    def failures(self) -> list[tuple[DtypeResult, Mismatch]]:
        """Every output or gradient out of tolerance, with the row (dtype, combination) it failed in."""
        return [(r, m) for r in self.results for m in r.mismatches]

    def __str__(self) -> str:
        swept = len(self.combinations) > 1
        head = ("dtype", *(("args",) if swept else ()), "max abs", "max rel", "max ulp", "cosine", ">1e-3 rel",
                ">5e-3 rel", "grad max rel", "tolerance", "result", "reason")
        rows = []
        for r in self.results:
            name = (_name(r.dtype), *((_label(r.combination),) if swept else ()))
            if not r.supported:
                rows.append((*name, *["-"] * 8, "unsupported", r.error))  # the whole message: the last column
                continue
            rows.append((
                *name, f"{r.max_abs:.3g}", f"{r.max_rel:.3g}", f"{r.max_ulp:.3g}", f"{r.cosine:.9f}",
                f"{r.share_rel_1e3:.3%}", f"{r.share_rel_5e3:.3%}",
                "-" if r.grad_max_rel is None else f"{r.grad_max_rel:.3g}",
                f"atol {r.atol:g} rtol {r.rtol:g}",
                "PASS" if r.passed else "FAIL", r.reason,
            ))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        out = [f"opforge check {self.op}: {'PASS' if self.passed else 'FAIL'}"]
        if self.scalars:
            out.append(f"given: {_label(self.scalars)}")
        if swept:
            sampled = len(self.combinations) < self.combinations_total
            out.append(f"{len(self.combinations)} of {self.combinations_total} combinations of the bool and enum "
                       "arguments (a sample: fix some with --arg / scalars=)" if sampled else
                       f"every combination of {', '.join(self.combinations[0])}")
            for c in self.combinations:
                rs = [r for r in self.results if r.combination == c]
                failed = [f"{_name(r.dtype)}: {', '.join(m.what for m in r.mismatches) or r.reason}"
                          for r in rs if r.supported and not r.passed]
                ran = any(r.supported for r in rs)
                out.append(f"{_label(c)}: " + (f"FAIL ({'; '.join(failed)})" if failed else "PASS" if ran else
                                                f"unsupported ({rs[0].error})"))
        out += [line(head).rstrip()] + [line(r).rstrip() for r in rows]
        if self.failures:
            out.append("worst elements:")
            out += [f"  {_name(r.dtype)}{' ' + _label(r.combination) if swept else ''} {m}" for r, m in self.failures]
        return "\n".join(out)


def _ulps(got64: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - want| in units in the last place of dtype at want's magnitude."""
    fi = torch.finfo(dtype)
    _, exp = torch.frexp(want64.abs().clamp_min(fi.tiny))
    ulp = torch.ldexp(torch.full_like(want64, fi.eps), exp - 1)
    return (got64 - want64).abs() / ulp


def _compare(j: dict, dtype, acc: dict) -> None:
    """Adds one output's figures (_judge's comparison) to acc."""
    ok = ~j["special"]
    acc["special"] += int((j["bad"] & j["special"]).sum())
    g, w, err = j["got64"][ok], j["want"][ok], j["err"][ok]
    if g.numel():
        rel = err / w.abs().clamp_min(torch.finfo(dtype).tiny)
        acc["max_abs"] = max(acc["max_abs"], err.max().item())
        acc["max_rel"] = max(acc["max_rel"], rel.max().item())
        acc["max_ulp"] = max(acc["max_ulp"], _ulps(g, w, dtype).max().item())
        acc["n"] += g.numel()
        acc["rel_1e3"] += int((rel > 1e-3).sum())
        acc["rel_5e3"] += int((rel > 5e-3).sum())
        acc["bad"] += int((j["bad"] & ok).sum())
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
    atol: Tol = None,
    rtol: Tol = None,
    device: str | None = None,
    scalars: Mapping[str, object] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> CheckReport:
    """Runs op and reference on the same inputs in every dtype and compares op
    against the reference evaluated in float64.

    inputs: argument tuples (cast to each dtype), a function dtype -> tuples
    (float64 tensors cast to dtype, others kept: a float32 saved value), or
    None: the reference's own (a Reference's inputs), else generated from the
    op's schema: of shapes (name -> shape per Tensor argument, shaped_args) where given, else
    sample_inputs'. Gradients are compared on inputs without edge
    values (a finite, positive range), and not for a Reference without grad.
    A reference returning fewer outputs than the op is compared on those.
    scalars: values of scalar arguments by name (used in given inputs too), instead of the generated ones.
    Generated inputs run every combination of the bool and enum arguments scalars does not fix
    (combinations(): at most MAX_COMBINATIONS, else a sample); given ones run as given.
    atol/rtol loosen TOLERANCES where given and looser: a float for every dtype, {dtype: float} for those.
    device: where the op runs ("cuda": its CUDA kernel, on inputs of the same layouts copied there);
    the reference runs on the CPU in float64 either way.

    Gradients: the reference gets the incoming gradient the op gets, rounded to the op output's dtype,
    so that rounding it is not counted as the op's error. The bound does not grow with a reduction's
    length (a weight gradient summing B*L rows): the op's own rounding of such a sum, computed in fp32
    over the same (rounded) operands, is one rounding of its result, which rtol covers at any length;
    what is left grows with the length only for a sum kept in float32 itself (about sqrt(n) roundings of
    2**-24), which float32's own bound, loosened per dtype (atol={torch.float32: ...}), is for.
    report.failures names each output and gradient out of tolerance, with its worst element."""
    op = _as_overload(op)
    if isinstance(reference, Reference):
        inputs = reference.inputs if inputs is None and shapes is None else inputs
        grad = grad and reference.grad
    scalars = _checked_scalars(op, scalars)
    combos, total = combinations(op, fixed=list(scalars)) if inputs is None else ([{}], 1)
    report = CheckReport(str(op._name) if hasattr(op, "_name") else str(op), combinations=combos,
                         combinations_total=total, scalars=scalars)
    for combo in combos:
        given = {**scalars, **combo}
        for dtype in dtypes:
            samples = lambda edges: _cast_samples(inputs, op, dtype, edges, given, shapes)  # noqa: E731
            report.results.append(_check_dtype(op, reference, samples, dtype, grad, atol, rtol, device, combo))
    return report


def _check_reference_outputs(out, want) -> None:
    """The reference's results against the op's: a tensor of the op's shape for each (the op may return
    more: saved values the reference does not make). A ValueError otherwise, which check lets through:
    the reference is wrong, not the op unsupported for a dtype."""
    outs, wants = _tuple(out), _tuple(want) if want is not None else ()
    if not wants:
        raise ValueError(f"the reference returned {'None' if want is None else 'nothing'}: it must return what the "
                         "op does (a tensor, or a tuple of them)")
    for k, (o, w) in enumerate(zip(outs, wants)):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"the reference's result {k} is a {type(w).__name__}, not a tensor")
        if tuple(w.shape) != tuple(o.shape):
            raise ValueError(f"the reference's result {k} has shape {tuple(w.shape)}, the op's {tuple(o.shape)}")


def _check_dtype(op, reference, samples, dtype, grad, atol, rtol, device, combo) -> DtypeResult:
    tol = tolerance(dtype, atol, rtol)
    r = DtypeResult(dtype, atol=tol["atol"], rtol=tol["rtol"], combination=combo)
    acc = dict(max_abs=0.0, max_rel=0.0, max_ulp=0.0, n=0, rel_1e3=0, rel_5e3=0, bad=0, special=0,
               dot=0.0, gg=0.0, ww=0.0)
    found, compared = {}, {}
    try:
        for s, args in enumerate(samples(True)):
            out = op(*[to_device(a, device) for a in args])
            want = reference(*[_to64(a) for a in args])
            _check_reference_outputs(out, want)
            for k, (o, w) in enumerate(zip(_tuple(out), _tuple(want))):
                j = _judge(o, w, dtype, tol)
                _compare(j, dtype, acc)
                _tally(found, compared, f"output {k}", j, s)
    except RuntimeError as e:
        r.supported, r.error = False, str(e).splitlines()[0]
        return r
    r.max_abs, r.max_rel, r.max_ulp = acc["max_abs"], acc["max_rel"], acc["max_ulp"]
    r.cosine = acc["dot"] / math.sqrt(acc["gg"] * acc["ww"]) if acc["gg"] and acc["ww"] else 1.0
    r.share_rel_1e3 = acc["rel_1e3"] / max(acc["n"], 1)
    r.share_rel_5e3 = acc["rel_5e3"] / max(acc["n"], 1)
    r.special_mismatches, r.out_of_tolerance = acc["special"], acc["bad"]
    if grad:
        _check_grads(op, reference, samples(False), dtype, r, found, compared, device)
    r.mismatches = [dataclasses.replace(m, numel=compared[m.what]) for m in found.values()]
    return r


def _check_grads(op, reference, samples, dtype, r: DtypeResult, found: dict, compared: dict, device=None) -> None:
    tol = dict(atol=r.atol, rtol=r.rtol)
    names = [a.name for a in op._schema.arguments]
    r.grad_max_abs = r.grad_max_rel = 0.0
    for s, args in enumerate(samples):
        which = [i for i, a in enumerate(args) if _is_float_tensor(a)]
        ref_args = tuple(_to64(a).detach().requires_grad_() if _is_float_tensor(a) else a for a in args)
        args = tuple(to_device(a, device).detach().clone().requires_grad_() if _is_float_tensor(a)
                     else to_device(a, device) for a in args)
        wants = _tuple(reference(*ref_args))
        outs = _tuple(op(*args))[: len(wants)]
        # the incoming gradient as the op gets it (rounded to its output's dtype), for the reference too:
        # rounding it is not the op's error (a sum over B*L rows of it would carry sqrt(B*L) roundings)
        g = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(o.dtype)
             for o in outs]
        got = torch.autograd.grad(outs, [args[i] for i in which], [x.to(o.device) for x, o in zip(g, outs)],
                                  allow_unused=True)
        want = torch.autograd.grad(wants, [ref_args[i] for i in which], [x.double() for x in g], allow_unused=True)
        for i, a, b in zip(which, got, want):
            if a is None or b is None:
                continue
            j = _judge(a, b, dtype, tol, GRAD_TOLERANCE_FACTOR)
            err = j["err"]
            r.grad_max_abs = max(r.grad_max_abs, err.max().item() if err.numel() else 0.0)
            scale = j["want"].abs().clamp_min(torch.finfo(dtype).tiny)
            r.grad_max_rel = max(r.grad_max_rel, (err / scale).max().item() if err.numel() else 0.0)
            r.grad_out_of_tolerance += int(j["bad"].sum())
            _tally(found, compared, f"grad of {names[i]}", j, s)


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


def _cast_samples(inputs, op, dtype, edges, scalars, shapes):
    if inputs is None and shapes is not None:
        return [shaped_args(op, shapes, dtype, scalars)]
    if inputs is None:
        samples = sample_inputs(op, dtype, edges, scalars)
        if not edges:  # gradients: a finite range away from sqrt-like singularities
            samples = [tuple(a.abs() + 0.1 if _is_float_tensor(a) else a for a in s) for s in samples]
        return samples
    samples = inputs(dtype) if callable(inputs) else inputs
    names = [a.name for a in op._schema.arguments]

    def cast(a, name):
        if name in scalars:
            return scalars[name]
        if not _is_float_tensor(a) or (callable(inputs) and a.dtype != torch.float64):
            return a
        if a.is_contiguous():
            return a.to(dtype)
        return torch.empty_strided(a.shape, a.stride(), dtype=dtype).copy_(a)  # keep the layout

    return [tuple(cast(a, name) for a, name in zip(s, names)) for s in samples]
