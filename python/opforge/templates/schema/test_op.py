"""{name} against its PyTorch reference: values per dtype (float64 too), with and without each
optional tensor, every enum and bool value, strided views, every ISA variant, gradients (gradcheck in
float64), opcheck, torch.compile, autocast, thread counts, errors, the log line.
Run: pytest"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import opforge
import opforge.testing as ot
from ops import {name}
from reference import {name} as reference

# ---- what the op takes (written by opforge new from the schema) -----------------------------------------
{SPEC}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# the vector variants against the reference kernel, a row in and a row out: a few float32 ulps, as vector
# math (an exp, an FMA) rounds otherwise than the reference's; dict(rtol=0, atol=0) demands its bits
VARIANT_TOL = dict(rtol=4e-6, atol=4e-6)
# |op - float64 reference| <= atol + rtol * |reference|; float32 computes, halves are rounded once at the end
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make(case, dtype=torch.float32, seed=0, present=None):
    """The tensor arguments of a case: a dict name -> tensor (None for an optional one left out)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t, shape in case.items():
        if t in OPTIONAL and present is not None and t not in present:
            out[t] = None
        else:
            out[t] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return out


def call_args(tensors, scalars=None):
    """The op's arguments in schema order."""
    scalars = dict(SCALARS, **(scalars or {}))
    return tuple(tensors[a] if a in tensors else scalars[a] for a in ARGS)


def double(tensors):
    return {t: None if v is None else v.double() for t, v in tensors.items()}


def combos():
    """Every combination of the enums' and bools' values (at most 16)."""
    names = list(ENUMS) + BOOLS
    values = [ENUMS[n] for n in ENUMS] + [[False, True] for _ in BOOLS]
    return [dict(zip(names, v)) for v in itertools.product(*values)][:16] or [{}]


def presences():
    """Each optional tensor given and left out: all given, then each one left out."""
    return [set(OPTIONAL)] + [set(OPTIONAL) - {t} for t in sorted(OPTIONAL)]


def tol(dtype, n=1):
    t = dict(TOL[dtype])
    t["atol"] *= max(n, 1) ** 0.5  # a sum of n float32 terms rounds ~sqrt(n) times more than one term
    return t


def row_len(case):
    return case[MAIN][-1] if case[MAIN] else 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_values(case, dtype):
    for present in presences():
        for combo in combos():
            ts = make(CASES[case], dtype, present=present)
            y = {name}(*call_args(ts, combo))
            want = reference(*call_args(double(ts), combo))
            assert y.dtype == dtype and y.shape == want.shape, (combo, present)
            torch.testing.assert_close(y.double(), want, **tol(dtype, row_len(CASES[case]) if REDUCE else 1),
                                       msg=lambda m, c=combo, p=present: f"{c} given {sorted(p)}: {m}")


def strided(t, how):
    """t's values in a strided layout: every other element of a wider tensor, or a permuted one."""
    if t.dim() == 0:
        return t
    if how == "sliced":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))


@pytest.mark.parametrize("how", ["sliced", "permuted"])
def test_strided_inputs(how):
    ts = make(CASES[0])
    views = {t: strided(v, how) for t, v in ts.items()}
    assert not views[MAIN].is_contiguous() or views[MAIN].numel() <= 1
    y = {name}(*call_args(views))
    torch.testing.assert_close(y.double(), reference(*call_args(double(ts))), **tol(torch.float32, row_len(CASES[0])))
    if GRADS:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        got = torch.autograd.grad({name}(*call_args({t: v.requires_grad_() for t, v in views.items()})),
                                  [views[t] for t in GRADS], dy)
        want = torch.autograd.grad(reference(*call_args({t: v.requires_grad_() for t, v in ts.items()})),
                                   [ts[t] for t in GRADS], dy)
        for t, a, b in zip(GRADS, got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=lambda m, t=t: f"d{t}: {m}")


def test_every_isa_matches_the_reference_kernel():
    case = CASES[min(2, len(CASES) - 1)]
    ts = make(case)
    for t in GRADS:
        ts[t].requires_grad_()
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            y = {name}(*call_args(ts))
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
            outs[isa] = (y, torch.autograd.grad(y, [ts[t] for t in GRADS], dy) if GRADS else ())
    finally:
        opforge.set_isa("auto")
    ref_y, ref_g = outs["ref"]
    for isa, (y, grads) in outs.items():
        # a vector variant's sums (a reduced row, a parameter's gradient) add their terms in another order
        summed = dict(rtol=1e-5, atol=1e-4 * row_len(case) ** 0.5)
        torch.testing.assert_close(y, ref_y, **(summed if REDUCE else VARIANT_TOL), msg=f"{isa} forward")
        for t, g, g_ref in zip(GRADS, grads, ref_g):
            torch.testing.assert_close(g, g_ref, **(VARIANT_TOL if t == MAIN else summed),
                                       msg=lambda m, isa=isa, t=t: f"{isa} gradient of {t}: {m}")


@pytest.mark.skipif(not GRADS, reason="the op has no backward")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_match_autograd_of_the_reference(dtype):
    for present in presences():
        ts = make(CASES[0], dtype, present=present)
        for t in GRADS:
            if ts[t] is not None:
                ts[t].requires_grad_()
        ref = {t: None if v is None else v.detach().double().requires_grad_(v.requires_grad) for t, v in ts.items()}
        y = {name}(*call_args(ts))
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
        y.backward(dy)
        reference(*call_args(ref)).backward(dy.double())  # the same (rounded) incoming gradient
        rows = max(y.numel() // max(row_len(CASES[0]), 1), 1) if not REDUCE else y.numel()
        for t in GRADS:
            if ts[t] is None:
                continue
            assert ts[t].grad.dtype == ts[t].dtype, t
            # a parameter's gradient sums over the rows: its bound grows with their number
            n = 1 if t == MAIN else rows * (1 if REDUCE else row_len(CASES[0]))
            torch.testing.assert_close(ts[t].grad.double(), ref[t].grad, **tol(dtype, n),
                                       msg=lambda m, t=t, p=present: f"d{t} given {sorted(p)}: {m}")


@pytest.mark.skipif(not GRADS, reason="the op has no backward")
def test_gradcheck_in_float64():
    case = CASES[1] if len(CASES) > 1 else CASES[0]
    ts = make(case, torch.float64)
    for t in GRADS:
        ts[t].requires_grad_()
    for combo in combos()[:4]:
        assert torch.autograd.gradcheck(lambda *g: {name}(*call_args(dict(ts, **dict(zip(GRADS, g))), combo)),
                                        [ts[t] for t in GRADS])


@pytest.mark.parametrize("present", range(len(presences())))
def test_opcheck(present):
    ts = make(CASES[0], present=presences()[present])
    op = torch.ops.{name}.{name}.default
    opcheck(op, call_args(ts))
    if GRADS:
        opcheck(op, call_args({t: v if v is None or t not in GRADS else v.clone().requires_grad_()
                               for t, v in ts.items()}))
        y = op(*call_args(ts))
        opcheck(torch.ops.{name}.{name}_backward.default, (torch.randn_like(y), *call_args(ts)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(dynamic):
    f = torch.compile(lambda *a: {name}(*a).sin(), fullgraph=True, dynamic=dynamic)
    for case in CASES[:2]:  # the second: a recompile, or the same graph when dynamic
        ts = make(case)
        for t in GRADS:
            ts[t].requires_grad_()
        y = f(*call_args(ts))
        torch.testing.assert_close(y.double(), reference(*call_args(double(ts))).sin(),
                                   **tol(torch.float32, row_len(case)))
        if GRADS:
            y.sum().backward()


def test_autocast_bfloat16_runs_in_bfloat16():
    ts = make(CASES[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = {name}(*call_args(ts))
    assert y.dtype == torch.bfloat16
    low = {t: v.bfloat16() for t, v in ts.items()}
    torch.testing.assert_close(y.double(), reference(*call_args(double(low))), **tol(torch.bfloat16, row_len(CASES[0])))


def test_results_do_not_depend_on_the_thread_count():
    # 16 and 64 oversubscribe a small machine: the plan (tasks of rows, fixed by the sizes) is what is checked
    case = CASES[min(2, len(CASES) - 1)]
    ts = make(case)
    for t in GRADS:
        ts[t].requires_grad_()
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 16, 64):
            torch.set_num_threads(n)
            y = {name}(*call_args(ts))
            grads = torch.autograd.grad(y, [ts[t] for t in GRADS], torch.ones_like(y) * 0.5) if GRADS else ()
            results.append((y, grads))
    finally:
        torch.set_num_threads(threads)
    for y, grads in results[1:]:
        assert torch.equal(y, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


def test_bad_input_is_a_clear_error():
    op = r"\[{name}::{name}\]"
    ts = make(CASES[0])
    with pytest.raises(RuntimeError, match=rf"{op} argument '{MAIN}' must be a floating-point tensor \(float32, "
                                           r"float64, bfloat16 or float16\), got int64"):
        {name}(*call_args(dict(ts, **{MAIN: ts[MAIN].long()})))
    for e, values in ENUMS.items():
        with pytest.raises(RuntimeError, match=rf"{op} argument '{e}' must be one of .*got 'no_such_value'"):
            {name}(*call_args(ts, {e: "no_such_value"}))
        with pytest.raises(RuntimeError, match=rf"argument '{e}' must be one of"):  # compile too
            torch.compile(lambda *a: {name}(*a), fullgraph=True)(*call_args(ts, {e: "no_such_value"}))
    for t, dims in DIMS.items():
        with pytest.raises(RuntimeError, match=rf"{op} argument '{t}' must have {len(dims)} dims? \({', '.join(dims)}\), "
                                               rf"got {len(dims) + 1}"):
            {name}(*call_args(dict(ts, **{t: ts[t].unsqueeze(0)})))
    for t, j, ref, rj in SHARED:
        bad = list(ts[t].shape)
        bad[j] += 1
        with pytest.raises(RuntimeError, match=rf"{op} argument '{t}' must have size\({j}\) == {ref}.size\({rj}\)"):
            {name}(*call_args(dict(ts, **{t: torch.randn(bad)})))


def test_log_line_names_the_kernel_that_ran():
    # y.sum().backward() hands the backward a stride-0 gradient: the glue copies its rows to stride 1 for
    # the vector variant, which runs (no fallback to the reference in the log line)
    code = ("import torch, ops, test_{name} as t; ts = t.make(t.CASES[0]); "
            "[ts[g].requires_grad_() for g in t.GRADS]; y = ops.{name}(*t.call_args(ts)); "
            "y.sum().backward() if t.GRADS else None")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OPFORGE_LOG_LEVEL="info"))
    assert r.returncode == 0, r.stderr
    isas = opforge.supported_isas()  # the widest variant the op has that the CPU runs (amx runs avx512's)
    variant = "avx512" if "avx512" in isas else "avx2" if "avx2" in isas else "ref"
    for op in ["{name}::{name} "] + (["{name}::{name}_backward "] if GRADS else []):
        lines = [line for line in r.stderr.splitlines() if op in line and "[opforge info]" in line]
        assert len(lines) == 1 and f"kernels={name}:{variant} " in lines[0], r.stderr


def test_check_report_passes():
    ts = make(CASES[0], torch.float64)
    report = ot.check(torch.ops.{name}.{name}, reference, inputs=[call_args(ts)], dtypes=DTYPES[:3],
                      rtol=1e-5, atol=1e-4, grad=bool(GRADS))
    print(report)
    assert report.passed
