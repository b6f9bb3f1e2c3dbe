"""{name} against its PyTorch reference: values per dtype, strided views, every
ISA variant, gradients, opcheck, torch.compile, autocast, thread counts, errors.
Run: pytest"""

import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import opforge
import opforge.testing as ot
from ops import {name}, {name}_backward
from reference import {name} as reference

INPUTS = {INPUTS}  # the op's tensor arguments, in order
SCALARS = {SCALARS}  # its scalar arguments and the values the tests pass
REDUCE = {REDUCE}  # True: the last dim is reduced (output shape: the first input's without it)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |op - float64 reference| <= atol + rtol * |reference|: float32 computes, halves are rounded once at the end
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
SHAPES = [(), (0,), (1,), (7,), (17,), (123,), (4099,), (33, 17), (5, 6, 7), (2, 0, 3), (3, 1, 1000)]


def inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in INPUTS]


def args(tensors):
    return (*tensors, *SCALARS.values())


def want(tensors):
    """The reference in float64 on the same (rounded) inputs."""
    return reference(*args([t.double() for t in tensors]))


def tol(dtype, tensors):
    t = dict(TOL[dtype])
    if REDUCE and tensors[0].dim():  # a float32 sum of n terms rounds ~sqrt(n) times more than one
        t["atol"] *= max(tensors[0].shape[-1], 1) ** 0.5
    return t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values(shape, dtype):
    xs = inputs(shape, dtype)
    y = {name}(*args(xs))
    expected = want(xs)
    assert y.dtype == dtype and y.shape == expected.shape
    torch.testing.assert_close(y.double(), expected, **tol(dtype, xs))


@pytest.mark.parametrize("view", ["transposed", "strided", "broadcast", "permuted"])
def test_strided_inputs_are_read_in_place(view):
    def make(base):
        return {"transposed": base.t(), "strided": base[:, ::3], "broadcast": base[:1].expand(5, 30),
                "permuted": base.reshape(2, 10, 30).permute(2, 0, 1)}[view]

    xs = [make(torch.randn(20, 30, generator=torch.Generator().manual_seed(k))) for k in range(len(INPUTS))]
    torch.testing.assert_close({name}(*args(xs)).double(), want(xs), **tol(torch.float32, xs))


def test_every_isa_matches_the_reference_kernel():
    xs = inputs((3, 1001))
    dy = torch.randn((3,) if REDUCE else (3, 1001), generator=torch.Generator().manual_seed(9))
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = ({name}(*args(xs)), {name}_backward(dy, *args(xs)))
    finally:
        opforge.set_isa("auto")
    # elementwise: bit for bit; a reduction's vector variant adds its partial sums in another order
    exact = dict(rtol=0, atol=0) if not REDUCE else dict(rtol=1e-5, atol=1e-4)
    for isa, (y, grads) in outs.items():
        torch.testing.assert_close(y, outs["ref"][0], **exact, msg=f"{isa} forward")
        for k, (g, g_ref) in enumerate(zip(ot._tuple(grads), ot._tuple(outs["ref"][1]))):
            torch.testing.assert_close(g, g_ref, rtol=0, atol=0, msg=f"{isa} gradient of {INPUTS[k]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_match_autograd_of_the_reference(dtype):
    xs = [x.requires_grad_() for x in inputs((33, 17), dtype)]
    xr = [x.detach().double().requires_grad_() for x in xs]
    y = {name}(*args(xs))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y.backward(dy.to(dtype))
    reference(*args(xr)).backward(dy)
    for x, r, name in zip(xs, xr, INPUTS):
        assert x.grad.dtype == dtype, name
        torch.testing.assert_close(x.grad.double(), r.grad, **tol(dtype, [x]), msg=lambda m, name=name: f"d{name}: {m}")


def test_check_report_passes():
    tensors = inputs((64, 256), torch.float64)
    # a float32 sum rounds more than one operation: a looser bound (the halves keep their own, looser ones)
    loose = dict(rtol=1e-5, atol=1e-4) if REDUCE else {}
    report = ot.check(torch.ops.{name}.{name}, reference, inputs=[args(tensors)], dtypes=DTYPES, **loose)
    print(report)
    assert report.passed


@pytest.mark.parametrize("shape", [(7, 13), "transposed", ()], ids=str)
def test_opcheck(shape):
    xs = [x.t() for x in inputs((6, 5))] if shape == "transposed" else inputs(shape)
    op, backward = torch.ops.{name}.{name}.default, torch.ops.{name}.{name}_backward.default
    opcheck(op, args(xs))
    opcheck(op, args([x.clone().requires_grad_() for x in xs]))
    y = op(*args(xs))
    opcheck(backward, (torch.randn_like(y), *args(xs)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(dynamic):
    f = torch.compile(lambda *a: {name}(*a).sin(), fullgraph=True, dynamic=dynamic)
    for shape in [(16, 8), (5, 24)]:  # the second shape: a recompile, or the same graph when dynamic
        xs = [x.requires_grad_() for x in inputs(shape)]
        f(*args(xs)).sum().backward()
        xr = [x.detach().double().requires_grad_() for x in xs]
        reference(*args(xr)).sin().sum().backward()
        for x, r in zip(xs, xr):
            torch.testing.assert_close(x.grad.double(), r.grad, **tol(torch.float32, xs))


def test_autocast_bfloat16_runs_in_bfloat16():
    xs = inputs((8, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = {name}(*args(xs))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want([x.bfloat16() for x in xs]), **tol(torch.bfloat16, xs))


def test_results_do_not_depend_on_the_thread_count():
    xs = inputs((64, 4099))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {name}(*args(xs))
        torch.set_num_threads(2)
        two = {name}(*args(xs))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_input_is_a_clear_error():
    op = "{name}::{name}"
    with pytest.raises(RuntimeError, match=rf"\[{op}\] argument '{INPUTS[0]}' must be float32, bfloat16 or float16, "
                                           r"got float64"):
        {name}(*args(inputs((3,), torch.float64)))
    with pytest.raises(RuntimeError, match=rf"argument '{INPUTS[0]}' must be float32, bfloat16 or float16, got int64"):
        {name}(*args([torch.ones(3, dtype=torch.int64)] * len(INPUTS)))
    if len(INPUTS) > 1:
        with pytest.raises(RuntimeError, match=rf"argument '{INPUTS[1]}' must have the shape of '{INPUTS[0]}' "
                                               r"\[3, 4\], got \[3, 5\]"):
            {name}(*args([torch.ones(3, 4)] + [torch.ones(3, 5)] * (len(INPUTS) - 1)))
        with pytest.raises(RuntimeError, match=rf"argument '{INPUTS[1]}' must have the dtype of '{INPUTS[0]}'"):
            {name}(*args([torch.ones(3)] + [torch.ones(3, dtype=torch.bfloat16)] * (len(INPUTS) - 1)))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16, got float64"):  # compile too
        torch.compile(lambda *a: {name}(*a), fullgraph=True)(*args(inputs((3,), torch.float64)))


def test_log_line_names_the_kernel_that_ran():
    code = ("import torch, ops; xs = [torch.rand(4, 8, requires_grad=True) for _ in range(%d)]; "
            "ops.{name}(*xs, *%r).sum().backward()" % (len(INPUTS), tuple(SCALARS.values())))
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OPFORGE_LOG_LEVEL="debug"))
    assert r.returncode == 0, r.stderr
    variant = "avx2" if "avx2" in opforge.supported_isas() else "ref"
    for op in ("{name}::{name} ", "{name}::{name}_backward "):
        lines = [line for line in r.stderr.splitlines() if op in line and "[opforge info]" in line]
        assert len(lines) == 1 and f"kernels={name}:{variant} " in lines[0], r.stderr
        assert any(op.strip() + " layout:" in line for line in r.stderr.splitlines()), r.stderr


# ---- on the GPU (opforge new --cuda): the same checks on the op's CUDA kernels -------------------------

CUDA_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key("{name}::{name}", "CUDA")
gpu = pytest.mark.skipif(not (CUDA_KERNEL and torch.cuda.is_available()),
                         reason="no GPU here" if CUDA_KERNEL else "no CUDA kernel: the project has no {name}.cu "
                         "(opforge new --cuda) or nvcc could not build it")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_values(shape, dtype):
    xs = inputs(shape, dtype)
    y = {name}(*args([x.cuda() for x in xs]))
    assert y.device.type == "cuda" and y.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), want(xs), **tol(dtype, xs))


@gpu
@pytest.mark.parametrize("view", ["transposed", "strided", "broadcast"])
def test_cuda_strided_inputs(view):
    def make(base):
        return {"transposed": base.t(), "strided": base[:, ::3], "broadcast": base[:1].expand(5, 30)}[view]

    xs = [make(torch.randn(20, 30, generator=torch.Generator().manual_seed(k))) for k in range(len(INPUTS))]
    got = {name}(*args([make(torch.randn(20, 30, generator=torch.Generator().manual_seed(k)).cuda())
                        for k in range(len(INPUTS))]))
    torch.testing.assert_close(got.cpu().double(), want(xs), **tol(torch.float32, xs))


@gpu
def test_cuda_gradients_and_opcheck():
    xs = [x.cuda().requires_grad_() for x in inputs((33, 17))]
    xr = [x.detach().cpu().double().requires_grad_() for x in xs]
    dy = torch.randn(({name}(*args(xs))).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    {name}(*args(xs)).backward(dy.float().cuda())
    reference(*args(xr)).backward(dy)
    for x, r in zip(xs, xr):
        torch.testing.assert_close(x.grad.cpu().double(), r.grad, **tol(torch.float32, xs))
    opcheck(torch.ops.{name}.{name}.default, args([x.detach().clone().requires_grad_() for x in xs]))
    f = torch.compile(lambda *a: {name}(*a).sin(), fullgraph=True)
    torch.testing.assert_close(f(*args(xs)), {name}(*args(xs)).sin())
