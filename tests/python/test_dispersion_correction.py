"""dispersion_correction against PyTorch: values per dtype, shapes, strides,
gradients, opcheck, torch.compile, autocast, bad input, logging, ISA, threads."""

import math
import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import references as refs
from opforge.references.dispersion_correction import dispersion_correction as reference
from opforge.testing import DTYPES, assert_close

OP = torch.ops.opforge.dispersion_correction.default
BWD = torch.ops.opforge.dispersion_correction_backward.default
ALPHA = 0.8

SHAPES = [(), (0,), (0, 5), (1,), (7,), (15,), (16,), (17,), (123,), (4097,), (32, 512), (5, 123, 123)]


def positive(shape, dtype=torch.float32, lo=0.0, hi=10.0):
    return (torch.rand(shape, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def ref64(x, alpha=ALPHA):
    return reference(x.double(), alpha)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values(dtype, shape):
    x = positive(shape, dtype)
    y = opforge.dispersion_correction(x, ALPHA)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert_close(y, ref64(x), dtype, f"shape {shape}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_round_once(dtype):
    # fp32 compute and one rounding: never further from the exact result than
    # eager PyTorch, which rounds after each of its three ops
    x = positive((4096,), dtype)
    ours = (opforge.dispersion_correction(x, ALPHA).double() - ref64(x)).abs().max()
    eager = (reference(x, ALPHA).double() - ref64(x)).abs().max()
    assert ours <= eager
    if dtype == torch.float16:  # the brief's checklist: fp16 absolute error < 1e-3
        # (on outputs below 2, where half an fp16 ulp is 4.9e-4)
        x = positive((4096,), dtype, hi=1.0)
        assert (opforge.dispersion_correction(x, ALPHA).double() - ref64(x)).abs().max() < 1e-3


def test_special_values():
    x = torch.tensor([0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-40, 4.0])
    y = opforge.dispersion_correction(x, ALPHA)
    torch.testing.assert_close(y, reference(x, ALPHA), equal_nan=True, rtol=1e-6, atol=0)
    assert y[2].isnan() and y[4].isnan() and y[5].isnan()  # negative in, NaN out, as torch.sqrt


def _views(dtype=torch.float64):
    base = positive((20, 30), dtype, hi=5.0)
    return {
        "transposed": base.t(),
        "row-slice": base[2:9, 3:16],
        "step-2": base[:, ::2],
        "broadcast": positive((1, 30), dtype).expand(6, 30),
        "permuted-3d": positive((4, 5, 6), dtype).permute(2, 0, 1),
        "transposed-slice": base[5:, 7:].t()[3:],
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(_views()))
def test_strided_inputs_read_in_place(name, dtype):
    x = _views(dtype)[name]
    y = opforge.dispersion_correction(x, ALPHA)
    assert_close(y, ref64(x), dtype, name)
    # a dense layout (torch.empty_like keeps it) is kept; any other comes back contiguous
    dense = torch.empty_like(x).stride() == x.stride()
    assert y.stride() == (x.stride() if dense else torch.empty(x.shape).stride())


def test_gradcheck_float64():
    x = positive((7, 13), torch.float64, lo=0.5, hi=4.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: opforge.dispersion_correction(t, ALPHA), (x,))
    assert torch.autograd.gradcheck(lambda t: opforge.dispersion_correction(t, ALPHA), (x.detach().t().requires_grad_(),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_autograd_of_reference(dtype):
    x = positive((33, 17), dtype, lo=0.1).requires_grad_()
    g = torch.randn(33, 17, dtype=dtype)
    opforge.dispersion_correction(x, ALPHA).backward(g)
    x64 = x.detach().double().requires_grad_()
    reference(x64, ALPHA).backward(g.double())
    assert x.grad.dtype == dtype
    assert_close(x.grad, x64.grad, dtype, "grad")


def test_gradient_at_zero_and_negative_matches_autograd():
    x = torch.tensor([0.0, 0.0, -1.0, 1.0], requires_grad=True)
    g = torch.tensor([1.0, 0.0, 1.0, 1.0])
    opforge.dispersion_correction(x, ALPHA).backward(g)
    xr = x.detach().clone().requires_grad_()
    reference(xr, ALPHA).backward(g)
    torch.testing.assert_close(x.grad, xr.grad, equal_nan=True)
    assert x.grad[0] == float("inf") and x.grad[1].isnan() and x.grad[2].isnan()


def test_no_graph_without_grad():
    x = torch.rand(5, requires_grad=True)
    assert opforge.dispersion_correction(x, ALPHA).grad_fn is not None
    with torch.no_grad():
        assert opforge.dispersion_correction(x, ALPHA).grad_fn is None
    assert opforge.dispersion_correction(x.detach(), ALPHA).grad_fn is None


@pytest.mark.parametrize(
    "x",
    [torch.rand(7, 13), torch.rand(5, 6).t(), torch.rand(3, 4, 5)[:, ::2], torch.rand(()), torch.rand(0, 3)],
    ids=["contiguous", "transposed", "strided", "0-dim", "empty"],
)
def test_opcheck(x):
    opcheck(OP, (x, ALPHA))
    opcheck(OP, (x.clone().requires_grad_(), ALPHA))
    opcheck(BWD, (torch.rand_like(x), x, ALPHA))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    def f(t):
        return opforge.dispersion_correction(t, ALPHA).sin() * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (16, 33):
        x = positive((n, 8), lo=0.1).requires_grad_()
        y = compiled(x)
        y.sum().backward()
        x2 = x.detach().clone().requires_grad_()
        (reference(x2, ALPHA).sin() * 2).sum().backward()
        torch.testing.assert_close(y, reference(x.detach(), ALPHA).sin() * 2)
        torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_the_input_as_eager(dtype):
    # policy promote: the dtype eager x * alpha + sqrt(x) has under autocast (the input's; the widest of several)
    x = positive((32, 512), lo=0.1).requires_grad_()
    x16 = x.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y = opforge.dispersion_correction(x16, ALPHA)
        z = torch.compile(lambda t: opforge.dispersion_correction(t, ALPHA), fullgraph=True)(x16)
        w = opforge.dispersion_correction(x, ALPHA)
    assert y.dtype == dtype and z.dtype == dtype and w.dtype == torch.float32
    assert_close(y, ref64(x16.detach()), dtype, "autocast")
    assert_close(w, ref64(x.detach()), torch.float32, "autocast float32")
    torch.testing.assert_close(y, z)
    y.float().sum().backward()
    w.sum().backward()
    assert x16.grad.dtype == dtype and x.grad.dtype == torch.float32
    # float64 is left alone, as torch's autocast does
    with torch.autocast("cpu", dtype=dtype):
        assert opforge.dispersion_correction(x.detach().double(), ALPHA).dtype == torch.float64


# ---- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_rejects_non_float_dtypes(dtype):
    x = torch.ones(4, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"\[opforge::dispersion_correction\] argument 'x' must be a floating-point tensor .*got " + str(dtype).split(".")[1]):
        opforge.dispersion_correction(x, ALPHA)


def test_the_cpu_kernel_checks_meta_tensors_and_computes_nothing():
    # the fake kernel runs the C kernel on meta stand-ins: it checks and shapes, as for real tensors
    m = torch.empty(3, 5, device="meta").t()
    cpu_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    out = OP.redispatch(cpu_only, m, ALPHA)
    assert out.device.type == "meta" and out.shape == (5, 3) and out.stride() == (1, 5)
    with pytest.raises(RuntimeError, match=r"\[opforge::dispersion_correction\] argument 'x' must be a floating-point"):
        OP.redispatch(cpu_only, torch.empty(3, device="meta", dtype=torch.int32), ALPHA)
    # through the front door, and mixed with a cpu tensor in the backward
    assert opforge.dispersion_correction(m, ALPHA).shape == (5, 3)
    with pytest.raises(RuntimeError, match=r"argument 'x' must be on the device of 'grad' \(cpu\), got meta"):
        torch.ops.opforge.dispersion_correction_backward(torch.randn(3), torch.empty(3, device="meta"), ALPHA)


@pytest.mark.parametrize(
    "args, pattern",
    [
        ((torch.rand(3), "a"), r"dispersion_correction\(\) Expected a value of type 'float' for argument 'alpha' but instead found type 'str'"),
        (([1.0, 2.0], 0.5), r"dispersion_correction\(\) Expected a value of type 'Tensor' for argument 'x' but instead found type 'list'"),
        ((torch.rand(3),), r"dispersion_correction\(\) is missing value for argument 'alpha'"),
    ],
)
def test_rejects_wrong_argument_types(args, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.opforge.dispersion_correction(*args)


def test_backward_op_checks_its_arguments():
    x = torch.rand(3)
    with pytest.raises(RuntimeError, match=r"argument 'grad' must have the shape of 'x' \[3\], got \[4\]"):
        BWD(torch.rand(4), x, ALPHA)
    with pytest.raises(RuntimeError, match=r"argument 'grad' must have the dtype of 'x' \(float32\), got float64"):
        BWD(torch.rand(3, dtype=torch.float64), x, ALPHA)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_failing_calls_do_not_leak():
    bad = torch.ones(1024, dtype=torch.int64)
    shape_bad = (torch.rand(4), torch.rand(3))

    def fail_many(n):
        for _ in range(n):
            try:
                OP(bad, ALPHA)
            except RuntimeError:
                pass
            try:
                BWD(shape_bad[0], shape_bad[1], ALPHA)
            except RuntimeError:
                pass

    fail_many(5000)  # warm up allocator caches
    before = _rss_bytes()
    fail_many(50_000)  # 100,000 failing calls in all
    grown = _rss_bytes() - before
    # one leaked handle per call would be >= 100,000 * ~200 B = 20 MB
    assert grown < 4 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 100,000 failing calls"


# ---- runtime: logging, ISA, threads, profiler ------------------------------------------


def _run_python(code, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_log_line_at_info():
    code = "import torch, opforge; opforge.dispersion_correction(torch.rand(32, 512), 0.8)"
    quiet = _run_python(code)
    assert quiet.returncode == 0 and "opforge" not in quiet.stderr
    r = _run_python(code, OPFORGE_LOG_LEVEL="info")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "opforge::dispersion_correction" in line]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    # the variant that ran (on an AVX512-BF16 CPU: the avx512 one, not the machine's best ISA)
    name, isa = next((n, i) for n, i, cur in opforge.kernel_variants()["dispersion_correction"] if cur)
    for part in ("float32[32, 512] float32[32, 512]", f"isa={isa} kernels=dispersion_correction:{name}", "threads=",
                 "us"):
        assert part in line, line


def test_log_file(tmp_path):
    path = tmp_path / "ops.log"
    r = _run_python(
        "import torch, opforge; opforge.dispersion_correction(torch.rand(3), 0.8)",
        OPFORGE_LOG_LEVEL="info",
        OPFORGE_LOG_FILE=str(path),
    )
    assert r.returncode == 0, r.stderr
    assert "opforge::dispersion_correction float32[3]" in path.read_text()


def test_bad_log_level_is_a_clear_error():
    r = _run_python("import opforge", OPFORGE_LOG_LEVEL="loud")
    assert r.returncode != 0 and "expected one of error, warning, info, debug" in r.stderr


def test_isa_override_env():
    r = _run_python("import opforge; print(opforge.get_isa())", OPFORGE_ISA="ref")
    assert r.returncode == 0 and r.stdout.strip() == "ref", r.stderr
    r = _run_python("import opforge", OPFORGE_ISA="sse9")
    assert r.returncode != 0 and "expected one of auto, ref, avx2, avx512, avx512_bf16, amx" in r.stderr
    for isa in ("avx2", "avx512", "avx512_bf16", "amx"):
        if isa not in opforge.supported_isas():
            r = _run_python("import opforge", OPFORGE_ISA=isa)
            assert r.returncode != 0 and "not supported by this CPU" in r.stderr


def test_supported_isas_are_in_order():
    isas = opforge.supported_isas()
    assert isas[0] == "ref" and isas[-1] == opforge.isa_best()
    assert isas == ["ref", "avx2", "avx512", "avx512_bf16", "amx"][: len(isas)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_matches_the_reference_bitwise(dtype):
    x = positive((3, 4099), dtype)
    x[0, :50] = torch.tensor([0.0, -1.0, float("inf"), float("nan"), 1e-40] * 10, dtype=dtype)
    g = torch.randn(3, 4099, dtype=dtype)
    results = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            assert opforge.get_isa() == isa
            results[isa] = (OP(x, ALPHA), BWD(g, x, ALPHA), OP(x.t(), ALPHA))
    finally:
        opforge.set_isa("auto")
    for isa, outs in results.items():
        for got, want in zip(outs, results["ref"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{isa} vs ref")
    with pytest.raises(RuntimeError, match="expected one of auto, ref, avx2, avx512, avx512_bf16, amx"):
        opforge.set_isa("neon")


def test_one_thread_after_set_num_threads():
    code = (
        "import torch, opforge; torch.set_num_threads(1); x = torch.rand(1 << 20);"
        "y = opforge.dispersion_correction(x, 0.8); torch.testing.assert_close(y, x * 0.8 + x.sqrt())"
    )
    r = _run_python(code, OPFORGE_LOG_LEVEL="info")
    assert r.returncode == 0, r.stderr
    assert "threads=1 " in r.stderr, r.stderr


def test_profiler_shows_the_op_with_shapes():
    x = torch.rand(32, 512)
    with torch.profiler.profile(record_shapes=True) as prof:
        opforge.dispersion_correction(x, ALPHA)
    events = [e for e in prof.events() if e.name == "opforge::dispersion_correction"]
    assert events and events[0].input_shapes[0] == [32, 512]


def _available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_more_than_2_31_elements():
    n = (1 << 31) + 17  # bfloat16: 4 GiB in, 4 GiB out
    if _available_bytes() < 12 * 2**30:
        pytest.skip("needs 12 GiB of free memory")
    x = torch.full((n,), 4.0, dtype=torch.bfloat16)
    x[-3:] = torch.tensor([9.0, 16.0, 0.25], dtype=torch.bfloat16)
    y = opforge.dispersion_correction(x, 0.5)
    assert y[0].item() == 4.0 and y[(1 << 31) + 1].item() == 4.0
    assert y[-3:].tolist() == [7.5, 12.0, 0.625]


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random shapes near where the plan changes, layouts, specials, dtypes, ISAs and threads, against
# float64 torch

DC_MARKS = (7, 8, 15, 16, 17, 31, 32, 33, 64, 4097, 32767, 32768, 32769, 65536, 100000)  # vectors, the 32768 grain
EDGE_VALUES = (0.0, -0.0, -1.0, math.inf, -math.inf, math.nan, 1e-40, 1e-6, 65000.0)


def _fuzz_draw(rng, c):
    nd = rng.choices((0, 1, 2, 3, 4), (0.05, 0.3, 0.35, 0.2, 0.1))[0]
    shape = []
    for _ in range(nd):
        shape.append(fuzz.dim(rng, 1 << 17 if nd == 1 else 1536 if nd == 2 else 96, DC_MARKS, zero=0.03))
    while math.prod(shape) > 4_000_000:
        shape[shape.index(max(shape))] //= 2
    c["shape"] = shape
    c["layout"] = fuzz.layout(rng, shape)
    c["alpha"] = rng.choice((0.8, 0.0, -1.5, 1e-3, round(rng.uniform(-3, 3), 5)))
    c["specials"] = rng.random() < 0.3  # 0, -0, negatives, inf, nan, subnormals among the inputs
    c["grad"] = rng.random() < 0.5
    return fuzz.seconds(c, 0, 0, math.prod(shape) * 30)


def _fuzz_describe(c):
    return (f"x={tuple(c['shape'])}{fuzz.layout_str(c['layout'])} alpha={c['alpha']} specials={c['specials']} "
            f"grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    base, view = fuzz.make(gen, c["shape"], dtype, c["layout"], fill="rand")
    if c["specials"] and base.numel():
        idx = torch.randint(0, base.numel(), (min(base.numel(), 32),), generator=gen)
        pick = torch.randint(0, len(EDGE_VALUES), idx.shape, generator=gen)
        base.view(-1)[idx] = torch.tensor(EDGE_VALUES, dtype=torch.float64)[pick].to(dtype)
    base.requires_grad_(c["grad"])
    x = view(base)
    alpha = c["alpha"]
    g = fuzz.random_tensor(gen, c["shape"], dtype)

    def forward_backward():
        y = opforge.dispersion_correction(x, alpha)
        return y, (torch.autograd.grad(y, x, g)[0] if c["grad"] else None)

    if c["grad"]:
        y, dx = call(forward_backward)
    else:
        with torch.no_grad():
            y, dx = call(forward_backward)
    # alpha is rounded to the compute type: float32 for all but float64
    a = alpha if dtype == torch.float64 else float(torch.tensor(alpha, dtype=torch.float32))
    u = fuzz.U_ACC[dt]
    x64 = x.detach().double()
    root = x64.sqrt()
    want = x64 * a + root
    terms = (x64 * a).abs() + root.abs()
    checks = [fuzz.Check("out", y, want, 4 * u * terms.nan_to_num(0.0, 0.0, 0.0) + fuzz.out_tol(want, dt), dtype)]
    if c["grad"]:
        g64 = g.double()
        gwant = g64 * a + g64 / (2 * root)
        gterms = (g64 * a).abs() + (g64 / (2 * root)).abs()
        checks.append(fuzz.Check("dx", dx, gwant, 4 * u * gterms.nan_to_num(0.0, 0.0, 0.0) + fuzz.out_tol(gwant, dt), dtype))
    return checks


FUZZ = {
    # dispersion_correction.h: float32 from the 16-bit inputs to the rounded results
    "dispersion_correction": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.1, order=4, seeded=True,
                                     rounded={("*", "*"): ()}),
}


# test_export.py: the op's part of the exported model


def _export(g, hidden, vocab, max_len):
    # sqrt inside: fed probabilities, not raw values
    return {}, lambda x, target: (opforge.dispersion_correction(torch.softmax(x, -1), 0.5),)


EXPORT = {"dispersion_correction": _export}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "dispersion_correction": training.Case(
        ("dispersion_correction",),
        lambda dt, big: [training.randn(*((600, 257) if big else (9, 37)), dtype=dt, lo=0.1)],
        (0,),
        lambda x: opforge.dispersion_correction(x, 0.7),
        lambda x: x * 0.7 + torch.sqrt(x),
        autocast="promote"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


def _sweep_cases():
    cases = []
    for shape in thread_sweep.ELEMENTWISE + ["t"]:
        def make(dt, shape=shape):
            if shape == "t":  # transposed: strided, read in place
                return ((torch.rand(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.25).to(dt).t(), 0.7)
            return ((torch.rand(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.25).to(dt), 0.7)
        cases.append(thread_sweep.Case(f"dispersion_correction {shape}", make, lambda x, a: (opforge.dispersion_correction(x, a),),
                          lambda x, a: (refs.dispersion_correction(x, a),), grads=(0,)))
    return cases


SWEEP = {"dispersion_correction": _sweep_cases}
