"""softmax and log_softmax against PyTorch: values per dtype vs float64,
strided layouts, gradients, gradcheck, -inf / +inf / NaN rows, opcheck,
torch.compile, autocast, thread counts, ISAs, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import functional as OF

SOFTMAX = torch.ops.opforge.softmax.default
LOG_SOFTMAX = torch.ops.opforge.log_softmax.default
FNS = {"softmax": (OF.softmax, F.softmax), "log_softmax": (OF.log_softmax, F.log_softmax)}
# Against float64 torch on the same (rounded) input. float32: exp to ~1 ulp of
# its argument's rounding plus float32 sums; log_softmax values reach ~-40
# here, so its absolute error is a few 1e-6. 16-bit types compute in float32
# and round once: half an ulp of the type, relative (log_softmax: of |y|).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=2e-3),
}
# gradients: sums of dy*y (or dy) over the row in float32, then one product;
# 16-bit gradients round the result and start from a rounded y
GRAD_TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
}


def check(got, want, tol):
    torch.testing.assert_close(got.double(), want, equal_nan=True, **tol)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize(
    "shape, dim",
    [((1, 1), -1), ((3, 7), -1), ((37, 123), 1), ((3, 4097), -1), ((2, 32000), -1), ((5, 123), 0), ((2, 3, 17), 1),
     ((4, 9, 6), 0), ((7,), 0), ((), 0)],
    ids=str,
)
def test_values(shape, dim, fn, dtype):
    ours, theirs = FNS[fn]
    x = (torch.randn(shape) * 4).to(dtype)
    y = ours(x, dim)
    assert y.shape == x.shape and y.dtype == dtype
    check(y, theirs(x.double(), dim), TOL[dtype])


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("view", ["transposed", "sliced", "permuted-3d", "dim-in-middle-of-strided", "expanded"])
def test_strided_inputs_are_read_in_place(view, fn):
    ours, theirs = FNS[fn]
    if view == "transposed":
        x, dims = torch.randn(300, 37).t(), (0, 1)
    elif view == "sliced":
        x, dims = torch.randn(9, 130)[::2, 1::3], (0, 1)
    elif view == "permuted-3d":
        x, dims = torch.randn(5, 6, 70).permute(2, 0, 1), (0, 1, 2)
    elif view == "dim-in-middle-of-strided":
        x, dims = torch.randn(4, 33, 10)[:, :, ::2], (1,)
    else:
        x, dims = torch.randn(1, 50).expand(6, 50), (0, 1)
    for dim in dims:
        check(ours(x, dim), theirs(x.double(), dim), TOL[torch.float32])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("shape, dim", [((37, 123), -1), ((3, 4097), -1), ((123, 19), 0), ((4, 9, 6), 1)], ids=str)
def test_gradients(shape, dim, fn, dtype):
    ours, theirs = FNS[fn]
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    xr = x.detach().double().requires_grad_()
    dy = torch.randn(shape).to(dtype)
    ours(x, dim).backward(dy)
    theirs(xr, dim).backward(dy.double())
    assert x.grad.dtype == dtype
    check(x.grad, xr.grad, GRAD_TOL[dtype])


def test_gradient_of_a_non_contiguous_grad():
    x = torch.randn(6, 40, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    OF.log_softmax(x, -1).sum().backward()  # the incoming gradient is an expanded 1
    F.log_softmax(xr, -1).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    dy = torch.randn(40, 6).t()  # a transposed incoming gradient
    (g,) = torch.autograd.grad(OF.softmax(x, 0), x, dy)
    (gr,) = torch.autograd.grad(F.softmax(xr, 0), xr, dy)
    torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("dim", [0, -1])
def test_gradcheck_float64(fn, dim):
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: FNS[fn][0](t, dim), (x,))
    xt = torch.randn(9, 5, dtype=torch.float64).t().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: FNS[fn][0](t, dim), (xt,))


@pytest.mark.parametrize("dtype", list(TOL))
def test_minus_inf_entries_give_exact_zeros_and_finite_gradients(dtype):
    x = torch.randn(4, 37).to(dtype)
    x[:, ::5] = float("-inf")
    x = x.requires_grad_()
    y, ly = OF.softmax(x, -1), OF.log_softmax(x, -1)
    assert (y.detach()[:, ::5] == 0).all() and (ly.detach()[:, ::5] == float("-inf")).all()
    assert torch.isfinite(y.detach()[:, 1::5]).all() and torch.isfinite(ly.detach()[:, 1::5]).all()
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), x)
    (lg,) = torch.autograd.grad((ly.masked_fill(torch.isinf(ly), 0) * torch.randn_like(y)).sum(), x)
    assert torch.isfinite(g).all() and torch.isfinite(lg).all()
    assert (g[:, ::5] == 0).all()


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("dim", [0, 1])
def test_inf_and_nan_rows_match_torch(fn, dim):
    ours, theirs = FNS[fn]
    x = torch.randn(6, 40)
    x[0] = float("-inf")  # all -inf: NaN
    x[1, 3] = float("inf")  # +inf: the row NaN
    x[2, 7] = float("nan")
    x[3, ::2] = float("-inf")
    x[4, 5] = float("-inf")
    x = x if dim == 1 else x.t().contiguous()
    want = theirs(x, dim)
    got = ours(x, dim)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.parametrize("op", [SOFTMAX, LOG_SOFTMAX])
def test_opcheck(op):
    opcheck(op, (torch.randn(5, 13), -1))
    opcheck(op, (torch.randn(13, 5).t(), 0))
    opcheck(op, (torch.randn(3, 5, 7, requires_grad=True), 1))


def test_opcheck_backward_ops():
    y = torch.softmax(torch.randn(4, 9), -1)
    opcheck(torch.ops.opforge.softmax_backward.default, (torch.randn(4, 9), y, -1))
    opcheck(torch.ops.opforge.log_softmax_backward.default, (torch.randn(4, 9), y.log(), 1))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    torch._dynamo.reset()

    def block(t):
        return (OF.softmax(t, -1) * OF.log_softmax(t * 2, 0)).sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for rows in (5, 8):
        x = torch.randn(rows, 33, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out = compiled(x)
        out.backward()
        ref = (F.softmax(xr, -1) * F.log_softmax(xr * 2, 0)).sum()
        ref.backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)


def test_autocast_keeps_the_dtype_as_torch_does():
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fn, (ours, theirs) in FNS.items():
            assert ours(x, -1).dtype == theirs(x, -1).dtype == torch.float32, fn
            assert ours(x.bfloat16(), -1).dtype == theirs(x.bfloat16(), -1).dtype == torch.bfloat16, fn


@pytest.mark.parametrize("fn", list(FNS))
def test_same_bits_on_1_and_2_threads(fn):
    x = torch.randn(64, 3000, requires_grad=True)
    dy = torch.randn(64, 3000)
    saved = torch.get_num_threads()
    res = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x.grad = None
            y = FNS[fn][0](x, -1)
            y.backward(dy)
            res.append((y.detach(), x.grad.clone()))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_every_isa_agrees():
    x = torch.randn(37, 4097)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = (OF.softmax(x, -1), OF.log_softmax(x.t(), 0))
    finally:
        opforge.set_isa("auto")
    for isa, (y, ly) in outs.items():
        torch.testing.assert_close(y, outs["ref"][0], rtol=1e-5, atol=1e-6, msg=f"{isa} vs ref")
        torch.testing.assert_close(ly, outs["ref"][1], rtol=1e-5, atol=1e-5, msg=f"{isa} vs ref")


def test_empty_and_zero_dim():
    assert OF.softmax(torch.randn(0, 5), -1).shape == (0, 5)
    assert OF.log_softmax(torch.randn(3, 0), -1).shape == (3, 0)
    assert OF.softmax(torch.tensor(2.5), 0).item() == F.softmax(torch.tensor(2.5), 0).item() == 1.0


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: OF.softmax(torch.randn(3, 4), 2), r"\[opforge::softmax\] argument 'dim' must be in \[-2, 1\] for a 2-d tensor, got 2"),
        (lambda: OF.log_softmax(torch.randn(3), -2), r"\[opforge::log_softmax\] argument 'dim' must be in \[-1, 0\] for a 1-d tensor, got -2"),
        (lambda: OF.softmax(torch.ones(3, 4, dtype=torch.int64), -1), r"\[opforge::softmax\] argument 'x' must be a floating-point tensor"),
        (lambda: torch.ops.opforge.softmax_backward(torch.randn(3, 5), torch.randn(3, 4), -1), r"\[opforge::softmax_backward\] argument 'grad' must have the shape of 'y' \[3, 4\], got \[3, 5\]"),
        (lambda: torch.ops.opforge.log_softmax_backward(torch.randn(3, 4).double(), torch.randn(3, 4), -1), r"argument 'grad' must have the dtype of 'y' \(float32\), got float64"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


# ---- what the generic tests run of softmax and log_softmax (tests/python/discover.py) ---------------------

# fuzz.py: random shapes near the vector widths and lane chunks, any dim, -inf entries and lines, layouts,
# dtypes, ISAs and threads, against float64 torch

SM_MARKS = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 123, 4097, 32000)  # vectors, lane chunks, vocab


def _fuzz_draw(rng, c):
    nd = rng.choices((1, 2, 3), (0.2, 0.55, 0.25))[0]
    c["dim"] = rng.randrange(-nd, nd)
    shape = [fuzz.dim(rng, 96 if nd == 3 else 300, SM_MARKS, zero=0.02) for _ in range(nd)]
    shape[c["dim"]] = fuzz.dim(rng, 32000, SM_MARKS, zero=0.02)
    while math.prod(shape) > 2_000_000:
        others = [d for d in range(nd) if d != c["dim"] % nd and shape[d] > 1]
        d = max(others, key=lambda d: shape[d]) if others else c["dim"]
        shape[d] //= 2
    c["shape"] = shape
    c["layout"] = fuzz.layout(rng, shape)
    c["log"] = rng.random() < 0.5
    c["specials"] = rng.random() < 0.3  # -inf entries, and now and then a line of -inf only
    c["grad"] = rng.random() < 0.6
    return fuzz.seconds(c, 0, 0, math.prod(shape) * 40)


def _fuzz_describe(c):
    return (f"{'log_softmax' if c['log'] else 'softmax'} x={tuple(c['shape'])}{fuzz.layout_str(c['layout'])} "
            f"dim={c['dim']} specials={c['specials']} grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    base, view = fuzz.make(gen, c["shape"], dtype, c["layout"], scale=3.0)
    dim = c["dim"]
    if c["specials"] and base.numel():
        idx = torch.randint(0, base.numel(), (min(base.numel(), 64),), generator=gen)
        base.view(-1)[idx] = -math.inf
        lay = c["layout"]
        if base.dim() and (lay is None or not lay["expand"]) and torch.rand((), generator=gen) < 0.3:
            line = tuple(slice(None) if d == dim % base.dim() else 0 for d in range(base.dim()))
            view(base)[line] = -math.inf  # a line of -inf only: NaN, as torch
    base.requires_grad_(c["grad"])
    x = view(base)
    fn = opforge.functional.log_softmax if c["log"] else opforge.functional.softmax
    g = fuzz.random_tensor(gen, c["shape"], dtype)

    def forward_backward():
        y = fn(x, dim)
        return y, (torch.autograd.grad(y, x, g)[0] if c["grad"] else None)

    if c["grad"]:
        y, dx = call(forward_backward)
    else:
        with torch.no_grad():
            y, dx = call(forward_backward)
    x64 = x.detach().double()
    n = x64.shape[dim] if x64.dim() else 1
    u = fuzz.U_ACC[dt]
    sm = F.softmax(x64, dim)
    mx = x64.amax(dim, keepdim=True) if x64.numel() else x64
    d = (x64 - mx).abs().nan_to_num(0.0, 0.0, 0.0)  # the exp's argument: its rounding is relative to it
    if c["log"]:
        want = F.log_softmax(x64, dim)
        bound = fuzz.C_FN * u * (d + mx.abs().nan_to_num(0.0, 0.0, 0.0) + 1.0) + fuzz.c_sum(n) * u + fuzz.out_tol(want, dt)
    else:
        want = sm
        bound = (fuzz.C_FN * u * (1.0 + d) + fuzz.c_sum(n) * u) * sm + fuzz.out_tol(want, dt)
    checks = [fuzz.Check("out", y, want, bound.nan_to_num(0.0, 0.0, 0.0), dtype)]
    if c["grad"]:
        g64 = g.double()
        x64r = x64.clone().requires_grad_()
        with torch.enable_grad():
            (gwant,) = torch.autograd.grad((F.log_softmax if c["log"] else F.softmax)(x64r, dim), x64r, g64)
        ga = g64.abs()
        # the backward reads y as saved: its forward error, and its rounding where FUZZ's rounded says so
        # (relative, or half a float16 subnormal's spacing)
        y_rnd = fuzz.rounding_err(c, "y", want)
        if c["log"]:  # dx = dy - exp(y) sum(dy)
            gsum = ga.sum(dim, keepdim=True)
            err_y = fuzz.C_FN * u * (d + mx.abs().nan_to_num(0.0, 0.0, 0.0) + 1.0)
            gb = 4 * (sm * gsum * (err_y + fuzz.c_sum(n) * u) + fuzz.C_FN * u * ga) + sm * gsum * y_rnd.expm1()
        else:  # dx = y (dy - sum(dy y))
            def carried(ey):
                return ey * (ga + (ga * sm).sum(dim, keepdim=True)) + sm * (ga * ey).sum(dim, keepdim=True)

            gb = 4 * (carried(sm * fuzz.C_FN * u * (1.0 + d)) + fuzz.c_sum(n) * u * sm * (ga * sm).sum(dim, keepdim=True)) \
                + carried(y_rnd)
        checks.append(fuzz.Check("dx", dx, gwant, gb.nan_to_num(0.0, 0.0, 0.0) + fuzz.out_tol(gwant, dt), dtype))
    return checks


FUZZ = {
    # softmax.c: the backward reads the saved 16-bit y (softmax.h)
    "softmax": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.15, order=8,
                       covers=("softmax", "log_softmax"), rounded={("*", "*"): ("y",)}),
}


# test_export.py: the ops' parts of the exported model

EXPORT = {
    "softmax": lambda g, hidden, vocab, max_len: ({}, lambda x, target: (OF.softmax(x),)),
    "log_softmax": lambda g, hidden, vocab, max_len: ({}, lambda x, target: (OF.log_softmax(x),)),
}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "softmax": training.Case(
        ("softmax",),
        lambda dt, big: [training.randn(700 if big else 6, 9, 33, dtype=dt)],
        (0,),
        OF.softmax,
        lambda x: F.softmax(x, -1),
        autocast="none"),
    "log_softmax": training.Case(
        ("log_softmax",),
        lambda dt, big: [training.randn(700 if big else 6, 9, 33, dtype=dt)],
        (0,),
        OF.log_softmax,
        lambda x: F.log_softmax(x, -1),
        autocast="none"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


SWEEP_SHAPES = [((), 0), ((0,), 0), ((1,), 0), ((17,), -1), ((5, 0), -1), ((5, 0), 0), ((0, 5), -1), ((0, 5), 0),
           ((3, 7), -1), ((3, 7), 0), ((2, 3, 5), 1), ((2, 0, 3), 2), ((1, 1, 1), 1), ("t", 0), ((64, 520), -1),
           ((520, 64), 0)]


def _sweep_cases():
    cases = []
    for log in (False, True):
        op, ref = (opforge.log_softmax, F.log_softmax) if log else (opforge.softmax, F.softmax)
        for shape, dim in SWEEP_SHAPES:
            def make(dt, shape=shape, dim=dim):
                x = thread_sweep.randn((7, 5), 4).t() if shape == "t" else thread_sweep.randn(shape, 4)
                return ((x * 2).to(dt), dim)
            cases.append(thread_sweep.Case(f"{op.__name__} {shape} dim={dim}", make, lambda x, d, op=op: (op(x, d),),
                                           lambda x, d, ref=ref: (ref(x, d),), grads=(0,)))
    return cases


SWEEP = dict.fromkeys(("softmax", "log_softmax"), _sweep_cases)
