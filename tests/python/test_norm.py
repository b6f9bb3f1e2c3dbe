"""rms_norm, add_rms_norm and layer_norm against PyTorch: values per dtype vs
float64 (F.rms_norm / F.layer_norm formulas), strides, gradients incl. weight
and bias, gradcheck, opcheck, torch.compile, autocast, thread-count
determinism, every ISA, the nn modules, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import references as refs

OPS = torch.ops.opforge
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Outputs against the float64 formula on the same (rounded) inputs. float32: sums of up to 4097 squares in
# float32 (a few ulps of rstd) on outputs of size ~1. 16-bit types compute in float32 and round once: half an
# ulp of the type (bfloat16 2**-9, float16 2**-12 relative), with room for the rounding of rstd.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=4e-3, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=2e-3),
}
# Gradients: dx = rstd * (g w - xh * mean(g w xh)) cancels, so the bound is relative to the row's scale
# (atol); 16-bit gradients round once from float32 (dx) or sum float32 partials over rows (dweight).
GRAD_TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=1e-2, atol=3e-2),
    torch.float16: dict(rtol=2e-3, atol=5e-3),
}
SHAPES = [(1, 1), (5,), (3, 7), (2, 3, 17), (37, 123), (3, 4097)]


def close(got, want64, dtype, tol=TOL, what=""):
    assert got.dtype == dtype, what
    torch.testing.assert_close(got.double(), want64, **tol[dtype], msg=lambda m: f"{what} {dtype}: {m}")


def rand(*shape, dtype=torch.float32, shift=0.0):
    return (torch.randn(shape, dtype=torch.float64) + shift).to(dtype)


# ---- values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", ["weight", "none", "offset"])
def test_rms_norm_values(shape, dtype, variant):
    x = rand(*shape, dtype=dtype)
    w = None if variant == "none" else rand(shape[-1], dtype=dtype, shift=0.0 if variant == "offset" else 1.0)
    y = opforge.rms_norm(x, w, eps=1e-6, offset=variant == "offset")
    want = refs.rms_norm(x.double(), None if w is None else w.double(), 1e-6, variant == "offset")[0]
    assert y.shape == x.shape and y.is_contiguous()
    close(y, want, dtype, what="rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_rounds_as_torch_does(dtype):
    # torch's F.rms_norm computes these dtypes in float32 and rounds once, as the op does: 16-bit results at
    # most an ulp apart, float32 ones a few (the sums' order and rsqrt differ)
    x, w = rand(64, 1000, dtype=dtype), rand(1000, dtype=dtype, shift=1.0)
    ours, theirs = opforge.rms_norm(x, w, 1e-6), F.rms_norm(x, (1000,), w, 1e-6)
    ulp = {torch.float32: 2.0**-21, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    assert ((ours.double() - theirs.double()).abs() <= ulp * theirs.double().abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight", [True, False])
def test_add_rms_norm_values(shape, dtype, weight):
    x, r = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    w = rand(shape[-1], dtype=dtype, shift=1.0) if weight else None
    y, s = opforge.add_rms_norm(x, r, w, eps=1e-6)
    # s is torch's x + residual bit for bit; y is rms_norm of that rounded s
    assert torch.equal(s, x + r)
    want = refs.rms_norm((x + r).double(), None if w is None else w.double(), 1e-6)[0]
    close(y, want, dtype, what="add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("params", ["weight+bias", "none", "bias"])
def test_layer_norm_values(shape, dtype, params):
    x = rand(*shape, dtype=dtype, shift=3.0)  # a mean far from 0: the variance is of x - mean
    w = rand(shape[-1], dtype=dtype, shift=1.0) if params == "weight+bias" else None
    b = rand(shape[-1], dtype=dtype) if params != "none" else None
    y = opforge.layer_norm(x, w, b, eps=1e-5)
    want = F.layer_norm(x.double(), (shape[-1],), None if w is None else w.double(), None if b is None else b.double(),
                        1e-5)
    close(y, want, dtype, what="layer_norm")


def _views(dtype):
    base = rand(20, 40, dtype=dtype)
    return {
        "transposed": base.t(),  # hidden stride 40: the scalar loop
        "row-slice": base[2:9, 3:36],
        "step-2-hidden": base[:, ::2],
        "broadcast-rows": rand(1, 40, dtype=dtype).expand(6, 40),
        "permuted-3d": rand(4, 5, 6, dtype=dtype).permute(1, 0, 2),
        "size-1-dims": rand(3, 1, 9, dtype=dtype)[:, :, 1:],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_views(torch.float32)))
def test_strided_inputs_read_in_place(name, dtype):
    x = _views(dtype)[name]
    h = x.shape[-1]
    w, b = rand(3 * h, dtype=dtype)[::3] + 1, rand(h, dtype=dtype)  # a strided weight too
    close(opforge.rms_norm(x, w), refs.rms_norm(x.double(), w.double())[0], dtype, what=name)
    close(opforge.layer_norm(x, w, b), F.layer_norm(x.double(), (h,), w.double(), b.double()), dtype, what=name)
    r = _views(dtype)[name].flip(0)
    y, s = opforge.add_rms_norm(x, r, w)
    assert torch.equal(s, x + r)
    close(y, refs.rms_norm((x + r).double(), w.double())[0], dtype, what=name)


def test_empty_and_one_element_rows():
    for op in (lambda t: opforge.rms_norm(t), lambda t: opforge.layer_norm(t), lambda t: opforge.add_rms_norm(t, t)[0]):
        assert op(torch.randn(0, 8)).shape == (0, 8)
        assert op(torch.randn(4, 0)).shape == (4, 0)
    x = torch.randn(4, 1)
    torch.testing.assert_close(opforge.rms_norm(x, eps=1e-6), refs.rms_norm(x, None, 1e-6)[0])
    torch.testing.assert_close(opforge.layer_norm(x), torch.zeros(4, 1))  # x - mean = 0


def test_every_isa_agrees():
    x, r, w, b = torch.randn(37, 300), torch.randn(37, 300), torch.randn(300), torch.randn(300)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = (opforge.rms_norm(x, w), *opforge.add_rms_norm(x, r, w), opforge.layer_norm(x, w, b))
    finally:
        opforge.set_isa("auto")
    for isa, got in outs.items():
        for a, want in zip(got, outs["ref"]):
            torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5, msg=f"{isa} vs ref")


# ---- gradients ------------------------------------------------------------------------------------


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in ts]


def _grads_of(outs, leaves, gs):
    present = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(outs, present, gs))
    return [next(got) if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["weight", "none", "offset"])
def test_rms_norm_gradients(dtype, variant):
    x = rand(4, 9, 130, dtype=dtype)
    w = None if variant == "none" else rand(130, dtype=dtype, shift=0.0 if variant == "offset" else 1.0)
    g = rand(4, 9, 130, dtype=dtype)
    off = variant == "offset"
    xl, wl = _leaves(x, w)
    got = _grads_of(opforge.rms_norm(xl, wl, 1e-6, off), [xl, wl], g)
    x64, w64 = _leaves(x.double(), None if w is None else w.double())
    want = _grads_of(refs.rms_norm(x64, w64, 1e-6, off)[0], [x64, w64], g.double())
    for name, a, b in zip(("dx", "dweight"), got, want):
        if b is not None:
            close(a, b, dtype, GRAD_TOL, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("grads", ["both", "y-only", "s-only"])
def test_add_rms_norm_gradients_flow_from_both_outputs(dtype, grads):
    x, r, w = rand(3, 7, 123, dtype=dtype), rand(3, 7, 123, dtype=dtype), rand(123, dtype=dtype, shift=1.0)
    gy, gs = rand(3, 7, 123, dtype=dtype), rand(3, 7, 123, dtype=dtype)
    xl, rl, wl = _leaves(x, r, w)
    y, s = opforge.add_rms_norm(xl, rl, wl, 1e-6)
    outs, gouts = {"both": ([y, s], [gy, gs]), "y-only": ([y], [gy]), "s-only": ([s], [gs])}[grads]
    got = torch.autograd.grad(outs, [xl, rl, wl], gouts, allow_unused=True)
    x64, r64, w64 = _leaves(x.double(), r.double(), w.double())
    y64, s64 = refs.add_rms_norm(x64, r64, w64, 1e-6)
    outs64 = {"both": [y64, s64], "y-only": [y64], "s-only": [s64]}[grads]
    want = torch.autograd.grad(outs64, [x64, r64, w64], [t.double() for t in gouts], allow_unused=True)
    for name, a, b in zip(("dx", "dresidual", "dweight"), got, want):
        if b is None:  # s alone does not reach the weight
            assert a is None or not a.any(), name
            continue
        close(a, b, dtype, GRAD_TOL, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("params", ["weight+bias", "none", "weight", "bias"])
def test_layer_norm_gradients(dtype, params):
    x, g = rand(5, 33, 77, dtype=dtype, shift=2.0), rand(5, 33, 77, dtype=dtype)
    w = rand(77, dtype=dtype, shift=1.0) if "weight" in params else None
    b = rand(77, dtype=dtype) if "bias" in params else None
    xl, wl, bl = _leaves(x, w, b)
    got = _grads_of(opforge.layer_norm(xl, wl, bl, 1e-5), [xl, wl, bl], g)
    x64, w64, b64 = _leaves(x.double(), *(None if t is None else t.double() for t in (w, b)))
    want = _grads_of(F.layer_norm(x64, (77,), w64, b64, 1e-5), [x64, w64, b64], g.double())
    for name, a, c in zip(("dx", "dweight", "dbias"), got, want):
        if c is not None:
            close(a, c, dtype, GRAD_TOL, name)


def test_gradcheck_float64():
    x = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: opforge.rms_norm(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: opforge.rms_norm(x, w, 1e-6, offset=True), (x, w))
    assert torch.autograd.gradcheck(lambda x: opforge.rms_norm(x), (x,))
    assert torch.autograd.gradcheck(lambda x, r, w: opforge.add_rms_norm(x, r, w, 1e-6), (x, r, w))
    assert torch.autograd.gradcheck(lambda x, w, b: opforge.layer_norm(x, w, b), (x, w, b))
    xt = torch.randn(11, 6, dtype=torch.float64).t().requires_grad_()  # strided, read in place
    assert torch.autograd.gradcheck(lambda x, w, b: opforge.layer_norm(x, w, b), (xt, w, b))


@pytest.mark.parametrize("threads", [1, 2])
def test_weight_gradients_do_not_depend_on_the_thread_count(threads):
    x, r, g = torch.randn(1000, 257), torch.randn(1000, 257), torch.randn(1000, 257)
    w, b = torch.randn(257), torch.randn(257)

    def run(n):
        saved = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            out = []
            for fn in (lambda x_, w_: opforge.rms_norm(x_, w_), lambda x_, w_: opforge.add_rms_norm(x_, r, w_)[0],
                       lambda x_, w_: opforge.layer_norm(x_, w_, b)):
                xl, wl = _leaves(x, w)
                out += torch.autograd.grad(fn(xl, wl), [xl, wl], g)
            return out
        finally:
            torch.set_num_threads(saved)

    for a, c in zip(run(threads), run(3 - threads)):
        assert torch.equal(a, c)


def test_no_graph_without_grad():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    assert opforge.rms_norm(x, w).grad_fn is not None
    with torch.no_grad():
        assert opforge.rms_norm(x, w).grad_fn is None
        assert opforge.layer_norm(x, w).grad_fn is None


# ---- opcheck, compile, autocast ----------------------------------------------------------------


@pytest.mark.parametrize("x", [torch.randn(3, 5, 16), torch.randn(16, 6).t(), torch.randn(7)],
                         ids=["3d", "transposed", "1d"])
def test_opcheck(x):
    h = x.shape[-1]
    w, b, r = torch.randn(h), torch.randn(h), torch.randn(x.shape)
    xg, wg, rg = x.clone().requires_grad_(), w.clone().requires_grad_(), r.clone().requires_grad_()
    opcheck(OPS.rms_norm.default, (x, w, 1e-6, False))
    opcheck(OPS.rms_norm.default, (xg, wg, 1e-6, True))
    opcheck(OPS.rms_norm.default, (xg, None, 1e-6, False))
    opcheck(OPS.add_rms_norm.default, (xg, rg, wg, 1e-6, False))
    opcheck(OPS.layer_norm.default, (xg, wg, b.clone().requires_grad_(), 1e-5))
    opcheck(OPS.layer_norm.default, (xg, None, None, 1e-5))
    _, rstd = OPS.rms_norm(x, w, 1e-6, False)
    opcheck(OPS.rms_norm_backward.default, (torch.randn(x.shape), x, w, rstd, 1e-6, False))
    y, s, rstd = OPS.add_rms_norm(x, r, w, 1e-6, False)
    opcheck(OPS.add_rms_norm_backward.default, (torch.randn(x.shape), torch.randn(x.shape), s, w, rstd, 1e-6, False))
    _, mean, rstd = OPS.layer_norm(x, w, b, 1e-5)
    opcheck(OPS.layer_norm_backward.default, (torch.randn(x.shape), x, w, b, mean, rstd, 1e-5))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)

    def block(x, r):
        h, s = opforge.add_rms_norm(x, r, w)
        return (opforge.rms_norm(h, w).sin() + opforge.layer_norm(s, w, b)).sum(-1), s

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for n in (5, 9):
        x, r = torch.randn(n, 32, requires_grad=True), torch.randn(n, 32, requires_grad=True)
        out, s = compiled(x, r)
        (out.sum() + s.sum()).backward()
        got = [t.grad.clone() for t in (x, r, w, b)]
        for t in (x, r, w, b):
            t.grad = None
        out2, s2 = block(x, r)
        (out2.sum() + s2.sum()).backward()
        torch.testing.assert_close(out, out2)
        for a, c in zip(got, (x.grad, r.grad, w.grad, b.grad)):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        for t in (w, b):
            t.grad = None


def test_autocast_runs_in_the_dtype_of_x_as_torch_does():
    # torch's CPU autocast lists neither layer_norm nor rms_norm: they run in the dtype of their input, and
    # a float32 weight beside bfloat16 activations is accepted; so do these
    w = torch.randn(64, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.linear(x, torch.randn(64, 64))  # bfloat16 under autocast
        assert h.dtype == torch.bfloat16
        ours = (opforge.rms_norm(h, w), opforge.layer_norm(h, w, b), opforge.rms_norm(x, w), opforge.layer_norm(x, w, b))
        theirs = (F.rms_norm(h, (64,), w), F.layer_norm(h, (64,), w, b), F.rms_norm(x, (64,), w),
                  F.layer_norm(x, (64,), w, b))
        compiled = torch.compile(lambda t: opforge.rms_norm(t, w), fullgraph=True)(h)
    for a, c in zip(ours, theirs):
        assert a.dtype == c.dtype
        torch.testing.assert_close(a.double(), c.double(), **TOL[c.dtype])
    assert compiled.dtype == torch.bfloat16
    ours[0].float().sum().backward()
    assert w.grad.dtype == torch.float32  # the cast is in the graph: float32 master weights get float32 grads


# ---- nn modules ---------------------------------------------------------------------------------------


def test_rms_norm_module_loads_torch_and_llama_state_dicts():
    ref = torch.nn.RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
    mod = opforge.nn.RMSNorm(48, eps=1e-5)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(mod(x), ref(x), **TOL[torch.float32])
    default_eps = torch.nn.RMSNorm(48)  # eps None: finfo(dtype).eps, in both
    mod_none = opforge.nn.RMSNorm(48, eps=None)
    torch.testing.assert_close(mod_none(x * 1e-4), default_eps(x * 1e-4), **TOL[torch.float32])

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_()
    mod = opforge.nn.RMSNorm(48, eps=llama.variance_epsilon)
    mod.load_state_dict(llama.state_dict())
    assert set(mod.state_dict()) == {"weight"} and mod.variance_epsilon == 1e-6
    torch.testing.assert_close(mod(x), llama(x), **TOL[torch.float32])
    # Llama rounds x * rstd to bfloat16 before the weight multiply (two roundings, the op one): within 2 ulps
    xb = x.bfloat16()
    torch.testing.assert_close(mod.bfloat16()(xb).double(), llama.bfloat16()(xb).double(), rtol=2**-7, atol=1e-2)
    gemma = opforge.nn.RMSNorm(48, offset=True)
    assert not gemma.weight.any()  # 1 + 0 scales by one
    torch.testing.assert_close(gemma(x), opforge.rms_norm(x, eps=1e-6))


def test_layer_norm_module_is_a_drop_in():
    ref = torch.nn.LayerNorm(40)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    mod = opforge.nn.LayerNorm(40)
    mod.load_state_dict(ref.state_dict())
    assert isinstance(mod, torch.nn.LayerNorm) and set(mod.state_dict()) == {"weight", "bias"}
    x = torch.randn(6, 40, requires_grad=True)
    torch.testing.assert_close(mod(x), ref(x), **TOL[torch.float32])
    two = opforge.nn.LayerNorm((4, 10), bias=False)
    ref2 = torch.nn.LayerNorm((4, 10), bias=False)
    x2 = torch.randn(3, 4, 10)
    torch.testing.assert_close(two(x2), ref2(x2), **TOL[torch.float32])


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: opforge.rms_norm(torch.randn(3, 5), eps=0.0), r"\[opforge::rms_norm\] argument 'eps' must be a finite number > 0, got 0"),
        (lambda: opforge.rms_norm(torch.randn(3, 5), eps=-1e-6), r"argument 'eps' must be a finite number > 0, got -1e-06"),
        (lambda: opforge.layer_norm(torch.randn(3, 5), eps=float("nan")), r"\[opforge::layer_norm\] argument 'eps' must be a finite number > 0, got nan"),
        (lambda: opforge.rms_norm(torch.randn(3, 5), torch.randn(6)), r"\[opforge::rms_norm\] argument 'weight' must have size\(0\) == x.size\(-1\) = 5, got 6 \(weight: \[6\], x: \[3, 5\]\)"),
        (lambda: opforge.rms_norm(torch.randn(3, 5), torch.randn(1, 5)), r"\[opforge::rms_norm\] argument 'weight' must have 1 dim \(hidden,\), got 2: \[1, 5\]"),
        (lambda: opforge.layer_norm(torch.randn(3, 5), None, torch.randn(4)), r"\[opforge::layer_norm\] argument 'bias' must have size\(0\) == x.size\(-1\) = 5, got 4 \(bias: \[4\], x: \[3, 5\]\)"),
        (lambda: opforge.add_rms_norm(torch.randn(3, 5), torch.randn(3, 6)), r"\[opforge::add_rms_norm\] argument 'residual' must have the shape of 'x' \[3, 5\], got \[3, 6\]"),
        (lambda: opforge.add_rms_norm(torch.randn(3, 5), torch.randn(5)), r"argument 'residual' must have the shape of 'x' \[3, 5\], got \[5\]"),
        (lambda: opforge.rms_norm(torch.ones(3, 5, dtype=torch.int64)), r"\[opforge::rms_norm\] argument 'x' must be a floating-point tensor \(float32, float64, bfloat16 or float16\), got int64"),
        (lambda: opforge.rms_norm(torch.randn(3, 5), torch.randn(5, dtype=torch.float64)), r"argument 'weight' must have the dtype of 'x' \(float32\), got float64"),
        (lambda: opforge.add_rms_norm(torch.randn(3, 5), torch.randn(3, 5).bfloat16()), r"argument 'residual' must have the dtype of 'x' \(float32\), got bfloat16"),
        (lambda: opforge.layer_norm(torch.randn(3, 5).half(), torch.randn(5)), r"\[opforge::layer_norm\] argument 'weight' must have the dtype of 'x' \(float16\), got float32"),
        (lambda: opforge.rms_norm(torch.tensor(1.0)), r"argument 'x' must have at least 1 dim \(\.\.\., hidden\), got a 0-dim tensor"),
        (lambda: OPS.rms_norm_backward(torch.randn(3, 5), torch.randn(3, 5), None, torch.randn(3).double(), 1e-6, False), r"\[opforge::rms_norm_backward\] argument 'rstd' must be the contiguous float32 rstd returned by opforge::rms_norm .*got float64 \[3\]"),
        (lambda: OPS.layer_norm_backward(torch.randn(3, 5), torch.randn(3, 5), None, None, torch.randn(4), torch.randn(3), 1e-5), r"argument 'mean' must be the contiguous float32 mean returned by opforge::layer_norm .*got float32 \[4\]"),
        (lambda: OPS.add_rms_norm_backward(torch.randn(3, 5), torch.randn(3, 4), torch.randn(3, 5), None, torch.randn(3), 1e-6, False), r"argument 'grad_sum' must have the shape of 'sum' \[3, 5\], got \[3, 4\]"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_meta_and_fake_calls_check_what_the_kernel_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    y, rstd = OPS.rms_norm(torch.empty(2, 3, 8, device="meta"), None, 1e-6, False)
    assert y.shape == (2, 3, 8) and rstd.shape == (2, 3) and rstd.dtype == torch.float32
    with FakeTensorMode(), pytest.raises(RuntimeError, match=r"argument 'weight' must have size\(0\) == x.size\(-1\) = 8, got 7"):
        OPS.rms_norm(torch.empty(2, 8), torch.empty(7), 1e-6, False)
    with pytest.raises(RuntimeError, match=r"argument 'eps' must be a finite number > 0"):
        torch.compile(lambda t: opforge.layer_norm(t, eps=0.0), fullgraph=True)(torch.randn(3, 4))


def test_add_rms_norm_autocast_promotes_mixed_dtypes_as_eager():
    torch.manual_seed(0)
    x = torch.randn(5, 33, dtype=torch.bfloat16)
    res = torch.randn(5, 33)
    w = torch.randn(33)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, s = opforge.add_rms_norm(x, res, w, 1e-6)
        s_ref = x + res
        y_ref = torch.nn.functional.rms_norm(s_ref, (33,), w, 1e-6)
    assert s.dtype == y.dtype == torch.float32 == y_ref.dtype
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


# ---- what the generic tests run of rms_norm, add_rms_norm and layer_norm (tests/python/discover.py) -------

# fuzz.py: random rows and hidden sizes near where the plans change, weight, bias, offset, a far mean,
# layouts, dtypes, ISAs and threads, against float64 torch

# hidden sizes around the 8-lane vectors and their 32-wide unrolled loops; rows around the backward's row
# blocks (32 rows, up to 256 blocks) and the forward's grain (16384 / H rows a task)
NORM_HIDDEN = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 123, 128, 1000, 4096, 4097)
NORM_ROWS = (1, 3, 31, 32, 33, 37, 64, 257, 8193)


def _fuzz_draw(rng, c):
    c["kind"] = rng.choice(("rms", "rms", "add", "add", "layer"))
    h = rng.choice(NORM_HIDDEN) if rng.random() < 0.6 else fuzz.dim(rng, 4200, NORM_HIDDEN, zero=0.01)
    rows = fuzz.near(rng, rng.choice(NORM_ROWS)) if rng.random() < 0.5 else fuzz.dim(rng, 2000, NORM_ROWS, zero=0.02)
    rows = max(rows, 0)
    while rows * h > 600_000:
        rows //= 2
    nlead = rng.choices((0, 1, 2), (0.1, 0.6, 0.3))[0]
    if nlead == 0:
        rows = 1
    lead = [rows] if nlead == 1 else [rng.choice((1, 2, 3)), rows] if nlead == 2 else []
    c["shape"] = lead + [h]
    c["x_layout"] = fuzz.layout(rng, c["shape"])
    c["r_layout"] = fuzz.layout(rng, c["shape"]) if c["kind"] == "add" else None
    c["weight"] = rng.random() < 0.75
    c["bias"] = c["kind"] == "layer" and rng.random() < 0.6
    c["offset"] = c["kind"] != "layer" and c["weight"] and rng.random() < 0.3
    c["eps"] = rng.choice((1e-6, 1e-5, 0.1))
    c["shift"] = rng.choice((0.0, 0.0, 3.0))  # a mean far from 0 (layer_norm's variance of x - mean)
    c["grad"] = rng.random() < 0.6
    return fuzz.seconds(c, 0, 0, math.prod(c["shape"]) * (60 if c["grad"] else 20))


def _fuzz_describe(c):
    extra = (f" residual{fuzz.layout_str(c['r_layout'])}" if c["kind"] == "add" else "") + (
        " weight" if c["weight"] else "") + (" bias" if c["bias"] else "") + (" offset" if c["offset"] else "")
    return (f"{c['kind']} x={tuple(c['shape'])}{fuzz.layout_str(c['x_layout'])}{extra} eps={c['eps']} "
            f"shift={c['shift']} grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    """Bounds: a row's sums (of squares, of x, of g w xh) carry u (c(H) + H / 2) relative errors into rstd, mean and the
    backward's mean(g w xh); each output is a few products of those (u each) and one rounding to its type;
    the weight and bias gradients add a sum over the rows (u c(R))."""
    shape, h = c["shape"], c["shape"][-1]
    specs = [(shape, dtype, c["x_layout"], "randn", 1.0)]
    if c["kind"] == "add":
        specs.append((shape, dtype, c["r_layout"], "randn", 1.0))
    ins = fuzz.inputs(gen, specs)
    if c["shift"]:
        ins[0] = (ins[0][0].add_(c["shift"]), ins[0][1])
    xb = ins[0][0].requires_grad_(c["grad"])
    x = ins[0][1](xb)
    r = ins[1][1](ins[1][0].requires_grad_(c["grad"])) if c["kind"] == "add" else None
    w = (fuzz.random_tensor(gen, [h], dtype, scale=0.5) + (0 if c["offset"] else 1)).requires_grad_(c["grad"]) \
        if c["weight"] else None
    b = fuzz.random_tensor(gen, [h], dtype).requires_grad_(c["grad"]) if c["bias"] else None
    g, gs = fuzz.random_tensor(gen, shape, dtype), fuzz.random_tensor(gen, shape, dtype)
    leaves = [t for t in (x, r, w, b) if t is not None]
    names = [n for n, t in zip(("dx", "dresidual", "dweight", "dbias"), (x, r, w, b)) if t is not None]

    def forward_backward():
        if c["kind"] == "rms":
            outs = (opforge.rms_norm(x, w, c["eps"], c["offset"]),)
        elif c["kind"] == "add":
            outs = opforge.add_rms_norm(x, r, w, c["eps"], c["offset"])
        else:
            outs = (opforge.layer_norm(x, w, b, c["eps"]),)
        grads = torch.autograd.grad(outs, leaves, (g, gs)[:len(outs)]) if c["grad"] else None
        return outs, grads

    if c["grad"]:
        outs, grads = call(forward_backward)
    else:
        with torch.no_grad():
            outs, grads = call(forward_backward)

    u, n = fuzz.U_ACC[dt], max(h, 1)
    cu = u * (fuzz.c_sum(n) + 0.5 * n + 16)  # sums of one sign (squares; x broadcast along a row) drift like n / 2
    # y and the backward start from s as the kernel keeps it: x + residual rounded to x's dtype (FUZZ's rounded)
    src = (x.detach().double() + r.detach().double()).to(dtype) if c["kind"] == "add" else x.detach()
    s64 = src.double()
    w64 = w.detach().double() if w is not None else torch.ones(h, dtype=torch.float64)
    we = 1 + w64 if c["offset"] else w64
    eps = c["eps"] if dtype == torch.float64 else float(torch.tensor(c["eps"], dtype=torch.float32))
    mu = s64.mean(-1, keepdim=True) if c["kind"] == "layer" else torch.zeros_like(s64[..., :1])
    d = s64 - mu
    rstd = ((d * d).mean(-1, keepdim=True) + eps).rsqrt()
    xh = d * rstd
    # |error of xh|: rstd's relative error, and the mean's absolute one times rstd; the mean's error also
    # enters the variance (a row of equal values: x - mean is all rounding, eps alone bounds rstd)
    mean_err = cu * s64.abs().mean(-1, keepdim=True) * (c["kind"] == "layer")
    rstd_rel = cu + (mean_err * rstd) ** 2
    xh_err = rstd_rel * xh.abs() + rstd * mean_err
    y = xh * we + (b.detach().double() if b is not None else 0)
    checks = [fuzz.Check("out", outs[0], y, xh_err * we.abs() + cu * y.abs() + fuzz.out_tol(y, dt), dtype)]
    if c["kind"] == "add":
        checks.append(fuzz.Check("sum", outs[1], s64, torch.zeros_like(s64), dtype))
    if not c["grad"]:
        return checks
    g64, gs64 = g.double(), gs.double()
    gw = g64 * we
    rows_dims = tuple(range(len(shape) - 1))
    m_gwx = (gw * xh).mean(-1, keepdim=True)
    m_gw = gw.mean(-1, keepdim=True) if c["kind"] == "layer" else torch.zeros_like(m_gwx)
    dx = rstd * (gw - m_gw - xh * m_gwx)
    scale = rstd * (gw.abs() + gw.abs().mean(-1, keepdim=True) + (xh.abs() + xh_err) * (gw * xh).abs().mean(-1, keepdim=True))
    dx_b = (cu + rstd_rel) * scale + rstd * xh_err * m_gwx.abs() + rstd * (gw.abs() * xh_err).mean(-1, keepdim=True) * xh.abs()
    want = {"dx": (dx + (gs64 if c["kind"] == "add" else 0), dx_b)}
    if c["kind"] == "add":
        want["dresidual"] = want["dx"]
    rows = max(math.prod(shape[:-1]), 1)
    gxh = (g64 * xh).sum(rows_dims) if rows_dims else g64 * xh
    gxh_abs = (g64.abs() * (xh.abs() + xh_err)).sum(rows_dims) if rows_dims else g64.abs() * (xh.abs() + xh_err)
    want["dweight"] = (gxh, u * fuzz.c_sum(rows) * gxh_abs + (g64.abs() * xh_err).sum(rows_dims) if rows_dims
                       else (g64.abs() * xh_err) + u * gxh_abs)
    gsum = g64.sum(rows_dims) if rows_dims else g64
    want["dbias"] = (gsum, u * fuzz.c_sum(rows) * (g64.abs().sum(rows_dims) if rows_dims else g64.abs()))
    for name, got in zip(names, grads):
        ref, err = want[name]
        checks.append(fuzz.Check(name, got, ref, err + fuzz.out_tol(ref, dt), dtype))
    return checks


FUZZ = {
    # norm.h: add_rms_norm's s = x + residual rounded to x's dtype, y computed from it; rstd, mean saved
    # in float32, dweight and dbias summed in float32 and rounded once
    "norm": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.2, order=7,
                    covers=("rms_norm", "add_rms_norm", "layer_norm"), rounded={("*", "*"): ("s",)}),
}


# test_export.py: the ops' parts of the exported model


def _export_rms_norm(g, hidden, vocab, max_len):
    return {"w": 1 + 0.1 * torch.randn(hidden, generator=g)}, lambda x, target, w: (opforge.rms_norm(x, w),)


def _export_add_rms_norm(g, hidden, vocab, max_len):
    return {"w": 1 + 0.1 * torch.randn(hidden, generator=g)}, \
        lambda x, target, w: opforge.add_rms_norm(x, x.flip(-1), w)


def _export_layer_norm(g, hidden, vocab, max_len):
    w, b = 1 + 0.1 * torch.randn(hidden, generator=g), 0.1 * torch.randn(hidden, generator=g)
    return {"w": w, "b": b}, lambda x, target, w, b: (opforge.layer_norm(x, w, b),)


EXPORT = {"rms_norm": _export_rms_norm, "add_rms_norm": _export_add_rms_norm, "layer_norm": _export_layer_norm}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "rms_norm": training.Case(
        ("rms_norm",),
        lambda dt, big: [training.randn(2000 if big else 5, 7, 48, dtype=dt), 1 + 0.1 * training.randn(48, dtype=dt)],
        (0, 1),
        lambda x, w: opforge.rms_norm(x, w, 1e-6),
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        autocast="follow"),
    "add_rms_norm": training.Case(
        ("add_rms_norm",),
        lambda dt, big: [training.randn(2000 if big else 5, 7, 48, dtype=dt),
                         training.randn(2000 if big else 5, 7, 48, dtype=dt), 1 + 0.1 * training.randn(48, dtype=dt)],
        (0, 1, 2),
        lambda x, r, w: opforge.add_rms_norm(x, r, w, 1e-6),
        lambda x, r, w: (F.rms_norm(x + r, (x.shape[-1],), w, 1e-6), x + r),
        autocast="follow"),
    "layer_norm": training.Case(
        ("layer_norm",),
        lambda dt, big: [training.randn(2000 if big else 5, 7, 48, dtype=dt), 1 + 0.1 * training.randn(48, dtype=dt),
                         0.1 * training.randn(48, dtype=dt)],
        (0, 1, 2),
        lambda x, w, b: opforge.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        autocast="follow"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


SWEEP_SHAPES = [(0, 5), (5, 0), (0, 0), (1, 1), (1, 7), (3, 1), (7,), (2, 3, 7), (3, 0, 5), (17, 3), "t", (70, 257)]


def _norm_x(shape, seed):
    return thread_sweep.randn((17, 5), seed).t() if shape == "t" else thread_sweep.randn(shape, seed)


def _hidden(shape):
    return 17 if shape == "t" else shape[-1]


def _sweep_cases():
    cases = []
    for i, shape in enumerate(SWEEP_SHAPES):
        h = _hidden(shape)
        weighted, offset = i % 3 != 1, i % 4 == 3

        def make(dt, shape=shape, h=h, weighted=weighted):
            w = thread_sweep.randn((h,), 2).to(dt) if weighted else None
            return (_norm_x(shape, 1).to(dt), w, _norm_x(shape, 3).to(dt),
                    thread_sweep.randn((h,), 4).to(dt) if weighted else None)

        gw = (1,) if weighted else ()
        cases.append(thread_sweep.Case(f"rms_norm {shape} weight={weighted} offset={offset}", make,
                                       lambda x, w, r, b, o=offset: (opforge.rms_norm(x, w, 1e-6, o),),
                                       lambda x, w, r, b, o=offset: refs.rms_norm(x, w, 1e-6, o), grads=(0, *gw)))
        cases.append(thread_sweep.Case(f"add_rms_norm {shape} weight={weighted} offset={offset}", make,
                                       lambda x, w, r, b, o=offset: opforge.add_rms_norm(x, r, w, 1e-5, o),
                                       lambda x, w, r, b, o=offset: refs.add_rms_norm(x, r, w, 1e-5, o), grads=(0, 2, *gw)))
        gb = (1, 3) if weighted else ()
        cases.append(thread_sweep.Case(f"layer_norm {shape} weight/bias={weighted}", make,
                                       lambda x, w, r, b: (opforge.layer_norm(x, w, b, 1e-5),),
                                       lambda x, w, r, b: refs.layer_norm(x, w, b, 1e-5), grads=(0, *gb)))
    return cases


SWEEP = dict.fromkeys(("rms_norm", "add_rms_norm", "layer_norm"), _sweep_cases)


def test_torch_argument_forms():
    """eps=None as F.rms_norm (the dtype's machine epsilon); torch's normalized_shape in the weight's place
    is named, not a dispatcher type error."""
    OF = opforge.functional
    x = torch.full((2, 5), 1e-4)
    torch.testing.assert_close(OF.rms_norm(x, None, None), F.rms_norm(x, (5,), None, None), rtol=0, atol=0)
    torch.testing.assert_close(OF.add_rms_norm(x, x, None, None)[0], F.rms_norm(2 * x, (5,), None, None), rtol=0,
                               atol=0)
    for call in (lambda: OF.rms_norm(x, (5,)), lambda: OF.layer_norm(x, [5])):
        with pytest.raises(RuntimeError, match=r"argument 'weight' must be a tensor or None, got .*normalises the "
                                               r"last dim, with no normalized_shape argument"):
            call()
