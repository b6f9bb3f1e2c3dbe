"""rms_norm, add_rms_norm and layer_norm against PyTorch: values per dtype vs
float64 (F.rms_norm / F.layer_norm formulas), strides, gradients incl. weight
and bias, gradcheck, opcheck, torch.compile, autocast, thread-count
determinism, every ISA, the nn modules, bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import opforge
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
        (lambda: opforge.rms_norm(torch.randn(3, 5), torch.randn(6)), r"\[opforge::rms_norm\] argument 'weight' must have shape \[5\] \(the last dim of 'x'\), got \[6\]"),
        (lambda: opforge.rms_norm(torch.randn(3, 5), torch.randn(1, 5)), r"argument 'weight' must have shape \[5\] .*got \[1, 5\]"),
        (lambda: opforge.layer_norm(torch.randn(3, 5), None, torch.randn(4)), r"\[opforge::layer_norm\] argument 'bias' must have shape \[5\] .*got \[4\]"),
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
    with FakeTensorMode(), pytest.raises(RuntimeError, match=r"argument 'weight' must have shape \[8\]"):
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
