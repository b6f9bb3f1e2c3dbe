"""linear (+ bias + activation) and matmul against PyTorch: values, strides,
gradients, gradcheck, opcheck, torch.compile, autocast, nn.Linear, bad input."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import references as refs

LINEAR = torch.ops.opforge.linear.default
MATMUL = torch.ops.opforge.matmul.default
ACTS = {
    "none": lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}
# float32 sums of K products: error grows like sqrt(K) ulps; K <= 301 here. 16-bit
# types accumulate in float32 and round once: half an ulp of the type, relative.
TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=8e-3, atol=2e-2),
    torch.float16: dict(rtol=1e-3, atol=4e-3),
}


def reference(x, w, b, act):
    return ACTS[act](F.linear(x.double(), w.double(), None if b is None else b.double()))


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 5), (123, 77, 301), (2, 3, 17, 9)], ids=str)
def test_values(shape, act, dtype):
    *lead, k, n = shape
    x, w, b = torch.randn(*lead, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    for bias in (b, None):
        y = opforge.linear(x, w, bias, act)
        assert y.shape == (*lead, n) and y.dtype == dtype
        torch.testing.assert_close(y.double(), reference(x, w, bias, act), **TOL[dtype])


@pytest.mark.parametrize(
    "view",
    ["transposed-x", "batched-x-transposed", "transposed-weight", "sliced-rows", "strided-bias", "broadcast-x"],
)
def test_strided_operands_read_in_place(view):
    x, w, b = torch.randn(6, 5, 16), torch.randn(12, 16), torch.randn(12)
    if view == "transposed-x":
        x = torch.randn(16, 30).t()
    elif view == "batched-x-transposed":
        x = torch.randn(5, 6, 16).transpose(0, 1)  # leading dims that do not merge
    elif view == "transposed-weight":
        w = torch.randn(16, 12).t()
    elif view == "sliced-rows":
        x = torch.randn(6, 9, 16)[:, ::2]
    elif view == "strided-bias":
        b = torch.randn(24)[::2]
    elif view == "broadcast-x":
        x = torch.randn(1, 16).expand(7, 16)
    torch.testing.assert_close(opforge.linear(x, w, b, "gelu").double(), reference(x, w, b, "gelu"), **TOL[torch.float32])


GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=8e-2),
            torch.float16: dict(rtol=4e-3, atol=1e-2)}


@pytest.mark.parametrize("dtype", list(GRAD_TOL))
@pytest.mark.parametrize("act", list(ACTS))
def test_gradients_match_autograd(act, dtype):
    x = torch.randn(4, 9, 33).to(dtype).requires_grad_()
    w = (torch.randn(20, 33) / 4).to(dtype).requires_grad_()
    b = torch.randn(20).to(dtype).requires_grad_()
    g = torch.randn(4, 9, 20).to(dtype)
    opforge.linear(x, w, b, act).backward(g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    reference(xr, wr, br, act).backward(g.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_backward_over_several_gemm_slices(dtype):
    # rows and out_features beyond one GEMM slice of K (2048 bfloat16 pairs, 1024 otherwise): dx and
    # dweight keep float32 partial sums in row chunks before rounding once
    x = torch.randn(2100, 8).to(dtype).requires_grad_()
    w = (torch.randn(2080, 8) / 3).to(dtype).requires_grad_()
    b = torch.randn(2080).to(dtype).requires_grad_()
    g = (torch.randn(2100, 2080) / 8).to(dtype)
    assert _backward_ops(lambda: opforge.linear(x, w, b, "gelu").backward(g)) == {"opforge::linear_backward_"}
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    reference(xr, wr, br, "gelu").backward(g.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def _backward_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("opforge::linear_backward")}


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_backward_overwrites_the_saved_preact_only_when_no_one_else_sees_it(act):
    x = torch.randn(2, 37, 33, requires_grad=True)
    w = (torch.randn(20, 33) / 4).requires_grad_()
    b = torch.randn(20, requires_grad=True)
    g = torch.randn(2, 37, 20)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    reference(xr, wr, br, act).backward(g.double())

    def take_grads():
        got = (x.grad, w.grad, b.grad)
        x.grad = w.grad = b.grad = None
        for t, want in zip(got, (xr.grad, wr.grad, br.grad)):
            torch.testing.assert_close(t.double(), want, **GRAD_TOL[torch.float32])
        return got

    # the API keeps preact for the backward alone: the backward reuses it as its scratch
    assert _backward_ops(lambda: opforge.linear(x, w, b, act).backward(g)) == {"opforge::linear_backward_"}
    take_grads()
    # a retained graph runs its backward twice: preact must survive the first
    y = opforge.linear(x, w, b, act)
    assert _backward_ops(lambda: y.backward(g, retain_graph=True)) == {"opforge::linear_backward"}
    first = take_grads()
    y.backward(g)
    for a, c in zip(first, take_grads()):
        assert torch.equal(a, c)
    # the caller holds preact (the raw op returns it), or a view of it: left as it was
    out, pre = LINEAR(x, w, b, act)
    kept = pre.clone()
    assert _backward_ops(lambda: out.backward(g)) == {"opforge::linear_backward"}
    assert torch.equal(pre, kept)
    take_grads()
    out, pre = LINEAR(x, w, b, act)
    view = pre[1]
    kept = view.clone()
    del pre
    out.backward(g)
    assert torch.equal(view, kept)
    take_grads()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_inference_keeps_no_preact(dtype):
    x, w, b = (torch.randn(*s, dtype=dtype) for s in ((5, 7, 33), (20, 33), (20,)))
    out, pre = LINEAR(x, w, b, "gelu", False)
    assert pre.numel() == 0
    torch.testing.assert_close(out.double(), reference(x, w, b, "gelu"), **TOL[dtype])
    kept_out, kept_pre = LINEAR(x, w, b, "gelu")
    assert torch.equal(out, kept_out) and kept_pre.shape == out.shape
    with torch.no_grad():
        torch.testing.assert_close(opforge.linear(x, w.requires_grad_(), b, "gelu"), out)
    opcheck(LINEAR, (x, w.detach(), b, "gelu", False))
    # a backward given no pre-activation recomputes it (16-bit: rounded as the forward stores it): the same
    # gradients, bit for bit
    g = torch.randn_like(out)
    for got, want in zip(torch.ops.opforge.linear_backward(g, x, w.detach(), b, pre, "gelu"),
                         torch.ops.opforge.linear_backward(g, x, w.detach(), b, kept_pre, "gelu")):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"opforge::linear_backward.*'preact'"):
        torch.ops.opforge.linear_backward(g, x, w.detach(), b, kept_pre[:2], "gelu")


@pytest.mark.parametrize("dtype", list(GRAD_TOL))
@pytest.mark.parametrize("act", list(ACTS))
def test_recompute_keeps_no_preact_and_gives_the_same_gradients(act, dtype):
    # rows beyond the backward's chunk (2^21 / out_features = 2048 rows) and a strided x
    x = torch.randn(2100, 24).to(dtype)[:, 1:].requires_grad_()
    w = (torch.randn(1024, 23) / 4).to(dtype).requires_grad_()
    b = torch.randn(1024).to(dtype).requires_grad_()
    g = torch.randn(2100, 1024).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = opforge.linear(x, w, b, act, recompute=True)
    assert saved and y.shape not in saved  # x, weight, bias and an empty preact
    y.backward(g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    reference(xr, wr, br, act).backward(g.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=GRAD_TOL[dtype]["rtol"],
                                   atol=GRAD_TOL[dtype]["atol"] * max(1.0, want.abs().max().item() / 10))
    mod = opforge.nn.Linear(23, 1024, activation=act, recompute=True)
    assert "recompute=True" in repr(mod)


@pytest.mark.parametrize("act", list(ACTS))
def test_gradcheck_float64(act):
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: opforge.linear(*t, act), (x, w, b))
    assert torch.autograd.gradcheck(lambda *t: opforge.linear(*t, None, act), (x, w))


@pytest.mark.parametrize("act", ["none", "gelu"])
@pytest.mark.parametrize("wanted", ["x", "weight", "bias", "x,bias"])
def test_only_the_wanted_gradients_are_made(act, wanted):
    # a frozen weight (fine-tuning) or an input that needs no gradient: the backward is told which
    # gradients are wanted and skips the GEMM of the others; those it returns are the full ones
    x, w, b = torch.randn(2, 9, 33), torch.randn(20, 33) / 4, torch.randn(20)
    g = torch.randn(2, 9, 20)
    full = [t.clone().requires_grad_() for t in (x, w, b)]
    opforge.linear(*full, act).backward(g)
    part = [t.clone().requires_grad_(name in wanted.split(",")) for name, t in zip(("x", "weight", "bias"), (x, w, b))]
    opforge.linear(*part, act).backward(g)
    for got, want in zip(part, full):
        if got.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
        else:
            assert got.grad is None


def test_backward_ops_take_which_gradients_are_wanted():
    x, w, g = torch.randn(7, 13), torch.randn(5, 13), torch.randn(7, 5)
    dx, dw, _ = torch.ops.opforge.linear_backward(g, x, w, None, x.new_empty(0), "none")  # needs: all by default
    torch.testing.assert_close(dx, g @ w), torch.testing.assert_close(dw, g.t() @ x)
    assert torch.equal(torch.ops.opforge.linear_backward(g, x, w, None, x.new_empty(0), "none", 1)[0], dx)
    assert torch.equal(torch.ops.opforge.linear_backward(g, x, w, None, x.new_empty(0), "none", 2)[1], dw)
    a, b, gm = torch.randn(6, 13), torch.randn(13, 4), torch.randn(6, 4)
    da, db = torch.ops.opforge.matmul_backward(gm, a, b)
    assert torch.equal(torch.ops.opforge.matmul_backward(gm, a, b, 1)[0], da)
    assert torch.equal(torch.ops.opforge.matmul_backward(gm, a, b, 2)[1], db)
    a1, b1 = a.clone().requires_grad_(), b.clone()  # a frozen right operand
    opforge.matmul(a1, b1).backward(gm)
    assert b1.grad is None and torch.equal(a1.grad, da)


def test_no_bias_gets_no_gradient_slot():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    opforge.linear(x, w, None, "relu").sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(3, 5, 7), torch.randn(4, 7), torch.randn(4), "gelu"),
        (torch.randn(3, 7), torch.randn(4, 7), None, "none"),
        (torch.randn(5, 3, 7).transpose(0, 1), torch.randn(7, 4).t(), torch.randn(8)[::2], "silu"),
        (torch.randn(7), torch.randn(4, 7), torch.randn(4), "relu"),
        (torch.randn(3, 7).bfloat16(), torch.randn(4, 7).bfloat16(), torch.randn(4).bfloat16(), "gelu_tanh"),
    ],
    ids=["3d-gelu", "no-bias", "strided-silu", "1d-relu", "bf16-gelu_tanh"],
)
def test_opcheck_linear(args):
    opcheck(LINEAR, args)
    grads = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    opcheck(LINEAR, grads)


def test_opcheck_matmul():
    opcheck(MATMUL, (torch.randn(3, 7), torch.randn(7, 4)))
    opcheck(MATMUL, (torch.randn(2, 3, 7), torch.randn(2, 4, 7).transpose(1, 2)))


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 5), (123, 77, 301), (1, 300, 500), (300, 1, 500)], ids=str)
def test_matmul_values(shape):
    m, n, k = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.testing.assert_close(opforge.matmul(a, b), a @ b, **TOL[torch.float32])
    torch.testing.assert_close(opforge.matmul(b.t(), a.t()), b.t() @ a.t(), **TOL[torch.float32])
    for dt in (torch.bfloat16, torch.float16):
        got = opforge.matmul(a.to(dt), b.to(dt))
        assert got.dtype == dt
        torch.testing.assert_close(got.double(), a.to(dt).double() @ b.to(dt).double(), **TOL[dt])
    ab, bb = torch.randn(3, m, k), torch.randn(3, k, n)
    torch.testing.assert_close(opforge.matmul(ab, bb), ab @ bb, **TOL[torch.float32])


def test_every_isa_agrees():
    x, w, b = torch.randn(37, 300), torch.randn(45, 300), torch.randn(45)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = opforge.linear(x, w, b, "gelu")
    finally:
        opforge.set_isa("auto")
    for isa, y in outs.items():
        torch.testing.assert_close(y, outs["ref"], **TOL[torch.float32], msg=f"{isa} vs ref")


# Pre-activations at the edges of exp's range: infinities, magnitudes whose square overflows float32, exponents
# far below the smallest float, NaN.
SPECIAL = [float("inf"), float("-inf"), -1e30, -1e25, 1e30, 1e25, -100.0, 100.0, -20.0, 20.0, -2.0, 0.5, float("nan")]


def torch_one_at_a_time(fn, x):
    """fn and its derivative in float32, element by element: the single-element path of torch's kernels (its
    vectorized float32 erf makes gelu(inf) NaN, its scalar one and float64 give inf)."""
    values, grads = [], []
    for v in x.reshape(-1):
        v = v.reshape(1).clone().requires_grad_()
        y = fn(v)
        y.backward(torch.ones_like(y))
        values.append(y.detach()), grads.append(v.grad)
    return torch.cat(values).reshape(x.shape), torch.cat(grads).reshape(x.shape)


@pytest.mark.parametrize("act", [a for a in ACTS if a != "none"])
def test_activation_at_infinite_and_huge_preactivations_on_every_isa(act):
    # the vector exp clamped its argument: gelu' at [inf, -inf, -1e30, -1e25] was [inf, -inf, -4.86e-9, -4.86e-14]
    # where torch (and the reference) give [nan, nan, 0, 0]; relu' at NaN passes the gradient, as torch's
    x, w = torch.tensor(SPECIAL).reshape(-1, 1), torch.ones(1, 1)
    want, want_grad = torch_one_at_a_time(ACTS[act], x)
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            xl = x.clone().requires_grad_()
            y = opforge.linear(xl, w, None, act)
            y.backward(torch.ones_like(y))
            for what, got, ref in (("forward", y.detach(), want), ("derivative", xl.grad, want_grad)):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=0, equal_nan=True,
                                           msg=lambda m: f"{isa} {act} {what} at {SPECIAL}: {got.flatten().tolist()}\n{m}")
    finally:
        opforge.set_isa("auto")


# The GEMM table whose micro-kernel multiplies each dtype at each ISA, and that table's ISA: float32 and float16
# never run a pair kernel (AVX512-BF16, AMX), so those ISAs hand them to the AVX-512 kernel; float64 runs the
# double-precision reference.
GEMM_RAN = {"ref": "ref_4x4", "avx2": "avx2_6x16", "avx512": "avx512_12x32", "avx512_bf16": "avx512_12x32",
            "amx": "avx512_12x32"}
GEMM_RAN_BF16 = dict(GEMM_RAN, avx512_bf16="avx512bf16_12x32", amx="amx_32x32")
GEMM_ISA = {"ref_4x4": "ref", "avx2_6x16": "avx2", "avx512_12x32": "avx512", "avx512bf16_12x32": "avx512_bf16",
            "amx_32x32": "amx", "ref_f64": "ref"}


def test_matmul_log_names_the_kernel_that_ran():
    # the log named the table picked for the ISA (avx512bf16_12x32, amx_32x32) for every dtype, while float32 and
    # float16 ran the AVX-512 kernel and float64 the reference
    dtypes = ["float32", "bfloat16", "float16", "float64"]
    code = ("import torch, opforge\n"
            "a, b = torch.randn(20, 30), torch.randn(30, 40)\n"
            "for isa in opforge.supported_isas():\n"
            "    opforge.set_isa(isa)\n"
            f"    for dt in {dtypes}:\n"
            "        opforge.matmul(a.to(getattr(torch, dt)), b.to(getattr(torch, dt)))\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, OPFORGE_LOG_LEVEL="info"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if re.search(r"::matmul \w+\[", line)]
    calls = [(isa, dt) for isa in opforge.supported_isas() for dt in dtypes]
    assert len(lines) == len(calls), r.stderr
    wrong = []
    for (isa, dt), line in zip(calls, lines):
        name = "ref_f64" if dt == "float64" else (GEMM_RAN_BF16 if dt == "bfloat16" else GEMM_RAN)[isa]
        if f"isa={GEMM_ISA[name]} kernels=gemm:{name} " not in line:
            wrong.append(f"{isa} {dt}: want gemm:{name}, got {line}")
    assert not wrong, "\n".join(wrong)


def test_compile_fullgraph_forward_and_backward():
    w = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(24, requires_grad=True)

    def block(t):
        return opforge.linear(t, w, b, "gelu").sum(-1)

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(5, 16, requires_grad=True)
    compiled(x).sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ACTS["gelu"](F.linear(xr, wr, br)).sum(-1).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_the_autocast_dtype(dtype):
    x, w, b = torch.randn(8, 16), torch.randn(4, 16, requires_grad=True), torch.randn(4, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = opforge.linear(x, w, b, "relu")  # as torch's autocast does for F.linear
        z = opforge.matmul(x, w.detach().t())
    assert y.dtype == dtype and z.dtype == dtype
    torch.testing.assert_close(y.double(), reference(x.to(dtype), w.to(dtype), b.to(dtype), "relu"), **TOL[dtype])
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32  # the cast is in the graph: master weights get float32 grads


def test_nn_linear_is_a_drop_in():
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    mod = opforge.nn.Linear(16, 8, activation="silu")
    mod.load_state_dict(ref.state_dict())
    assert set(mod.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 16)
    torch.testing.assert_close(mod(x), F.silu(ref(x)), **TOL[torch.float32])
    assert "activation='silu'" in repr(mod)
    with pytest.raises(RuntimeError, match=r"argument 'activation' must be one of .* got 'tanh'"):
        opforge.nn.Linear(4, 4, activation="tanh")


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 6)), r"\[opforge::linear\] the last dim of argument 'x' \(5\) must equal the columns of argument 'weight' .* \(4, 6\)"),
        (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 5, 1)), r"argument 'weight' must be 2-d .* got 3-d"),
        (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 5, dtype=torch.float64)), r"argument 'weight' must have the dtype of 'x' \(float32\), got float64"),
        (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 5), torch.randn(3)), r"argument 'bias' must have the shape of 'out_features' \[4\], got \[3\]"),
        (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 5), None, "swish"), r"argument 'activation' must be one of"),
        (lambda: LINEAR(torch.randn(3, 5), torch.randn(4, 5), None, "swish"),
         r"\[opforge::linear\] argument 'activation' must be one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu', got 'swish'"),
        (lambda: opforge.linear(torch.ones(3, 5, dtype=torch.int64), torch.ones(4, 5, dtype=torch.int64)), r"argument 'x' must be a floating-point tensor"),
        (lambda: opforge.linear(torch.randn(3, 5).bfloat16(), torch.randn(4, 5)), r"argument 'weight' must have the dtype of 'x' \(bfloat16\), got float32"),
        (lambda: opforge.matmul(torch.randn(3, 5), torch.randn(6, 2)), r"\[opforge::matmul\] argument 'b' must have 5 rows .* got 6"),
        (lambda: opforge.matmul(torch.randn(3, 5), torch.randn(2, 5, 2)), r"must both be 2-d .* got 2-d and 3-d"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


# ---- reproducers of defects an adversarial probe found -----------------------------------------

def _isas_threads():
    return [(isa, t) for isa in opforge.supported_isas() for t in (1, 2)]


@pytest.fixture
def isa_threads(request):
    isa, threads = request.param
    saved = torch.get_num_threads()
    opforge.set_isa(isa)
    torch.set_num_threads(threads)
    yield isa, threads
    opforge.set_isa("auto")
    torch.set_num_threads(saved)


@pytest.mark.parametrize("isa_threads", _isas_threads(), indirect=True, ids=str)
@pytest.mark.parametrize("mode", ["none", "recompute", "retain_graph"])
@pytest.mark.parametrize("shape", [(200, 256, 256), (112, 100, 129), (160, 256, 256), (240, 300, 300), (230, 250, 250)],
                         ids=str)
def test_chunked_backward_sizes_the_workspace_for_the_last_chunk(shape, mode, isa_threads):
    # The chunked backward sized its GEMM workspace for the full row chunk, but a shorter last chunk packs the
    # whole of A where the full one packs a block per worker and needs more: heap corruption at these shapes.
    m, k, n = shape
    x, w, b = torch.randn(m, k, requires_grad=True), (torch.randn(n, k) / 8).requires_grad_(), torch.randn(n, requires_grad=True)
    act = "none" if mode == "none" else "gelu"
    y = opforge.linear(x, w, b, act, recompute=mode == "recompute")
    g = torch.randn_like(y)
    y.backward(g, retain_graph=mode == "retain_graph")
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    reference(xr, wr, br, act).backward(g.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_multihead_attention_on_200_tokens():
    mha = opforge.nn.MultiheadAttention(256, 8)
    x = torch.randn(1, 200, 256, requires_grad=True)
    out = mha(x, x, x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_bfloat16_backward_of_a_strided_batch():
    x = torch.randn(100, 1, 129).bfloat16().requires_grad_()
    w = (torch.randn(300, 129) / 8).bfloat16().requires_grad_()
    g = torch.randn(100, 1, 300).bfloat16()
    opforge.linear(x, w, None, "none").backward(g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference(xr, wr, None, "none").backward(g.double())
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=2e-2, atol=2e-2 * xr.grad.abs().max().item())


@pytest.mark.parametrize("dtype, m, kd, threads", [(torch.float16, 752, 1100, 2), (torch.bfloat16, 752, 2100, 2),
                                                   (torch.float16, 720, 1100, 2), (torch.float16, 740, 1100, 1),
                                                   (torch.bfloat16, 1264, 2100, 1)])
def test_16bit_matmul_last_row_chunk(dtype, m, kd, threads):
    # 16-bit results over several K slices are made in row chunks of float32 partial sums; the last, shorter
    # chunk needed more workspace than the full one it was sized for: garbage and NaNs in its rows.
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, kd).to(dtype), torch.randn(kd, 4096).to(dtype)
        got = opforge.matmul(a, b)
    finally:
        torch.set_num_threads(saved)
    want = a.double() @ b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2 * kd ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 17])
def test_few_tokens_on_every_isa_and_thread_count(tokens, dtype):
    """Decoding's products (up to 16 rows, the weight read along K as nn.Linear stores it: the GEMM's skinny
    path, dot products streamed from the weight's rows; 17 rows: the blocked kernels) against float64 on every
    ISA, with bias and activation, 16-bit results included, and the same bits at 1, 2 and 3 threads."""
    k, n = 300, 133  # K past several vectors with a tail, N not a multiple of the kernels' column blocks
    x, w, b = torch.randn(tokens, k).to(dtype), (torch.randn(n, k) / 8).to(dtype), torch.randn(n).to(dtype)
    saved, mode = torch.get_num_threads(), opforge.get_gemm()
    try:
        opforge.set_gemm("own")
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            for act in ("none", "gelu"):
                outs = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    with torch.no_grad():
                        outs.append(opforge.linear(x, w, b, act))
                torch.testing.assert_close(outs[0].double(), reference(x, w, b, act), **TOL[dtype],
                                           msg=f"{isa} {act}")
                assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"{isa} {act}: bits change with the threads"
    finally:
        opforge.set_isa("auto"), opforge.set_gemm(mode), torch.set_num_threads(saved)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_gradients_do_not_depend_on_the_thread_count(act):
    # the activation's derivative ran a scalar libm path at the end of each thread's column range, so the
    # float32 gradients changed with the thread count
    x = torch.randn(300, 200, requires_grad=True)
    w = (torch.randn(1000, 200) / 8).requires_grad_()
    b = torch.randn(1000, requires_grad=True)
    g = torch.randn(300, 1000)
    saved, grads = torch.get_num_threads(), {}
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            for t in (x, w, b):
                t.grad = None
            opforge.linear(x, w, b, act).backward(g)
            grads.setdefault(threads, []).append([t.grad.clone() for t in (x, w, b)])
    finally:
        torch.set_num_threads(saved)
    runs = grads[1] + grads[2]
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", list(GRAD_TOL) + [torch.float64])
@pytest.mark.parametrize("batched", [False, True])
def test_matmul_gradients(dtype, batched):
    # matmul had no backward: its output required grad and a.grad stayed None
    lead = (3,) if batched else ()
    a = torch.randn(*lead, 37, 45).to(dtype).requires_grad_()
    b = torch.randn(*lead, 29, 45).to(dtype).transpose(-1, -2).requires_grad_()  # read transposed, in place
    g = torch.randn(*lead, 37, 29).to(dtype)
    opforge.matmul(a, b).backward(g)
    ar, br = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (ar @ br).backward(g.double())
    tol = GRAD_TOL.get(dtype, TOL[torch.float64])
    for got, want in ((a.grad, ar.grad), (b.grad, br.grad)):
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **tol)


def test_matmul_gradcheck_and_opcheck():
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(opforge.matmul, (a, b))
    opcheck(MATMUL, (torch.randn(2, 3, 7, requires_grad=True), torch.randn(2, 4, 7).transpose(1, 2).requires_grad_()))


def test_float64_bias_of_any_stride():
    # a float64 bias with a non-unit stride (even a size-1 one, which torch counts as contiguous) was refused
    x, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    for b in (torch.randn(12, dtype=torch.float64)[::2], torch.randn(1, 6, dtype=torch.float64).t()[:, 0]):
        torch.testing.assert_close(opforge.linear(x, w, b, "gelu"), reference(x, w, b, "gelu"), **TOL[torch.float64])
    one = torch.randn(3, dtype=torch.float64)[::3]
    w1 = torch.randn(1, 8, dtype=torch.float64)
    torch.testing.assert_close(opforge.linear(x, w1, one), reference(x, w1, one, "none"), **TOL[torch.float64])


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda m: MATMUL(torch.empty(2, 3, device=m), torch.empty(5, 4, device=m)), r"argument 'b' must have 3 rows"),
        (lambda m: MATMUL(torch.empty(2, 3, device=m, dtype=torch.int32), torch.empty(3, 4, device=m, dtype=torch.int32)),
         r"argument 'a' must be a floating-point tensor"),
        (lambda m: LINEAR(torch.empty(3, 5, device=m), torch.empty(4, 6, device=m), None, "none"), r"'x' \(5\) must equal the columns of argument 'weight'"),
        (lambda m: LINEAR(torch.empty(3, 5, device=m), torch.empty(4, 5, device=m), torch.empty(3, device=m), "none"),
         r"argument 'bias' must have the shape of 'out_features' \[4\], got \[3\]"),
        (lambda m: LINEAR(torch.empty(3, 5), torch.empty(4, 5), torch.empty(4, device=m), "none"),
         r"argument 'bias' must be on the device of 'x' \(cpu\), got meta"),
        (lambda m: MATMUL(torch.empty(3, 5), torch.empty(5, 2, device=m)), r"argument 'b' must be on the device of 'a'"),
    ],
)
def test_meta_and_fake_calls_check_what_the_kernel_checks(call, pattern):
    # fake / meta calls returned plausible shapes for inputs the kernel refuses, and a cpu tensor of
    # uninitialised memory for mixed meta and cpu inputs
    with pytest.raises(RuntimeError, match=pattern):
        call("meta")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match=pattern):
        call("meta")


def test_export_refuses_what_eager_refuses():
    class MM(torch.nn.Module):
        def forward(self, a, b):
            return opforge.matmul(a, b)

    with pytest.raises(RuntimeError, match=r"\[opforge::matmul\] argument 'b' must have 3 rows"):
        torch.export.export(MM(), (torch.randn(2, 3), torch.randn(5, 4)))
    ep = torch.export.export(MM(), (torch.randn(2, 3), torch.randn(3, 4)))
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(ep.module()(a, b), a @ b, **TOL[torch.float32])


def test_fake_outputs_have_the_kernels_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(4, 6, 5).transpose(0, 1), torch.randn(3, 5)
    real = LINEAR(x, w, None, "gelu", True)
    with FakeTensorMode() as mode:
        fake = LINEAR(mode.from_tensor(x), mode.from_tensor(w), None, "gelu", True)
    for r, f in zip(real, fake):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


# ---- what the generic tests run of matmul and linear (tests/python/discover.py) ---------------------------

# fuzz.py: random shapes near where the plans change (csrc/kernels/gemm*.c, csrc/torch/linear.c), layouts,
# activations and backward paths, dtypes, ISAs and threads, against float64 torch

# GEMM: register blocks MR x NR (ref 4x4, AVX2 6x16, AVX-512 12x32, AMX 32x32), row blocks MC (64, 120,
# 128; split into a multiple of the threads, and packed per worker from two blocks a thread), K slices
# KC (256, 384, 1024; 2048 bfloat16 pairs), column panels NC (1024, 3072)
GEMM_MARKS = (4, 6, 12, 16, 32, 48, 64, 96, 120, 128, 240, 256, 360, 384, 480, 512, 768, 1024, 1152, 1536, 2048, 3072)
# linear and 16-bit GEMMs over several K slices work in row chunks of ~8 MiB of float32: 2**21 / N rows, >= 64
CHUNK_FLOATS = 1 << 21
K_SLICES = (256, 384, 1024, 2048)
# bounds on |act'| and |act''| (gelu' <= 1.13, silu' <= 1.1; gelu'' <= 0.8, silu'' <= 0.5)
ACT_L1, ACT_L2 = 1.25, 1.0


def _chunk_rows(n: int) -> int:
    return max(64, CHUNK_FLOATS // n) if n > 0 else 1


def _gemm_dims(rng, hi: int, wide: int, big: bool) -> tuple[int, int, int]:
    """(rows, columns, depth) of a product. Some (most of the big cases) are one or two row chunks of
    linear's backward and the 16-bit GEMMs (2**21 / n rows) and a last chunk of any size, with a depth
    just over a K slice: the last chunk's plan differs from the others', and a 16-bit result keeps
    float32 partial sums over the slices."""
    if rng.random() < (0.75 if big else 0.1):
        n = fuzz.log_uniform(rng, CHUNK_FLOATS // (2 * hi), wide) if rng.random() < 0.5 else \
            fuzz.near(rng, rng.choice([m for m in GEMM_MARKS if CHUNK_FLOATS // (2 * hi) <= m <= wide]))
        chunk = _chunk_rows(n)
        last = rng.randint(-2, 2) if rng.random() < 0.3 else max(fuzz.dim(rng, chunk - 1, GEMM_MARKS, zero=0.0), 1)
        m = max(1, chunk * rng.choice((1, 1, 2)) + last)
        k = rng.choice(K_SLICES) + rng.randint(1, 48) if rng.random() < 0.8 else fuzz.dim(rng, 2200, GEMM_MARKS)
        return m, n, k
    return fuzz.dim(rng, hi, GEMM_MARKS), fuzz.dim(rng, wide if rng.random() < 0.1 else hi, GEMM_MARKS), fuzz.dim(rng, 2200, GEMM_MARKS)


def _fuzz_draw_matmul(rng, c):
    c["batch"] = rng.choice((0, 0, 1, 2, rng.randint(1, 6)))  # 0: 2-d
    hi = 1536
    m, n, k = _gemm_dims(rng, hi, 8192, c["big"])
    c["m"], c["k"], c["n"] = m, k, n
    lead = [c["batch"]] if c["batch"] else []
    c["a_layout"] = fuzz.layout(rng, lead + [m, k])
    c["b_layout"] = fuzz.layout(rng, lead + [k, n])
    b = max(c["batch"], 1)
    flops = 2.0 * b * m * n * k
    return fuzz.seconds(c, flops, 2 * flops, b * (10 * m * n + 3 * m * k + 3 * k * n))


def _fuzz_draw_linear(rng, c):
    c["act"] = rng.choice(list(ACTS))
    c["bias"] = rng.random() < 0.7
    c["mode"] = rng.choice(("inference", "raw", "backward", "backward", "retain"))
    c["recompute"] = rng.random() < 0.4
    if c["mode"] in ("backward", "retain"):
        c["grads"] = rng.choice(("xwb", "xwb", "x", "wb", "w"))
    hi = 1536
    rows, n, k = _gemm_dims(rng, hi, 4096, c["big"])
    nlead = rng.choices((0, 1, 2, 3), (0.05, 0.6, 0.25, 0.1))[0]
    lead = [rng.choice((1, 2, 3, rng.randint(1, 9))) for _ in range(max(nlead - 1, 0))] + [rows] * (nlead > 0)
    c["x_shape"], c["n"] = lead + [k], n
    c["x_layout"] = fuzz.layout(rng, c["x_shape"])
    c["w_layout"] = fuzz.layout(rng, [n, k])
    # float64 takes a contiguous bias only (a documented limit)
    c["b_layout"] = fuzz.layout(rng, [n]) if c["bias"] and c["dtype"] != "float64" else None
    c["w_scale"] = rng.choice((1.0, 1.0 / math.sqrt(max(k, 1))))
    m = math.prod(lead)
    bwd = c["mode"] in ("backward", "retain")
    gemms = 1 + bwd * (3 + c["recompute"]) * (1 + (c["mode"] == "retain"))
    flops = 2.0 * m * n * k
    return fuzz.seconds(c, gemms * flops, (6 if bwd else 2) * flops, (40 if bwd else 12) * m * n + 4 * (m + n) * k)


def _fuzz_check_matmul(c, gen, dtype, dt, call):
    lead = [c["batch"]] if c["batch"] else []
    (ab, av), (bb, bv) = fuzz.inputs(gen, [(lead + [c["m"], c["k"]], dtype, c["a_layout"], "randn", 1.0),
                                           (lead + [c["k"], c["n"]], dtype, c["b_layout"], "randn", 1.0)])
    a, b = av(ab), bv(bb)
    out = call(lambda: opforge.matmul(a, b))
    a64, b64 = a.double(), b.double()
    want = a64 @ b64
    bound = fuzz.sum_err(fuzz.U_ACC[dt], c["k"], a64.abs() @ b64.abs(), want) + fuzz.out_tol(want, dt)
    return [fuzz.Check("out", out, want, bound, dtype)]


def _act_grad(act: str, pre: torch.Tensor) -> torch.Tensor:
    p = pre.detach().clone().requires_grad_()
    ACTS[act](p).backward(torch.ones_like(p))
    return p.grad if p.grad is not None else torch.ones_like(p)


def _fuzz_check_linear(c, gen, dtype, dt, call):
    k, n, act = c["x_shape"][-1], c["n"], c["act"]
    grads = c.get("grads", "")
    specs = [(c["x_shape"], dtype, c["x_layout"], "randn", 1.0), ([n, k], dtype, c["w_layout"], "randn", c["w_scale"])]
    if c["bias"]:
        specs.append(([n], dtype, c["b_layout"], "randn", 1.0))
    inputs = fuzz.inputs(gen, specs)
    for (base, _), name in zip(inputs, "xwb"):
        base.requires_grad_(name in grads)
    x, w, b = [view(base) for base, view in inputs] + [None] * (3 - len(inputs))
    out_shape = list(c["x_shape"][:-1]) + [n]
    g = fuzz.random_tensor(gen, out_shape, dtype)
    u = fuzz.U_ACC[dt]
    r_pre, r_gp = fuzz.rounding(c, "preact"), fuzz.rounding(c, "g'")

    # references in float64 over the rows (M, K)
    m = math.prod(c["x_shape"][:-1])
    x64, w64 = x.detach().double().reshape(m, k), w.detach().double()
    b64 = b.detach().double() if b is not None else torch.zeros(n, dtype=torch.float64)
    pre = x64 @ w64.T + b64
    pre_err = fuzz.sum_err(u, k + 1, x64.abs() @ w64.abs().T + b64.abs(), pre)
    out_want = ACTS[act](pre)
    fn_err = 0.0 if act in ("none", "relu") else fuzz.C_FN * u
    out_bound = (ACT_L1 if act != "none" else 1.0) * pre_err + fn_err * pre.abs() + fuzz.out_tol(out_want, dt)
    checks = []
    shape_out = lambda t: t.reshape(out_shape)  # noqa: E731

    if c["mode"] == "inference":
        with torch.no_grad():
            out = call(lambda: opforge.linear(x, w, b, act, recompute=c["recompute"]))
        return [fuzz.Check("out", out, shape_out(out_want), shape_out(out_bound), dtype)]
    if c["mode"] == "raw":
        save = c["recompute"]  # reused as save_preact
        with torch.no_grad():
            out, pre_got = call(lambda: torch.ops.opforge.linear(x, w, b, act, save))
        checks.append(fuzz.Check("out", out, shape_out(out_want), shape_out(out_bound), dtype))
        if act != "none" and save:
            checks.append(fuzz.Check("preact", pre_got, shape_out(pre), shape_out(pre_err + fuzz.out_tol(pre, dt)), dtype))
        elif pre_got.numel() != 0:
            checks.append(fuzz.Check("preact (empty)", pre_got, torch.zeros(0, dtype=torch.float64),
                                     torch.zeros(0, dtype=torch.float64), dtype))
        return checks

    views = [t for t, name in ((x, "x"), (w, "w"), (b, "b")) if t is not None and name in grads]
    names = [name for t, name in ((x, "x"), (w, "w"), (b, "b")) if t is not None and name in grads]

    def forward_backward():
        y = opforge.linear(x, w, b, act, recompute=c["recompute"])
        first = torch.autograd.grad(y, views, g, retain_graph=c["mode"] == "retain")
        second = torch.autograd.grad(y, views, g) if c["mode"] == "retain" else None
        return y, first, second

    y, first, second = call(forward_backward)
    checks.append(fuzz.Check("out", y, shape_out(out_want), shape_out(out_bound), dtype))
    # g' = g * act'(pre), from a pre-activation off by pre_err (and rounded where it is kept), and
    # rounded itself where the backward rounds it (FUZZ's rounded); without an activation g' is g
    g64 = g.double().reshape(m, n)
    d1 = _act_grad(act, pre)
    gp = g64 * d1
    pre_off = pre_err + r_pre * pre.abs() + (fuzz.A16[dt] if r_pre else 0.0)
    if act == "none":
        gp_err = torch.zeros_like(gp)
    else:
        gp_err = g64.abs() * (ACT_L2 * pre_off + fuzz.C_FN * u) + (u + r_gp) * gp.abs() + (fuzz.A16[dt] if r_gp else 0.0)
        if act == "relu":  # act' jumps at 0: a pre-activation within its error of 0 may go either way
            gp_err = torch.where(pre.abs() <= pre_off, g64.abs(), gp_err)
    # errors carried from g' and made by the sums (over n for dx, over the m rows for dweight and dbias)
    dx, dw, db = gp @ w64, gp.T @ x64, gp.sum(0)
    want = {
        "x": (dx, (gp_err + u * fuzz.c_sum(n) * gp.abs()) @ w64.abs() + u * 0.5 * n * dx.abs()),
        "w": (dw, (gp_err + u * fuzz.c_sum(m) * gp.abs()).T @ x64.abs() + u * 0.5 * m * dw.abs()),
        "b": (db, (gp_err + u * fuzz.c_sum(m) * gp.abs()).sum(0) + u * 0.5 * m * db.abs()),
    }
    for name, got, view in zip(names, first, views):
        ref, err = want[name]
        ref, err = ref.reshape(view.shape), err.reshape(view.shape)
        checks.append(fuzz.Check(f"d{name}", got, ref, err + fuzz.out_tol(ref, dt), dtype))
    # a retained graph's second backward (the first must leave the kept pre-activation as it was); not
    # bit for bit the first: it may take the in-place path, whose 16-bit g' is rounded to 16 bits
    for name, got, view in zip(names, second or (), views):
        ref, err = want[name]
        ref, err = ref.reshape(view.shape), err.reshape(view.shape)
        checks.append(fuzz.Check(f"d{name} (second backward)", got, ref, err + fuzz.out_tol(ref, dt), dtype))
    return checks


def _fuzz_describe_matmul(c):
    lead = f"{c['batch']}," if c["batch"] else ""
    return (f"a=({lead}{c['m']},{c['k']}){fuzz.layout_str(c['a_layout'])} "
            f"b=({lead}{c['k']},{c['n']}){fuzz.layout_str(c['b_layout'])}")


def _fuzz_describe_linear(c):
    x = ",".join(map(str, c["x_shape"]))
    bias = f"({c['n']}){fuzz.layout_str(c['b_layout'])}" if c["bias"] else "None"
    grads = f" grads={c['grads']}" if "grads" in c else ""
    w = f"({c['n']},{c['x_shape'][-1]}){fuzz.layout_str(c['w_layout'])}"
    return (f"x=({x}){fuzz.layout_str(c['x_layout'])} w={w} b={bias} act={c['act']} "
            f"recompute={c['recompute']} mode={c['mode']}{grads}")


# the GEMM ops have the most plans (blocks, threads, slices, chunks, paths of the backward): the most cases
FUZZ = {
    # gemm_run (gemm.c): float32 sums, over K slices too; the pair variants multiply two bfloat16
    # operands as they are
    "matmul": fuzz.Op(_fuzz_draw_matmul, _fuzz_check_matmul, _fuzz_describe_matmul, weight=0.25, order=1,
                      seeded=True, family="gemm", rounded={("*", "*"): ()}),
    # linear (linear.c): the pre-activation as the forward keeps it (saved, or recomputed and rounded
    # as stored: gather_grad_f32); g' = grad act'(preact) rounded on the in-place backward (every
    # variant: bwd_in_place stores it over the donated preact) and, on the chunked one, by the pair
    # variants, which round a float32 operand beside a bfloat16 one (gemm.h gemm_run: dx = g' W,
    # dweight = g'^T x); dbias sums g' as the path holds it
    "linear": fuzz.Op(_fuzz_draw_linear, _fuzz_check_linear, _fuzz_describe_linear, weight=0.45, order=2,
                      seeded=True, family="gemm", rounded={("*", "*"): ("preact", "g'")}),
}


# test_export.py: the ops' parts of the exported model


def _export_linear(g, hidden, vocab, max_len):
    w, b = torch.randn(2 * hidden, hidden, generator=g) / hidden**0.5, 0.1 * torch.randn(2 * hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    return {"w": w, "b": b, "head": head}, lambda x, target, w, b, head: (
        opforge.linear(x, w, b, activation="gelu"), opforge.linear(x, head))


def _export_matmul(g, hidden, vocab, max_len):
    def run(x, target, mix):
        b, n, _ = x.shape
        return (opforge.matmul(x.reshape(b * n, hidden), mix).view(b, n, hidden),)

    return {"mix": torch.randn(hidden, hidden, generator=g) / hidden}, run


EXPORT = {"linear": _export_linear, "matmul": _export_matmul}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "matmul": training.Case(
        ("matmul",),
        lambda dt, big: [training.randn(3, 300 if big else 17, 64, dtype=dt),
                         training.randn(3, 64, 200 if big else 11, dtype=dt)],
        (0, 1),
        opforge.matmul,
        torch.matmul,
        autocast="lower"),
    "linear": training.Case(
        ("linear",),
        lambda dt, big: [training.randn(1200 if big else 4, 9, 24, dtype=dt),
                         training.randn(96 if big else 40, 24, dtype=dt)],
        (0, 1),
        opforge.linear,
        F.linear,
        autocast="lower"),
    "linear_bias_gelu": training.Case(
        ("linear",),
        lambda dt, big: [training.randn(1200 if big else 4, 9, 24, dtype=dt),
                         training.randn(96 if big else 40, 24, dtype=dt), training.randn(96 if big else 40, dtype=dt)],
        (0, 1, 2),
        lambda x, w, b: opforge.linear(x, w, b, "gelu"),
        lambda x, w, b: F.gelu(F.linear(x, w, b)),
        autocast="lower"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads; GEMMs with M, N and K each 0 and 1


# (M, K, N)
# (37, 64, 600) splits over threads; the deep ones run K slices at once at many threads (gemm_plan.ksplit):
# (30, 2085, 40) in its forward, (2085, 30, 40) in the gradient of B (linear's weight): 30 x 40 x 2085
MKN = [(0, 5, 3), (5, 0, 3), (5, 3, 0), (1, 5, 3), (5, 1, 3), (5, 3, 1), (1, 1, 1), (0, 0, 0), (7, 17, 5),
       (2, 3, 2), (17, 7, 3), (37, 64, 600), (30, 2085, 40), (2085, 30, 40)]


def _sweep_matmul():
    cases = []
    for m, k, n in MKN:
        cases.append(thread_sweep.Case(f"matmul M={m} K={k} N={n}",
                                       lambda dt, m=m, k=k, n=n: (thread_sweep.grid((m, k), 1).to(dt),
                                                                  thread_sweep.grid((k, n), 2).to(dt)),
                                       lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    for bt, m, k, n in [(0, 3, 4, 5), (1, 3, 4, 5), (3, 0, 4, 5), (3, 2, 0, 5), (3, 2, 4, 0), (3, 1, 1, 1),
                        (2, 5, 3, 7)]:
        cases.append(thread_sweep.Case(f"matmul B={bt} M={m} K={k} N={n}",
                                       lambda dt, bt=bt, m=m, k=k, n=n: (thread_sweep.grid((bt, m, k), 3).to(dt),
                                                                         thread_sweep.grid((bt, k, n), 4).to(dt)),
                                       lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    cases.append(thread_sweep.Case("matmul transposed a",
                                   lambda dt: (thread_sweep.grid((7, 5), 5).to(dt).t(), thread_sweep.grid((7, 3), 6).to(dt)),
                                   lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    return cases


# (activation, bias, recompute, retain_graph): stored pre-activation donated to the backward (in place),
# kept (retained graph), recomputed, and no activation
LINEAR_VARIANTS = [("gelu", True, False, False), ("silu", False, False, True), ("gelu_tanh", True, True, False),
                   ("none", True, False, False), ("relu", False, False, False)]


def _sweep_linear():
    cases = []
    shapes = [((m,), k, n) for m, k, n in MKN] + [((2, 0), 5, 3), ((2, 3), 17, 7), ((0, 3), 4, 2)]
    for lead, k, n in shapes:
        for act, bias, recompute, retain in LINEAR_VARIANTS:

            def make(dt, lead=lead, k=k, n=n, bias=bias):
                return (thread_sweep.grid((*lead, k), 1).to(dt), thread_sweep.grid((n, k), 2).to(dt),
                        thread_sweep.grid((n,), 3).to(dt) if bias else None)

            cases.append(thread_sweep.Case(
                f"linear x={(*lead, k)} N={n} {act} bias={bias} recompute={recompute} retain={retain}",
                make, lambda x, w, b, a=act, r=recompute: (opforge.linear(x, w, b, a, r),),
                lambda x, w, b, a=act: refs.linear(x, w, b, a), grads=(0, 1, 2) if bias else (0, 1),
                retain_graph=retain))
    return cases


SWEEP = {"matmul": _sweep_matmul, "linear": _sweep_linear}
