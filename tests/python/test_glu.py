"""swiglu / geglu (the glu op) against float64 PyTorch: values per dtype, the
packed (..., 2F) form, strides, gradients, gradcheck, opcheck, torch.compile,
autocast, threads, ISAs, errors, and nn.SwiGLU against Hugging Face's LlamaMLP.

Tolerances (against the float64 formula on the rounded inputs): float32
atol = rtol = 1e-5 (the vector exp / erf / tanh are within a few ulp, and
gelu_tanh's derivative is a difference of O(1) terms); bfloat16 / float16
those of opforge.testing (one rounding of a float32 result), the gradients
GRAD_TOLERANCE_FACTOR times looser."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as TF
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import functional as F
from opforge.references import glu as reference
from opforge.testing import DTYPES, GRAD_TOLERANCE_FACTOR, assert_close, tolerance

OP = torch.ops.opforge.glu.default
BWD = torch.ops.opforge.glu_backward.default
ACTS = {"swiglu": (lambda g, u: F.swiglu(g, u), "silu"), "geglu": (lambda g, u: F.geglu(g, u), "gelu"),
        "geglu_tanh": (lambda g, u: F.geglu(g, u, approximate="tanh"), "gelu_tanh")}
SHAPES = [(1,), (7,), (123,), (4097,), (3, 123), (2, 3, 17), (0, 5), (5, 0)]


def tol(dtype, grad=False):
    t = tolerance(dtype, *((1e-5, 1e-5) if dtype == torch.float32 else (None, None)))
    return {k: v * GRAD_TOLERANCE_FACTOR for k, v in t.items()} if grad else t


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    up = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values(dtype, name, shape):
    fn, act = ACTS[name]
    gate, up = inputs(shape, dtype)
    out = fn(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype
    assert_close(out, reference(gate.double(), up.double(), act), dtype, f"{name} {shape}", **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_packed_form_is_chunk(dtype, name):
    x = (torch.randn(3, 5, 2 * 123, dtype=torch.float64) * 2).to(dtype)
    gate, up = x.chunk(2, -1)
    packed = getattr(F, name)(x)
    assert packed.shape == (3, 5, 123)
    torch.testing.assert_close(packed, getattr(F, name)(gate, up), rtol=0, atol=0)
    act = "silu" if name == "swiglu" else "gelu"
    assert_close(packed, reference(gate.double(), up.double(), act), dtype, name, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_round_once(dtype):
    gate, up = inputs((4096,), dtype)
    exact = reference(gate.double(), up.double(), "silu")
    ours = (F.swiglu(gate, up).double() - exact).abs().max()
    eager = (reference(gate, up, "silu").double() - exact).abs().max()  # rounds after silu and after the product
    assert ours <= eager


def _views(dtype):
    base = (torch.randn(20, 60, dtype=torch.float64) * 2).to(dtype)
    return {
        "transposed": (base[:, :30].t(), base[:, 30:].t()),
        "row-slice": (base[2:9, 3:16], base[5:12, 40:53]),
        "step-2": (base[:, ::2], base[:, 1::2]),
        "broadcast-up": (base[:6, :30], base[:1, 30:].expand(6, 30)),
        "permuted-3d": (base.reshape(4, 5, 60).permute(2, 0, 1), base.reshape(4, 5, 60).permute(2, 0, 1) * 0.5),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(_views(torch.float32)))
def test_strided_inputs_read_in_place(name, dtype):
    gate, up = _views(dtype)[name]
    out = F.swiglu(gate, up)
    assert_close(out, reference(gate.double(), up.double(), "silu"), dtype, name, **tol(dtype))
    dense = torch.empty_like(gate).stride() == gate.stride()
    assert out.stride() == (gate.stride() if dense else torch.empty(gate.shape).stride())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACTS))
def test_gradients_match_autograd_of_the_formula(dtype, name):
    fn, act = ACTS[name]
    gate, up = (t.requires_grad_() for t in inputs((7, 123), dtype, seed=1))
    grad = torch.randn(7, 123, dtype=dtype)
    fn(gate, up).backward(grad)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    reference(g64, u64, act).backward(grad.double())
    assert gate.grad.dtype == dtype and up.grad.dtype == dtype
    assert_close(gate.grad, g64.grad, dtype, "dgate", **tol(dtype, grad=True))
    assert_close(up.grad, u64.grad, dtype, "dup", **tol(dtype, grad=True))


def test_packed_gradient():
    x = torch.randn(4, 2 * 33, dtype=torch.float64, requires_grad=True)
    F.swiglu(x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    gate, up = x2.chunk(2, -1)
    (TF.silu(gate) * up).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("name", list(ACTS))
def test_gradcheck_float64(name):
    fn, _ = ACTS[name]
    gate, up = (t.requires_grad_() for t in inputs((5, 13), torch.float64, seed=2))
    assert torch.autograd.gradcheck(fn, (gate, up))
    assert torch.autograd.gradcheck(fn, (gate.detach().t().requires_grad_(), up.detach().t().requires_grad_()))
    x = torch.randn(3, 14, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: F.swiglu(t), (x,))


BWD_INPLACE = torch.ops.opforge.glu_backward_.default


def _glu_backward_ops(make_gate_up, keep=False, retain=False, dtype=torch.float32):
    """Gradients of x and the two weights through swiglu(x Wg^T, x Wu^T), and the glu backward ops the
    autograd graph ran; keep: the caller still holds gate and up (returned, with copies of their values)."""
    torch.manual_seed(3)
    x = torch.randn(37, 24, dtype=dtype, requires_grad=True)
    wg, wu = (torch.randn(4101, 24, dtype=dtype, requires_grad=True) for _ in range(2))
    gate, up = make_gate_up(x, wg, wu)
    y = F.swiglu(gate, up)
    held = (gate, up, gate.detach().clone(), up.detach().clone()) if keep else None
    del gate, up
    with torch.profiler.profile() as prof:
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(dtype), retain_graph=retain)
    ran = sorted({e.name for e in prof.events() if e.name.startswith("opforge::glu_backward")})
    return [t.grad for t in (x, wg, wu)], ran, held


def _projections(x, wg, wu):
    return x @ wg.t(), x @ wu.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_writes_over_gate_and_up_no_one_else_holds(dtype):
    """gate and up saved for the backward alone (the MLP's projections, dropped after the forward) take
    their gradients in place (glu_backward_): the same bits as the out-of-place backward's, which runs
    when the caller still holds them (left unchanged) or the graph is retained."""
    grads, ran, _ = _glu_backward_ops(_projections, dtype=dtype)
    assert ran == ["opforge::glu_backward_"]
    kept, ran_kept, held = _glu_backward_ops(_projections, keep=True, dtype=dtype)
    assert ran_kept == ["opforge::glu_backward"]
    assert torch.equal(held[0], held[2]) and torch.equal(held[1], held[3]), "a held gate or up was overwritten"
    retained, ran_retained, _ = _glu_backward_ops(_projections, retain=True, dtype=dtype)
    assert ran_retained == ["opforge::glu_backward"]
    for a, b, c in zip(grads, kept, retained):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_backward_out_of_place_for_layouts_it_cannot_write_over():
    """Transposed (non-contiguous) gate and up, and the packed form's two views of one tensor, keep
    the out-of-place backward."""
    _, ran, _ = _glu_backward_ops(lambda x, wg, wu: ((wg @ x.t()).t(), (wu @ x.t()).t()))
    assert ran == ["opforge::glu_backward"]
    x = torch.randn(5, 2 * 33, requires_grad=True)
    with torch.profiler.profile() as prof:
        F.swiglu(x * 2).sum().backward()
    assert sorted({e.name for e in prof.events() if e.name.startswith("opforge::glu_backward")}) == [
        "opforge::glu_backward"]


def test_backward_keeps_out_of_place_where_the_device_lacks_the_in_place_kernel():
    """glu_backward_ has a CPU kernel alone: tensors of another device (meta here, CUDA on a GPU machine)
    keep glu_backward, even where the CPU would write over them."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("opforge::glu_backward_", "CUDA")
    x = torch.empty(37, 24, device="meta", requires_grad=True)
    wg, wu = (torch.empty(4101, 24, device="meta", requires_grad=True) for _ in range(2))
    y = F.swiglu(x @ wg.t(), x @ wu.t())
    with torch.profiler.profile() as prof:
        y.sum().backward()
    assert sorted({e.name for e in prof.events() if e.name.startswith("opforge::glu_backward")}) == [
        "opforge::glu_backward"]
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 123), (3, 1 << 21)])  # the second past the streaming stores' size
def test_inplace_backward_op_equals_the_out_of_place_one(act, dtype, shape):
    grad, gate, up = (torch.randn(shape).to(dtype) for _ in range(3))
    dgate, dup = BWD(grad, gate, up, act)
    assert BWD_INPLACE(grad, gate, up, act) is None
    assert torch.equal(gate, dgate) and torch.equal(up, dup)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: BWD_INPLACE(torch.rand(4, 3), torch.rand(3, 4).t(), torch.rand(4, 3), "silu"),
         r"\[opforge::glu_backward_\] arguments 'gate' and 'up' must be dense with the same strides .*"
         r"got strides \(1, 4\) and \(3, 1\)"),
        (lambda: BWD_INPLACE(torch.rand(4, 3), torch.rand(4, 6)[:, :3], torch.rand(4, 6)[:, :3], "silu"),
         r"\[opforge::glu_backward_\] arguments 'gate' and 'up' must be dense with the same strides"),
        (lambda: (lambda x: BWD_INPLACE(torch.rand(4), x[:4], x[2:], "silu"))(torch.rand(6)),
         r"\[opforge::glu_backward_\] arguments 'gate' and 'up' must not overlap in memory"),
        (lambda: BWD_INPLACE(torch.rand(3), torch.rand(3), torch.rand(3).double(), "silu"),
         r"\[opforge::glu_backward_\] argument 'up' must have the dtype of 'gate' \(float32\), got float64"),
    ],
    ids=["strides", "not-dense", "overlap", "dtype"],
)
def test_inplace_backward_errors(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


@pytest.mark.parametrize(
    "gate, up",
    [inputs((7, 13), torch.float32), (torch.rand(5, 6).t(), torch.rand(6, 5)), torch.rand(3, 10).chunk(2, -1),
     (torch.rand(0, 3), torch.rand(0, 3))],
    ids=["contiguous", "transposed", "packed-views", "empty"],
)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_opcheck(gate, up, act):
    opcheck(OP, (gate, up, act))
    opcheck(OP, (gate.clone().requires_grad_(), up.clone().requires_grad_(), act))
    opcheck(BWD, (torch.rand_like(gate), gate, up, act))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    def f(gate, up, x):
        return F.swiglu(gate, up).sin() + F.geglu(x, approximate="tanh").cos()

    def eager(gate, up, x):
        a, b = x.chunk(2, -1)
        return (TF.silu(gate) * up).sin() + (TF.gelu(a, approximate="tanh") * b).cos()

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (16, 33):
        args = [torch.randn(n, 8).requires_grad_(), torch.randn(n, 8).requires_grad_(),
                torch.randn(n, 16).requires_grad_()]
        ref_args = [a.detach().clone().requires_grad_() for a in args]
        y = compiled(*args)
        y.sum().backward()
        eager(*ref_args).sum().backward()
        torch.testing.assert_close(y, eager(*ref_args), atol=1e-5, rtol=1e-5)
        for a, r in zip(args, ref_args):
            torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_the_widest_input_as_eager(dtype):
    # policy promote: eager silu(gate) * up of a 16-bit gate and a float32 up is float32 under autocast
    gate, up = inputs((32, 64), torch.float32)
    gate = gate.to(dtype).requires_grad_()
    up.requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y = F.swiglu(gate, up)
        z = torch.compile(lambda a, b: F.swiglu(a, b), fullgraph=True)(gate, up)
        lo = F.swiglu(gate, up.to(dtype))
    assert y.dtype == z.dtype == (TF.silu(gate) * up).dtype == torch.float32 and lo.dtype == dtype
    assert_close(y, reference(gate.detach().double(), up.detach().double(), "silu"), torch.float32, "autocast")
    torch.testing.assert_close(y, z)
    y.sum().backward()
    assert gate.grad.dtype == dtype and up.grad.dtype == torch.float32
    # float64 is left alone, as torch's autocast leaves it
    with torch.autocast("cpu", dtype=dtype):
        assert F.swiglu(gate.detach().double(), up.detach().double()).dtype == torch.float64


def test_same_bits_on_one_and_two_threads():
    code = (
        "import torch, opforge; from opforge import functional as F\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(77, 2 * 4097, generator=g, requires_grad=True)\n"
        "y = F.geglu(x); y.backward(torch.randn(y.shape, generator=g))\n"
        "torch.save((y.detach(), x.grad), '{path}')\n"
    )
    outs = []
    for n in (1, 2):
        path = f"/tmp/opforge_glu_threads_{n}.pt"
        r = subprocess.run([sys.executable, "-c", f"import torch; torch.set_num_threads({n})\n" + code.format(path=path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(torch.load(path))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_matches_the_reference(dtype):
    gate, up = inputs((3, 4099), dtype)
    grad = torch.randn(3, 4099, dtype=dtype)
    results = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            results[isa] = (OP(gate, up, "gelu_tanh"), *BWD(grad, gate, up, "silu"), OP(gate.t(), up.t(), "gelu"))
    finally:
        opforge.set_isa("auto")
    for isa, outs in results.items():
        for got, want in zip(outs, results["ref"]):
            torch.testing.assert_close(got, want, msg=f"{isa} vs ref", **tol(dtype, grad=True))


# gates at the edges of exp's range: infinities, magnitudes whose square overflows float32, exponents far
# below the smallest float, NaN
SPECIAL = [float("inf"), float("-inf"), -1e30, -1e25, 1e30, 1e25, -100.0, 100.0, -20.0, 20.0, -2.0, 0.5, float("nan")]
TORCH_ACTS = {"gelu": TF.gelu, "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh"), "silu": TF.silu}


@pytest.mark.parametrize("act", list(TORCH_ACTS))
def test_activations_at_infinite_and_huge_gates_on_every_isa(act):
    # the vector exp clamped its argument: gelu' at [inf, -inf, -1e30, -1e25] was [inf, -inf, -4.86e-9, -4.86e-14]
    # where torch (and the reference) give [nan, nan, 0, 0]. Against torch in float32 one element at a time
    # (its vectorized float32 erf makes gelu(inf) NaN; its scalar path and float64 give inf).
    gate = torch.tensor(SPECIAL)
    want, want_grad = [], []
    for v in gate:
        v = v.reshape(1).clone().requires_grad_()
        y = TORCH_ACTS[act](v)
        y.backward(torch.ones_like(y))
        want.append(y.detach()), want_grad.append(v.grad)
    want, want_grad, up = torch.cat(want), torch.cat(want_grad), torch.ones_like(gate)
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            out, (dgate, dup) = OP(gate, up, act), BWD(torch.ones_like(gate), gate, up, act)
            for what, got, ref in (("forward", out, want), ("dgate", dgate, want_grad), ("dup", dup, want)):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=0, equal_nan=True,
                                           msg=lambda m: f"{isa} act={act} {what} at {SPECIAL}: {got.tolist()}\n{m}")
    finally:
        opforge.set_isa("auto")


# ---- nn.SwiGLU -----------------------------------------------------------------------------------------


def test_swiglu_module_loads_llama_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=136, hidden_act="silu", mlp_bias=False,
                                      num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    hf = LlamaMLP(config).double()
    ours = opforge.nn.SwiGLU(48, 136, dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    assert set(ours.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(2, 9, 48, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ours(x), hf(x2)
    torch.testing.assert_close(y, y2)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(ours.gate_proj.weight.grad, hf.gate_proj.weight.grad)


# ---- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_rejects_non_float_dtypes(dtype):
    with pytest.raises(RuntimeError, match=r"\[opforge::glu\] argument 'gate' must be a floating-point tensor .*got "
                       + str(dtype).split(".")[1]):
        F.swiglu(torch.ones(4, dtype=dtype), torch.ones(4, dtype=dtype))


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: F.swiglu(torch.rand(3, 4), torch.rand(3, 5)),
         r"\[opforge::glu\] argument 'up' must have the shape of 'gate' \[3, 4\], got \[3, 5\]"),
        (lambda: F.swiglu(torch.rand(3), torch.rand(3, dtype=torch.float64)),
         r"\[opforge::glu\] argument 'up' must have the dtype of 'gate' \(float32\), got float64"),
        (lambda: OP(torch.rand(3), torch.rand(3), "relu"),
         r"\[opforge::glu\] argument 'act' must be one of 'gelu', 'gelu_tanh', 'silu', got 'relu'"),
        (lambda: F.swiglu(torch.rand(3, 7)),
         r"\[opforge::swiglu\] argument 'gate' given alone must be packed \(..., 2F\) .*got last size 7"),
        (lambda: F.geglu(torch.rand(3, 8), approximate="fast"),
         r"\[opforge::geglu\] argument 'approximate' must be 'none' or 'tanh', got 'fast'"),
        (lambda: BWD(torch.rand(3, 4), torch.rand(3, 4), torch.rand(3, 4).double(), "silu"),
         r"\[opforge::glu_backward\] argument 'up' must have the dtype of 'gate' \(float32\), got float64"),
        (lambda: BWD(torch.rand(4), torch.rand(3), torch.rand(3), "silu"),
         r"\[opforge::glu_backward\] argument 'grad' must have the shape of 'gate' \[3\], got \[4\]"),
        (lambda: F.swiglu(torch.rand(3), torch.empty(3, device="meta")),
         r"\[opforge::glu\] argument 'up' must be on the device of 'gate' \(cpu\), got meta"),
    ],
)
def test_errors_name_op_argument_expected_and_got(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_compile_refuses_what_eager_refuses():
    with pytest.raises(Exception, match=r"argument 'up' must have the shape of 'gate'"):
        torch.compile(lambda a, b: F.swiglu(a, b), fullgraph=True)(torch.rand(3, 4), torch.rand(3, 5))


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random shapes near the vector widths and the elementwise grain, the packed form, layouts, dtypes,
# ISAs and threads, against float64 torch

GLU_MARKS = (1, 7, 8, 15, 16, 17, 33, 123, 1408, 4097, 5632)  # vector widths, Llama MLP sizes
GLU_ROW_MARKS = (7, 8, 15, 16, 17, 31, 32, 33, 64, 4097, 32767, 32768, 32769, 65536, 100000)  # the 32768 grain


def _fuzz_draw(rng, c):
    c["act"] = rng.choice(("silu", "gelu", "gelu_tanh"))
    c["packed"] = rng.random() < 0.3  # one (..., 2F) tensor split by chunk: two strided views
    nd = rng.choices((1, 2, 3), (0.2, 0.5, 0.3))[0]
    shape = [fuzz.dim(rng, 64 if nd == 3 else 2048, GLU_ROW_MARKS, zero=0.03) for _ in range(nd - 1)]
    shape.append(fuzz.dim(rng, 6000, GLU_MARKS, zero=0.03))
    while math.prod(shape) > 2_000_000:
        shape[shape.index(max(shape))] //= 2
    c["shape"] = shape
    full = shape[:-1] + [2 * shape[-1]]
    c["gate_layout"] = fuzz.layout(rng, full if c["packed"] else shape)
    c["up_layout"] = None if c["packed"] else fuzz.layout(rng, shape)
    c["grad"] = rng.random() < 0.5
    return fuzz.seconds(c, 0, 0, math.prod(shape) * 60)


def _fuzz_describe(c):
    up = "packed" if c["packed"] else f"up{fuzz.layout_str(c['up_layout'])}"
    return f"act={c['act']} shape={tuple(c['shape'])} gate{fuzz.layout_str(c['gate_layout'])} {up} grad={c['grad']}"


def _fuzz_check(c, gen, dtype, dt, call):
    shape = c["shape"]
    if c["packed"]:
        base, view = fuzz.make(gen, shape[:-1] + [2 * shape[-1]], dtype, c["gate_layout"], scale=3.0)
        base.requires_grad_(c["grad"])
        x = view(base)
        gate, up = x.chunk(2, -1)
        args, wrt = (x,), (x,)
    else:
        gbase, gview = fuzz.make(gen, shape, dtype, c["gate_layout"], scale=3.0)
        ubase, uview = fuzz.make(gen, shape, dtype, c["up_layout"])
        gbase.requires_grad_(c["grad"])
        ubase.requires_grad_(c["grad"])
        gate, up = gview(gbase), uview(ubase)
        args, wrt = (gate, up), (gate, up)
    g = fuzz.random_tensor(gen, shape, dtype)
    fn = {"silu": opforge.functional.swiglu, "gelu": opforge.functional.geglu,
          "gelu_tanh": lambda *a: opforge.functional.geglu(*a, approximate="tanh")}[c["act"]]

    def forward_backward():
        out = fn(*args)
        return out, (torch.autograd.grad(out, wrt, g) if c["grad"] else None)

    if c["grad"]:
        out, grads = call(forward_backward)
    else:
        with torch.no_grad():
            out, grads = call(forward_backward)
    x64, u64, g64 = gate.detach().double(), up.detach().double(), g.double()
    with torch.enable_grad():
        xr = x64.clone().requires_grad_()
        a = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
             "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[c["act"]](xr)
        (da,) = torch.autograd.grad(a, xr, torch.ones_like(a))
    a = a.detach()
    u = fuzz.U_ACC[dt]
    # the vector exp / erf / tanh: a few float32 ulps of |act| + |x| (erf's error is absolute); the
    # derivative of gelu_tanh is a difference of O(1 + |x|) terms
    want = a * u64
    checks = [fuzz.Check("out", out, want, 16 * u * (a.abs() + x64.abs()) * u64.abs() + fuzz.out_tol(want, dt), dtype)]
    if c["grad"]:
        dgate, dup = g64 * u64 * da, g64 * a
        bound_g = 64 * u * (g64 * u64).abs() * (1 + x64.abs()) + fuzz.out_tol(dgate, dt)
        bound_u = 16 * u * g64.abs() * (a.abs() + x64.abs()) + fuzz.out_tol(dup, dt)
        if c["packed"]:
            checks.append(fuzz.Check("dx", grads[0], torch.cat((dgate, dup), -1), torch.cat((bound_g, bound_u), -1), dtype))
        else:
            checks += [fuzz.Check("dgate", grads[0], dgate, bound_g, dtype), fuzz.Check("dup", grads[1], dup, bound_u, dtype)]
    return checks


FUZZ = {
    # glu.h: float32 from the 16-bit inputs to the rounded results (act recomputed from gate)
    "glu": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.15, order=5, rounded={("*", "*"): ()}),
}


# test_export.py: the op's part of the exported model


def _export(g, hidden, vocab, max_len):
    # packed: gate and up are the halves of one (..., 2F) projection
    return {"w": torch.randn(2 * hidden, hidden, generator=g) / hidden**0.5}, \
        lambda x, target, w: (F.swiglu(x @ w.T),)


EXPORT = {"glu": _export}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "swiglu": training.Case(
        ("glu",),
        lambda dt, big: [training.randn(600 if big else 6, 9, 40, dtype=dt),
                         training.randn(600 if big else 6, 9, 40, dtype=dt)],
        (0, 1),
        F.swiglu,
        lambda g, u: TF.silu(g) * u,
        autocast="promote"),
    "geglu": training.Case(
        ("glu",),
        lambda dt, big: [training.randn(600 if big else 6, 9, 40, dtype=dt),
                         training.randn(600 if big else 6, 9, 40, dtype=dt)],
        (0, 1),
        F.geglu,
        lambda g, u: TF.gelu(g) * u,
        autocast="promote"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


def _sweep_cases():
    cases = []
    names = list(ACTS)
    for i, shape in enumerate(thread_sweep.ELEMENTWISE):
        name = names[i % 3]
        fn, code = ACTS[name]
        cases.append(thread_sweep.Case(f"{name} {shape}",
                                       lambda dt, s=shape: ((thread_sweep.randn(s, 1) * 3).to(dt),
                                                            thread_sweep.randn(s, 2).to(dt)),
                                       lambda g, u, fn=fn: (fn(g, u),), lambda g, u, code=code: (reference(g, u, code),),
                                       grads=(0, 1)))
    for i, shape in enumerate([(0, 4), (3, 0), (2, 6), (1, 2), (2, 0, 10)]):  # packed (..., 2F): two views
        name = names[i % 3]
        fn, code = ACTS[name]
        cases.append(thread_sweep.Case(f"{name} packed {shape}", lambda dt, s=shape: ((thread_sweep.randn(s, 3) * 3).to(dt),),
                                       lambda x, fn=fn: (fn(x, None),),
                                       lambda x, code=code: (reference(*x.chunk(2, -1), code),), grads=(0,)))
    return cases


SWEEP = {"glu": _sweep_cases}
